"""Asynchronous GRPO on a rollout pool (CPU, gloo, tiny model, real processes under torchrun).

* every update's samples are at most ``trainer.max_staleness`` policy versions old (from the
  per-token versions the rollout records), exactly that old once the pipeline is full;
* it still learns; a run resumed from a checkpoint taken with rounds in flight completes;
* generation overlaps the update on a long-tailed workload: with S = 1 a round is in flight while
  the actor updates, and the actor waits for less than the round's generation (read from the run's
  own metrics, no wall-clock comparison between runs);
* partial rollouts: rows continue under weights that arrive mid-round, fresh tokens carry the new
  policy's log-probs;
* staged weights: the actor's weight sync no longer waits for the round in progress, and nothing
  trained on changes.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from test_pools import assert_same, learning_metrics, run_ok
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


def test_long_tail_rounds_are_generated_while_the_actor_updates(tmp_path):
    """A long tail on one actor and one rollout process: response lengths drawn per response
    (lognormal, 2..24 tokens) and a rollout that sleeps 30 ms per decode step, so a round waits for
    its longest response while the actor's work follows the total tokens. With S = 1 the overlap is
    structural, and read from the run's own records: after each step's take one round is in flight
    (the rollout generates it while the actor updates), its samples are one version old, and the
    actor waits for less than the rollout spends generating the round (the part generated during the
    previous update is not waited for). No wall-clock ratio between runs: a busy machine slows both
    halves, and the records stay what they are."""
    flags = [*POOL, "--rollout.max-new-tokens", "24", "--rollout.ignore-eos", "--rollout.length-dist", "lognormal",
             "--rollout.min-new-tokens", "2", "--rollout.token-delay-s", "0.03", "--trainer.total-steps", "6",
             "--actor.micro-batch-size", "8", "--trainer.max-staleness", "1"]
    run_ok(str(tmp_path / "run"), *flags, nproc=2)
    steps = [m for m in read_metrics(str(tmp_path / "run")) if "async/staleness/max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert m["async/staleness/max"] == min(m["step"] - 1, 1), m
        assert m["async/queue_depth"] == min(1, 6 - m["step"]), m  # the round generated during this update
    # steps 2-5: the round taken was issued before the previous update and generated during it
    overlapped = [(m["timing_s/wait_rollout"], m["async/rollout_busy_s"]) for m in steps if 2 <= m["step"] <= 5]
    assert statistics.median(w / busy for w, busy in overlapped) < 1, \
        f"the actor waited for whole rounds (wait_rollout s, generation s): {overlapped}"


def test_partial_rollouts_continue_under_new_weights(tmp_path):
    """``rollout.partial`` with S = 2 and a rollout slower than the update (a delay per decode step):
    the weights of update t reach the rollout in the middle of round t + 1 (it first takes round
    t + 2's command and prompts, issued before them), whose unfinished responses go on under them.
    Per-token versions bound the staleness by S; rows span two versions; the tokens the new weights
    sampled have the trainer's own log-probs (recomputed, fp32), so the continuation was prefilled
    again under the new weights. Validation rounds queue behind the training rounds."""
    out = str(tmp_path / "run")
    run_ok(out, *POOL, "--trainer.max-staleness", "2", "--rollout.partial", "--rollout.partial-chunk", "2",
           "--rollout.token-delay-s", "0.1", "--rollout.max-new-tokens", "16", "--rollout.ignore-eos",
           "--rollout.length-dist", "lognormal", "--rollout.min-new-tokens", "4", "--trainer.total-steps", "6", "--trainer.val-every", "3", nproc=2)
    assert sum("val/accuracy" in m for m in read_metrics(out)) == 3
    steps = [m for m in read_metrics(out) if "async/staleness/max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    for m in steps:
        assert m["async/staleness/max"] <= 2, m
        assert m.get("async/logprob_abs_diff_fresh", 0.0) < 1e-4, m  # fresh tokens (if any): only fp32 noise
        assert sum(m[f"async/tokens_staleness_{k}"] for k in range(3)) == pytest.approx(m["response_length/mean"] * 64), m
    # the update is ~0.3 s, a round ~1.6 s, so most rounds after the first two get new weights mid-way
    # (on a crowded machine an update can outlast a round: then only some of them)
    # (which two versions a row spans, 0-1 or 1-2, depends on how far the rollout runs ahead)
    def versions_in(m):
        return sum(m[f"async/tokens_staleness_{k}"] > 0 for k in range(3))
    mixed = [m for m in steps if m["async/partial_frac"] > 0 and versions_in(m) >= 2]
    assert mixed, [(m["async/partial_frac"], m["async/staleness/mean"]) for m in steps]
    assert all(m["response_length/max"] <= 16 and m["response_length/min"] >= 4 for m in steps)


@pytest.mark.parametrize("partial", [False, True], ids=["staged-drain", "partial"])
def test_streamed_groups_keep_staleness_bounded_end_to_end(tmp_path, partial: bool):
    """``rollout.stream`` with S = 1 on 2 actor + 2 rollout ranks (the controller takes groups from
    both rollout ranks and hands the other actor rank its rows), response lengths drawn per row (a
    long tail): every step trains on complete groups none more than S versions old, the queue stays
    within (S + 1) x train_batch_size groups, validation drains the stream and runs between steps.
    Without ``rollout.partial`` new weights drain the stream, received into a staging copy
    (``rollout.stage_weights``; the resumed run drains without it); with it the weights reach the
    rollout mid-stream (the other path of its server).
    Which groups a step takes depends on timing: tests/test_stream_groups.py checks that order."""
    out = str(tmp_path / "run")
    run_ok(out, "--pools.rollout-ranks", "2", "--algo.rollout-is", "token_truncated", "--trainer.max-staleness", "1",
           "--rollout.stream", "--rollout.token-delay-s", "0.05", "--rollout.max-new-tokens", "16",
           "--rollout.ignore-eos", "--rollout.length-dist", "lognormal", "--rollout.min-new-tokens", "2",
           "--trainer.total-steps", "4", "--trainer.val-every", "2",
           *(["--rollout.partial", "--rollout.partial-chunk", "2"] if partial else
             ["--rollout.stage-weights", "--rollout.partial-chunk", "2", "--checkpoint.every", "2",
              "--checkpoint.keep", "2"]),
           nproc=4)
    metrics = read_metrics(out)
    assert sum("val/accuracy" in m for m in metrics) == 3  # steps 0, 2 and 4
    steps = [m for m in metrics if "async/staleness/max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert steps[0]["async/staleness/max"] == 0  # the first weights
    for m in steps:
        assert m["async/staleness/max"] <= 1, m
        assert m["async/queue_depth"] <= 2 * 8, m  # at most (S + 1) x train_batch_size groups in flight
        assert m.get("async/logprob_abs_diff_fresh", 0.0) < 1e-4, m  # fresh tokens: only fp32 noise
        assert 0 <= m["async/rollout_idle_frac"] <= 1 and 0 <= m["async/actor_idle_frac"] <= 1, m
        assert sum(m[f"async/tokens_staleness_{k}"] for k in range(2)) == pytest.approx(m["response_length/mean"] * 64)
    if not partial:  # the checkpoint of step 2 holds the prompts in flight; a resumed run generates them again
        resumed = str(tmp_path / "resumed")
        run_ok(resumed, "--pools.rollout-ranks", "1", "--algo.rollout-is", "token_truncated", "--trainer.max-staleness",
               "1", "--rollout.stream", "--trainer.total-steps", "4", "--trainer.val-every", "0",
               "--checkpoint.resume", str(tmp_path / "run" / "checkpoints" / "step_2"), nproc=2)
        again = [m for m in read_metrics(resumed) if "async/staleness/max" in m]
        assert [m["step"] for m in again] == [3, 4]
        assert again[0]["async/staleness/max"] == 0  # generated from the resumed weights (version 2)


def test_staged_weights_free_the_actor_and_change_no_sample(tmp_path):
    """``rollout.stage_weights`` with S = 1 and a rollout slower than the update: the weights of update
    t arrive in the middle of round t + 1, are received at the rollout's next look into a staging
    copy and loaded when the round ends. The actor's weight sync no longer waits for the round (here
    it waits for round t + 1's rows instead, generation being the slower half), and the run is the
    same run: first in, first out, every round is generated with the same weights as without
    staging, so every step's samples, scores, losses and staleness are equal."""
    flags = [*POOL, "--trainer.max-staleness", "1", "--rollout.token-delay-s", "0.1", "--rollout.max-new-tokens", "12",
             "--rollout.ignore-eos", "--rollout.partial-chunk", "2", "--trainer.total-steps", "4"]
    run_ok(str(tmp_path / "waits"), *flags, nproc=2)
    run_ok(str(tmp_path / "staged"), *flags, "--rollout.stage-weights", nproc=2)
    timing = ("async/actor_idle_frac", "async/rollout_idle_frac", "async/rollout_busy_s")
    waits, staged = ([{k: v for k, v in m.items() if k not in timing} for m in learning_metrics(str(tmp_path / r))]
                     for r in ("waits", "staged"))
    assert_same(waits, staged, "rollout.stage_weights changed what was trained on")


def test_a_look_mid_round_receives_announced_weights_into_a_staging_copy(monkeypatch):
    """What frees the actor under ``rollout.stage_weights``: at a look during a round, a transfer the
    controller announced is received at once (the commands issued before it are kept for their
    turn), held as a staging copy queued behind them; with nothing announced the look receives nothing."""
    from types import SimpleNamespace

    from spmd_rl.rollout import pool
    from spmd_rl.rollout.pool import RolloutServer

    announced = [0]
    monkeypatch.setattr(pool, "store_count", lambda key, add=0: announced[0])
    inbox = [("generate", {"round": 2}), ("weights", 3)]
    server = RolloutServer.__new__(RolloutServer)  # only the fields stage and receive_staged read
    server.queued, server.weights_taken, server.staging_refused, server.where = [], 0, False, "rollout rank 1"
    server.receive = lambda: inbox.pop(0)
    server.prompts_of = lambda payload: [[7, 8]]
    server.engine = SimpleNamespace(room_for_weights=lambda: None)
    server.link = SimpleNamespace(bridge=SimpleNamespace(receive=lambda: iter([("w", torch.ones(2))])))
    server.stage()
    assert server.queued == [] and len(inbox) == 2  # nothing announced: nothing received
    announced[0] = 1
    server.stage()
    kinds = [(kind, payload) for kind, payload, _ in server.queued]
    assert kinds == [("generate", {"round": 2}), ("weights", 3)] and server.weights_taken == 1
    staged = server.queued[1][2]
    assert [name for name, _ in staged] == ["w"] and torch.equal(staged[0][1], torch.ones(2))
    server.stage()  # one staged transfer waits for its load: no second receive
    assert len(server.queued) == 2


def test_a_staged_copy_that_does_not_fit_waits_for_its_load(caplog):
    """``rollout.stage_weights`` with too little free memory: the transfer is not received at the look
    (None is queued with the command), it is counted as taken only when loaded, and the rank warns
    once, naming what is missing."""
    from types import SimpleNamespace

    from spmd_rl.rollout.pool import RolloutServer

    server = RolloutServer.__new__(RolloutServer)  # only the fields receive_staged reads
    server.where, server.staging_refused, server.weights_taken = "rollout rank 1", False, 0
    server.engine = SimpleNamespace(room_for_weights=lambda: "a staging copy of the weights needs 3.00 GiB")
    server.link = SimpleNamespace(bridge=SimpleNamespace(receive=lambda: pytest.fail("received a transfer")))
    with caplog.at_level("WARNING", logger="spmd_rl"):
        assert server.receive_staged() is None and server.receive_staged() is None
    assert server.weights_taken == 0
    assert [r.getMessage() for r in caplog.records] == [
        "rollout rank 1: rollout.stage_weights: a staging copy of the weights needs 3.00 GiB; weights are received "
        "when the round ends"]
