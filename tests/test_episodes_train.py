"""Multi-turn episodes through the trainer's own pieces (CPU, gloo, a tiny random model).

* token-in / token-out: a 3-turn episode's tokens are the rollout's exactly, and the actor's fp32
  log-probs of the model's tokens (packed and padded layouts) equal the rollout's within 1e-5, turns 2
  and 3 continuing from the K/V the turn before left parked;
* the loss mask: the environment's tokens get no gradient;
* a user environment of a fixed number of turns under ``spmd_rl.train`` on 2 ranks: ``env/turns/mean``
  is that number and the score is the sum of its rewards; a failing environment stops the run with
  its class and row, or is skipped under ``--reward.on-error skip``;
* the same episodes on a rollout pool (its ranks play them), synchronous and at max staleness 1,
  validation scored by the episode rewards; streamed or partial rollouts refused there.
"""

from __future__ import annotations

import torch

from spmd_rl.distributed.testing import run_distributed
from test_train_e2e import _check, launch, read_metrics

EPISODE_FLAGS = ["--env.fn", "support.envs:ThreeTurns", "--env.max-turns", "5", "--env.max-tokens", "64",
                 "--rollout.max-new-tokens", "6", "--data.train-batch-size", "4", "--rollout.n", "2",
                 "--actor.ppo-mini-batch-size", "4", "--trainer.total-steps", "2"]


def _episode_and_logprobs(rank: int, world_size: int) -> dict:
    import sys

    from conftest import HERE

    sys.path.insert(0, HERE)
    from support.episodes import actor_logprobs, tiny_rollout

    from spmd_rl.episodes.env import load_env
    from spmd_rl.episodes.framing import TurnFraming
    from spmd_rl.episodes.runner import EpisodeRunner
    from spmd_rl.source.rollout import episode_prompts

    folder, tok, eos, pad, engine = tiny_rollout()
    runner = EpisodeRunner(load_env("support.envs:ThreeTurns", None), framing=TurnFraming(tok, eos_ids=eos),
                           tokenizer=tok, max_turns=5, max_tokens=96, tools=None, workers=2, skip_errors=False)
    out = runner.run(engine, [{"answer": "7"}, {"answer": "12"}], n=2,
                     sampling=dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=5))
    logprobs = {packed: actor_logprobs(out, folder, pad, packed=packed) for packed in (True, False)}
    return {"out": out, "logprobs": logprobs, "reused": engine.reused_tokens, "texts": [tok.decode(p + r[: int((m + c).sum())].tolist())
            for p, r, m, c in zip(episode_prompts(out), out["response_ids"], out["response_mask"], out["context_mask"])]}


def test_three_turn_episodes_are_token_exact_and_the_actor_agrees() -> None:
    got = run_distributed(_episode_and_logprobs, 1)[0]
    out = got["out"]
    assert out["env_turns"].tolist() == [3, 3, 3, 3] and out["env_reward"].tolist() == [0.75] * 4
    model, context = out["response_mask"], out["context_mask"]
    assert (model * context).sum() == 0 and context.sum() > 0 and model.sum() > 0
    present = model + context
    for row in present:  # the tokens there are form a prefix of the row
        n = int(row.sum())
        assert row[:n].eq(1).all() and row[n:].eq(0).all()
    for text in got["texts"]:  # the environment's messages sit between the model's turns
        assert text.count("Go on.") == 2 and "Say something about" in text
    assert got["reused"] > 0  # turns 2 and 3 continued from the parked K/V of the turns before
    for packed, logprobs in got["logprobs"].items():
        gap = ((logprobs - out["logprobs"]).abs() * model).max().item()
        assert gap < 1e-5, f"packed={packed}: the actor's log-probs differ from the rollout's by {gap}"


def _episodes_twice(rank: int, world_size: int) -> list[dict]:
    import sys

    from conftest import HERE

    sys.path.insert(0, HERE)
    from support.episodes import tiny_rollout

    from spmd_rl.episodes.env import load_env
    from spmd_rl.episodes.framing import TurnFraming
    from spmd_rl.episodes.runner import EpisodeRunner

    outs = []
    for slots, workers in ((4, 3), (2, 1)):  # other slots, other worker threads, other step times
        _, tok, eos, _, engine = tiny_rollout(batch_size=slots)
        runner = EpisodeRunner(load_env("support.envs:Unhurried", None), framing=TurnFraming(tok, eos_ids=eos),
                               tokenizer=tok, max_turns=5, max_tokens=96, tools=None, workers=workers, skip_errors=False)
        outs.append(runner.run(engine, [{"answer": "7"}, {"answer": "12"}, {"answer": "3"}], n=2,
                               sampling=dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=5)))
    return outs


def test_sampled_episodes_are_the_same_whatever_the_schedule() -> None:
    """An environment that takes a random time per step, on 4 slots with 3 workers and on 2 slots with
    one: the episodes come back in other orders and share other steps, and sample the same tokens (each
    row draws from its own uniforms: spmd_rl/rollout/sampling.py), so a seeded run is the same run on a
    busy machine."""
    a, b = run_distributed(_episodes_twice, 1)[0]
    assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["response_mask"], b["response_mask"])
    assert (a["logprobs"] - b["logprobs"]).abs().max() < 1e-5
    assert len({tuple(r.tolist()) for r in a["response_ids"]}) == 6  # the n = 2 episodes of a row differ


