"""``bench/rollout.py`` on CPU: the tiny shapes through every mix, and the stream mix's window, whose
token count must neither miss nor double-count a row."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest
import torch

from conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_rollout", os.path.join(REPO, "bench", "rollout.py"))
bench_rollout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_rollout)


def _args(**over) -> argparse.Namespace:
    args = dict(prompt_len=8, new_tokens=8, longtail_min=2, longtail_max=24, batches=[4], longtail_batches=[4],
                compile_decode=False, bandwidth=4.8e12, stream_warmup=24, stream_steps=40, generate_max_batch=0,
                generate_max_time=30.0, profile=False, profile_top=4)
    args.update(over)
    return argparse.Namespace(**args)


@pytest.mark.parametrize("check_every", [1, 4])
def test_stream_window_counts_each_token_once(check_every):
    """With a check every step a finished row's slot is refilled before the next step, so every step
    makes one token per slot: the window holds exactly steps x slots tokens. Checking every 4 steps
    leaves slots empty between checks: fewer, never more."""
    bench = bench_rollout.Bench("tiny", _args(), torch.device("cpu"), torch.float32)
    bench.fd.check_every = check_every
    row = bench.stream(4)
    window = bench.args.stream_steps * 4
    assert row["mix"] == "stream" and row["slots"] == 4 and row["rows"] > 4 * 2
    if check_every == 1:
        assert row["tokens"] == window and row["occupancy"] == 1.0
    else:
        assert 0.5 * window < row["tokens"] < window
    assert row["of_fixed"] is None  # no fixed row at this batch in this run
    fixed = bench.fixed(4)
    assert fixed["tokens"] == 4 * 8
    assert bench.stream(4)["of_fixed"] > 0
    bench.close()


def test_every_mix_runs_and_prints_its_table(capsys):
    """The CPU smoke run of the docstring, cut down: fixed, long tail and stream rows for one shape."""
    rows: list[dict] = []
    args = _args(mixes=["fixed", "longtail", "stream"], rows_per_slot=[2], attention=["auto"])
    bench_rollout.run_shape("tiny-moe", args, torch.device("cpu"), torch.float32, rows)
    assert [r["mix"] for r in rows] == ["fixed", "longtail", "stream"]
    longtail = rows[1]
    assert longtail["tokens"] == sum(  # the per-row limits were forced: every drawn length made
        int(n) for n in bench_rollout.draw_limits(args, 8)) and longtail["of_fixed"] > 0
    bench_rollout.print_table(rows)
    out = capsys.readouterr().out
    assert "stream" in out and "longtail" in out
