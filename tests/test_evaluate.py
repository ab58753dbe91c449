"""``python -m spmd_rl.evaluate``: held-out prompts, checkpoint weights, the split over ranks."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import HERE, REPO
from spmd_rl.config import load_config
from spmd_rl.distributed.testing import run_program
from spmd_rl.evaluate import EvalFlags, held_out_prompts
from spmd_rl.export import export_hf
from test_train_e2e import TINY, _check, launch

GSM8K_TEST = os.path.join(HERE, "data", "gsm8k", "test.jsonl")  # a sample: tests/data/gsm8k/README.md
EVAL = [*TINY[:2],  # the trained run's model
        "--data.val-size", "12", "--rollout.max-new-tokens", "6", "--reward.fn", "support.rewards:digit_fraction"]


def evaluate(*flags: str, nproc: int = 1) -> subprocess.CompletedProcess:
    return run_program("spmd_rl.evaluate", list(flags), nproc=nproc, cwd=REPO, timeout=600,
                       env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1"))


def samples(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step tiny run with a large learning rate (its weights differ from the base) and its export."""
    out = tmp_path_factory.mktemp("evaluate") / "run"
    _check(launch(str(out), "--trainer.total-steps", "3", "--checkpoint.every", "3", nproc=1))
    hf = out.parent / "hf"
    export_hf(str(out), str(hf))
    return out, hf


def test_checkpoint_weights_are_the_exported_ones(trained, tmp_path):
    run, hf = trained
    base, ckpt, exported = (tmp_path / f"{n}.jsonl" for n in ("base", "ckpt", "exported"))
    _check(evaluate(*EVAL, "--samples-out", str(base)))
    _check(evaluate(*EVAL, "--from-checkpoint", str(run), "--samples-out", str(ckpt), "--out", str(tmp_path / "s.json")))
    _check(evaluate(*EVAL, "--model.path", str(hf), "--samples-out", str(exported)))
    got = [r["completion"] for r in samples(ckpt)]
    assert got == [r["completion"] for r in samples(exported)]
    assert got != [r["completion"] for r in samples(base)], "the checkpoint's weights were not loaded"
    summary = json.loads((tmp_path / "s.json").read_text())
    rows = samples(ckpt)
    assert summary["prompts"] == len(rows) == 12
    assert summary["score"] == pytest.approx(sum(r["score"] for r in rows) / 12)
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 12)


def test_two_ranks_score_the_same_prompts_as_one(tmp_path):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    _check(evaluate(*EVAL, "--data.val-size", "7", "--samples-out", str(one)))
    proc = evaluate(*EVAL, "--data.val-size", "7", "--samples-out", str(two), nproc=2)
    _check(proc)
    assert samples(one) == samples(two)
    assert [r["index"] for r in samples(two)] == list(range(7))
    assert "on 7 prompts" in proc.stdout


def test_held_out_prompts_of_a_file_are_all_of_it_unless_limited():
    flags = ["--data.task", "gsm8k", "--data.path", GSM8K_TEST, "--data.val-path", GSM8K_TEST, "--data.val-size", "8"]
    cfg, extra = load_config(flags, prog="spmd_rl.evaluate", extra=EvalFlags)
    with open(GSM8K_TEST) as f:
        records = sum(1 for line in f if line.strip())
    assert len(held_out_prompts(cfg, extra.limit)) == records > cfg.data.val_size
    assert len(held_out_prompts(cfg, 5)) == 5


@pytest.mark.parametrize("flags, message", [
    (["--from-checkpoint", "/nonexistent/run"], "--from-checkpoint /nonexistent/run: no such file"),
    (["--limit", "-1"], "--limit must be >= 0"),
    (["--data.val-size", "0"], "no held-out prompts to evaluate"),
])
def test_bad_input_is_named(flags, message):
    proc = evaluate(*EVAL, *flags)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]