def test_the_environment_tokens_get_no_gradient() -> None:
    from spmd_rl.algo.objective import actor_objective
    from spmd_rl.config import AlgoConfig

    torch.manual_seed(0)
    model = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 0, 0]], dtype=torch.float32)
    logprobs = (-torch.rand(2, 7)).requires_grad_()
    old = logprobs.detach().clone()
    loss, _ = actor_objective(logprobs, None, old_logprobs=old, advantages=torch.randn(2, 7), response_mask=model,
                              ref_logprobs=old - 0.1, algo=AlgoConfig(), global_tokens=float(model.sum()),
                              global_seqs=2.0)
    loss.backward()
    assert (logprobs.grad[model == 0] == 0).all() and (logprobs.grad[model == 1] != 0).any()


def test_a_user_environment_under_train(tmp_path) -> None:
    out = str(tmp_path / "run")
    _check(launch(out, *EPISODE_FLAGS))
    steps = [m for m in read_metrics(out) if "env/turns/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["env/turns/mean"] == 3 and m["env/turns/max"] == 3
        assert abs(m["critic/score/mean"] - 0.75) < 1e-6 and abs(m["env/reward/mean"] - 0.75) < 1e-6
        assert m["env/truncated_frac"] == 0 and m["env/tool_calls/mean"] == 0 and "timing_s/env" in m
        assert 0.3 < m["env/prefill_reused_frac"] < 1  # turns 2 and 3 continued from the parked K/V


def test_a_failing_environment_stops_the_run_or_is_skipped(tmp_path) -> None:
    flags = [*EPISODE_FLAGS, "--env.fn", "support.envs:FailsOnSecondTurn"]
    proc = launch(str(tmp_path / "raise"), *flags)
    assert proc.returncode != 0
    assert "FailsOnSecondTurn.step failed on the row" in proc.stderr and "the environment broke" in proc.stderr
    out = str(tmp_path / "skip")
    _check(launch(out, *flags, "--reward.on-error", "skip"))
    steps = [m for m in read_metrics(out) if "env/turns/mean" in m]
    assert steps and all(m["env/failed"] == 8 for m in steps)  # 4 prompts x 2 episodes on the 2 ranks


POOL_FLAGS = [*EPISODE_FLAGS, "--trainer.val-every", "2", "--data.val-size", "4"]
SAME_ANY_LAYOUT = ("env/turns/mean", "env/turns/max", "env/reward/mean", "env/truncated_frac", "env/failed",
                   "env/tool_calls/mean", "critic/score/mean", "critic/score/max", "critic/score/min")


def _episode_steps(out: str) -> list[dict]:
    return [m for m in read_metrics(out) if "env/turns/mean" in m]


def _val(out: str) -> list[dict]:
    return [{k: v for k, v in m.items() if k.startswith("val/") or k == "step"} for m in read_metrics(out)
            if any(k.startswith("val/") for k in m)]


def test_episodes_on_a_rollout_pool_match_the_colocated_rollout(tmp_path) -> None:
    """1 actor + 1 rollout rank play the ThreeTurns episodes the colocated rank plays: 3 turns, the
    summed reward as the score, in training and validation (each episode's reward). Which episode's
    turn the stream takes next depends on when its environment's step comes back (a worker thread),
    so the sampled tokens need not be the colocated run's: compared here is what the environment
    decides, whatever the model says."""
    base, pool = str(tmp_path / "colocated"), str(tmp_path / "pool")
    _check(launch(base, *POOL_FLAGS, nproc=1))
    _check(launch(pool, *POOL_FLAGS, "--pools.rollout-ranks", "1", nproc=2))
    a, b = _episode_steps(base), _episode_steps(pool)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert y["env/turns/mean"] == 3 and abs(y["critic/score/mean"] - 0.75) < 1e-6
        assert "timing_s/env" in y and "actor/pg_loss" in y
        assert {k: x[k] for k in SAME_ANY_LAYOUT} == {k: y[k] for k in SAME_ANY_LAYOUT}
    assert _val(base) == _val(pool) and len(_val(pool)) == 2  # at steps 0 and 2
    assert all(abs(m["val/score"] - 0.75) < 1e-6 for m in _val(pool)), _val(pool)


def test_episodes_on_a_rollout_pool_asynchronous(tmp_path) -> None:
    """Rounds issued ahead (max staleness 1) on 2 actor + 1 rollout ranks: episodes of one policy
    version behind at most, their staleness read on the model's tokens."""
    out = str(tmp_path / "run")
    flags = [*EPISODE_FLAGS, "--trainer.total-steps", "3", "--trainer.max-staleness", "1"]
    _check(launch(out, *flags, "--pools.rollout-ranks", "1", nproc=3))
    steps = _episode_steps(out)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["env/turns/mean"] == 3 and abs(m["critic/score/mean"] - 0.75) < 1e-6
        assert 0 <= m["async/staleness/mean"] <= m["async/staleness/max"] <= 1
    assert steps[-1]["async/staleness/max"] == 1  # step 3 trains on the round generated under step 1's weights


def test_plan_refuses_episodes_streamed_or_partial_on_a_pool() -> None:
    import pytest

    from spmd_rl.config import load_config
    from spmd_rl.plan import plan

    base = ["--env.fn", "support.envs:ThreeTurns", "--pools.rollout-ranks", "1", "--trainer.max-staleness", "1"]
    plan(load_config(base), 2)  # whole rounds: planned
    for flag in ("--rollout.stream", "--rollout.partial", "--rollout.stage-weights"):
        with pytest.raises(ValueError, match=f"episodes on a rollout pool.*{flag}"):
            plan(load_config([*base, flag]), 2)  # the message names the flag


def test_the_runner_says_which_environment_call_it_waits_for(caplog) -> None:
    """What the stall watchdog names (Watchdog.describe): the oldest call in progress and its row; and
    what the runner logs itself after ``warn_after_s`` with nothing to generate (a run of one process
    has no watchdog)."""
    import logging
    import threading
    import time

    from support.envs import HangsOnStep
    from support.episodes import tiny_rollout

    from spmd_rl.distributed import watchdog
    from spmd_rl.episodes.framing import TurnFraming
    from spmd_rl.episodes.runner import EpisodeRunner

    class Recorder(watchdog.NullWatchdog):
        def describe(self, fn):
            self.fn = fn

    _, tok, eos, _, engine = tiny_rollout()
    runner = EpisodeRunner(HangsOnStep, framing=TurnFraming(tok, eos_ids=eos), tokenizer=tok, max_turns=5,
                           max_tokens=64, tools=None, workers=2, skip_errors=False, warn_after_s=0.3)
    recorder = Recorder()
    watchdog.install(recorder)
    HangsOnStep.release.clear()
    play = threading.Thread(target=runner.run, args=(engine, [{"answer": "7"}]),
                            kwargs=dict(n=2, sampling=dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=1)))
    try:
        assert runner.waiting() == ""
        play.start()
        deadline = time.monotonic() + 60
        # both episodes at their hanging step (a poll could land while one still resets, or between them)
        while "HangsOnStep.step" not in runner.waiting() or "2 environment calls" not in runner.waiting():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        said = recorder.fn()
        assert said.startswith("waits for HangsOnStep.step on the row {'answer': '7'} (running "), said
        assert said.endswith("s; 2 environment calls in progress)"), said
        with caplog.at_level(logging.WARNING, logger="spmd_rl"):
            while "nothing to generate" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "episodes: nothing to generate for 0 s: waits for HangsOnStep.step on the row {'answer': '7'}" \
            in caplog.text
    finally:
        HangsOnStep.release.set()
        play.join(60)
        watchdog.install(None)
    assert not play.is_alive() and recorder.fn is None and runner.waiting() == ""


