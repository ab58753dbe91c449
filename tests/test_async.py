"""Asynchronous GRPO on a rollout pool (CPU, gloo, tiny model, real processes under torchrun).

* every update's samples are at most ``trainer.max_staleness`` policy versions old (from the
  per-token versions the rollout records), exactly that old once the pipeline is full;
* it still learns; a run resumed from a checkpoint taken with rounds in flight completes;
* generation overlaps the update: a step takes less than generating plus updating.
"""

from __future__ import annotations

import statistics

import pytest

from test_pools import run_ok
from test_train_e2e import read_metrics

POOL = ["--pools.rollout-ranks", "1", "--algo.rollout-is", "token_truncated", "--trainer.val-every", "0"]


def test_one_step_off_learns_with_bounded_staleness(tmp_path):
    """S = 1: the rounds issued at the start use version 0, every later one is exactly one version
    behind (from the per-token versions); one round stays in flight; the reward still rises."""
    out = str(tmp_path / "run")
    err = run_ok(out, *POOL, "--trainer.max-staleness", "1", "--trainer.total-steps", "30", nproc=2)
    steps = [m for m in read_metrics(out) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == list(range(1, 31))
    for m in steps:
        assert m["async/staleness/max"] == min(m["step"] - 1, 1) == m["async/staleness/mean"], m
        assert m["async/queue_depth"] == min(1, 30 - m["step"]), m  # rounds still in flight after this one's
        assert "timing_s/wait_rollout" in m and "timing_s/wait_weights" in m
    assert "warning: trainer.max_staleness" not in err  # IS correction on: no warning
    first = sum(m["critic/score/mean"] for m in steps[:5]) / 5
    last = sum(m["critic/score/mean"] for m in steps[-5:]) / 5
    assert last > first + 0.15, f"reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"


def test_resume_with_rounds_in_flight(tmp_path):
    """The checkpoint of step 3 of a run with S = 2 holds the rounds of steps 4-6, in flight when it
    was taken; a run resumed from it generates them again, from the resumed weights (version 3)."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    flags = [*POOL, "--trainer.max-staleness", "2", "--trainer.total-steps", "6"]
    run_ok(first, *flags, "--checkpoint.every", "3", "--checkpoint.keep", "2", nproc=2)
    run_ok(second, *flags, "--checkpoint.resume", str(tmp_path / "first" / "checkpoints" / "step_3"), nproc=2)
    original = {m["step"]: m for m in read_metrics(first) if "async/staleness/max" in m}
    resumed = {m["step"]: m for m in read_metrics(second) if "async/staleness/max" in m}
    assert sorted(resumed) == [4, 5, 6]
    assert [original[s]["async/staleness/max"] for s in range(1, 7)] == [0, 1, 2, 2, 2, 2]
    assert [resumed[s]["async/staleness/max"] for s in (4, 5, 6)] == [0, 1, 2]


@pytest.mark.alone  # it measures two processes side by side: no other test's processes beside them
def test_generation_overlaps_the_update(tmp_path):
    """One actor and one rollout process (one core each): a one-step-off step takes clearly less than
    the rollout's generation plus the actor's own work (the step less its waits), which is what a
    synchronous step costs; both are measured in the same run."""
    out = str(tmp_path / "run")
    run_ok(out, *POOL, "--rollout.max-new-tokens", "48", "--rollout.ignore-eos", "--trainer.total-steps", "8",
           "--actor.micro-batch-size", "8", "--trainer.max-staleness", "1", nproc=2)
    rows = [m for m in read_metrics(out) if m["step"] >= 3 and "timing_s/step" in m]
    step = statistics.median(m["timing_s/step"] for m in rows)
    serial = statistics.median(m["async/rollout_busy_s"] + m["timing_s/step"] - m["timing_s/wait_rollout"]
                               - m["timing_s/wait_weights"] for m in rows)
    assert step < 0.8 * serial, f"one-step-off {step:.3f} s/step against generation + actor work {serial:.3f} s"
    assert statistics.median(m["async/actor_idle_frac"] for m in rows) < 0.2  # generation hides behind the update


def test_partial_rollouts_continue_under_new_weights(tmp_path):
    """``rollout.partial`` with S = 1 and a rollout slower than the update (a delay per decode step):
    the weights of update t reach the rollout in the middle of round t + 1, whose unfinished
    responses go on under them. Per-token versions bound the staleness by S; rows span two versions;
    the tokens the new weights sampled have the trainer's own log-probs (recomputed, fp32), so the
    continuation was prefilled again under the new weights."""
    out = str(tmp_path / "run")
    run_ok(out, *POOL, "--trainer.max-staleness", "1", "--rollout.partial", "--rollout.partial-chunk", "2",
           "--rollout.token-delay-s", "0.1", "--rollout.max-new-tokens", "16", "--rollout.ignore-eos",
           "--rollout.length-dist", "lognormal", "--rollout.min-new-tokens", "4", "--trainer.total-steps", "6", nproc=2)
    steps = [m for m in read_metrics(out) if "async/staleness/max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert m["async/staleness/max"] <= 1, m
        assert m["async/logprob_abs_diff_fresh"] < 1e-4, m  # fresh tokens: only fp32 noise
        assert m["async/tokens_staleness_0"] + m["async/tokens_staleness_1"] == pytest.approx(
            m["response_length/mean"] * 64), m
    # the update is ~0.3 s, a round ~1.6 s, so most rounds after the first two get new weights mid-way
    # (on a crowded machine an update can outlast a round: then only some of them)
    mixed = [m for m in steps if m["async/partial_frac"] > 0 and 0 < m["async/staleness/mean"] < 1]
    assert mixed, [(m["async/partial_frac"], m["async/staleness/mean"]) for m in steps]
    assert all(m["response_length/max"] <= 16 and m["response_length/min"] >= 4 for m in steps)
