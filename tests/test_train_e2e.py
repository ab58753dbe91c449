"""The real entry point on 2 CPU processes (gloo): it learns under torchrun, and it is reproducible.

``torchrun(out_dir, *flags)`` runs ``spmd_rl.train`` under the real launcher; ``launch(...)`` runs
the same ranks forked from a warm process (``run_program``: no interpreter start, no torch import
per rank), for the end-to-end tests that are about the program rather than its launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import HERE, REPO
from spmd_rl.distributed.testing import cpu_env, free_port, run_program

TINY = [
    "--model.path", "tiny-random", "--data.task", "arithmetic", "--data.train-batch-size", "8", "--data.val-size", "16",
    "--rollout.n", "8", "--rollout.max-new-tokens", "8", "--rollout.temperature", "1.0",
    "--actor.lr", "3e-3", "--actor.ppo-mini-batch-size", "8", "--actor.micro-batch-size", "16",
    "--reward.fn", "support.rewards:digit_fraction", "--algo.kl-coef", "0.0",
    "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "0",
]


def torchrun(out_dir: str, *flags: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    env = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", out_dir, *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def launch(out_dir: str, *flags: str, nproc: int = 2, timeout: int = 600, env: dict | None = None,
           module: str = "spmd_rl.train") -> subprocess.CompletedProcess:
    """What :func:`torchrun` returns, from ``module.main`` on ``nproc`` forked ranks."""
    return run_program(module, [*TINY, "--trainer.output-dir", out_dir, *flags], nproc=nproc, cwd=REPO,
                       env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **(env or {})),
                       timeout=timeout)


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"


def test_grpo_learns_under_torchrun(tmp_path):
    out = str(tmp_path / "run")
    proc = torchrun(out, "--trainer.total-steps", "15")  # the mean score climbs ~0.35 in 15 steps, ~0.8 in 30
    _check(proc)
    steps = [m for m in read_metrics(out) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == list(range(1, 16))
    first = sum(m["critic/score/mean"] for m in steps[:5]) / 5
    last = sum(m["critic/score/mean"] for m in steps[-5:]) / 5
    assert last > first + 0.15, f"reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "actor/lr", "response_length/mean", "response_length/clip_ratio", "timing_s/gen",
                "timing_s/update", "timing_s/step", "perf/tokens_per_s", "critic/score/max"):
        assert key in steps[-1], key
    assert "rank table" in proc.stderr and "global:1" in proc.stderr


def test_same_seed_same_metrics(tmp_path):
    """Two runs of one seed log the same metrics, also when the second profiles its step 2."""
    runs = []
    for name, extra in (("a", ()), ("b", ("--trainer.profile-steps", "2"))):
        out = str(tmp_path / name)
        proc = launch(out, "--trainer.total-steps", "4", "--algo.kl-coef", "0.01", *extra)
        _check(proc)
        runs.append([{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "elapsed_s"))}
                     for m in read_metrics(out)])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 4
    for rank in (0, 1):  # a Chrome trace per rank, and rank 0's stage table in the log
        assert os.path.getsize(tmp_path / "b" / "profile" / f"step2_rank{rank}.json.gz") > 1000
    assert "step 2 under torch.profiler" in proc.stderr
    table = proc.stderr.split("step 2 under torch.profiler", 1)[1]
    assert all(f"\n  {stage} " in table for stage in ("step", "gen", "reward", "update")), table[:2000]


def test_bad_layout_fails_before_start(tmp_path):
    proc = launch(str(tmp_path / "bad"), "--data.train-batch-size", "3", "--actor.ppo-mini-batch-size", "3")
    assert proc.returncode != 0
    assert "data.train_batch_size (3)" in proc.stderr


def test_reward_error_stops_every_rank(tmp_path):
    proc = launch(str(tmp_path / "err"), "--trainer.total-steps", "3", "--reward.fn", "support.rewards:raises_on_seven",
                    timeout=300)
    assert proc.returncode != 0
    assert "scorer exploded" in proc.stderr