def test_more_episodes_than_slots_still_reuse_their_prefixes() -> None:
    """4 episodes on 2 slots: at most 2 are under way at once, so each finds its K/V parked on its next
    turn; the tokens are those of the same episodes prefilled whole (greedy)."""
    from support.episodes import tiny_rollout

    from spmd_rl.episodes.env import load_env
    from spmd_rl.episodes.framing import TurnFraming
    from spmd_rl.episodes.runner import EpisodeRunner

    _, tok, eos, _, engine = tiny_rollout(batch_size=2)
    outs = {}
    for reuse in (False, True):
        runner = EpisodeRunner(load_env("support.envs:ThreeTurns", None), framing=TurnFraming(tok, eos_ids=eos),
                               tokenizer=tok, max_turns=5, max_tokens=96, tools=None, workers=2, skip_errors=False,
                               reuse_prefixes=reuse)
        before = engine.reused_tokens
        outs[reuse] = runner.run(engine, [{"answer": "7"}, {"answer": "12"}], n=2,
                                 sampling=dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=5))
        outs[reuse]["reused"] = engine.reused_tokens - before
    assert outs[False]["reused"] == 0
    assert torch.equal(outs[True]["response_ids"], outs[False]["response_ids"])
    assert (outs[True]["logprobs"] - outs[False]["logprobs"]).abs().max() < 1e-5
    # turns 2 and 3 of all 4 episodes: each reused its whole prefix but the turn's last model token;
    # an episode is P prompt tokens, then 3 model turns of 8 tokens with 2 answers of e tokens between
    present = (outs[True]["response_mask"] + outs[True]["context_mask"]).sum(1).long()
    answers = (present - 24) // 2
    prompts = outs[True]["prompt_lengths"]
    assert int(((prompts + 7) + (prompts + 8 + answers + 7)).sum()) == outs[True]["reused"]
    # the rows count it per episode (env/prefill_reused_frac): fed P, P + 8 + e, P + 16 + 2e tokens
    assert outs[True]["env_reused_tokens"].sum() == outs[True]["reused"] and outs[False]["env_reused_tokens"].sum() == 0
    for out in outs.values():
        assert torch.equal(out["env_fed_tokens"], 3 * prompts + 24 + 3 * answers)
