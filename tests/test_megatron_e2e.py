"""``actor.engine=megatron`` through the real entry point under torchrun (2 CPU processes, gloo,
pipeline parallel 2, reference model on): a few GRPO steps with a checkpoint, then a second job that
resumes from the step-2 checkpoint reproduces step 3 exactly. And with a reward pool of its own
(3 processes: megatron-core's groups over the first two, the reward model on the third).

The processes start through ``tests/support/megatron_cpu_train.py`` (``spmd_rl.train`` with the CPU
shims that megatron-core needs on a CPU-only torch; see ``support.megatron_cpu``).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.distributed.testing import run_program

pytest.importorskip("megatron.core")

FLAGS = [
    "--model.path", "tiny-random", "--data.task", "arithmetic", "--data.train-batch-size", "4", "--data.val-size", "8",
    "--rollout.n", "4", "--rollout.max-new-tokens", "8", "--actor.lr", "3e-3",
    "--actor.ppo-mini-batch-size", "4", "--actor.micro-batch-size", "2",
    "--reward.fn", "support.rewards:digit_fraction", "--algo.kl-coef", "0.01",
    "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "2",
    "--actor.engine", "megatron", "--actor.megatron.pp", "2", "--checkpoint.every", "2", "--checkpoint.keep", "2",
]


def launch(out_dir: str, *flags: str, nproc: int = 2) -> subprocess.CompletedProcess:
    # support.megatron_cpu_train: spmd_rl.train with megatron-core's CPU shims installed first
    proc = run_program("support.megatron_cpu_train", [*FLAGS, "--trainer.output-dir", out_dir, *flags], nproc=nproc,
                       env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1"), cwd=REPO, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return proc


def steps(out_dir: str) -> dict[int, dict]:
    """Training rows of metrics.jsonl by step, without clocks."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {m["step"]: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "elapsed_s"))}
            for m in rows if "actor/pg_loss" in m}


def test_megatron_train_checkpoint_and_exact_resume(tmp_path):
    first = str(tmp_path / "first")
    proc = launch(first, "--trainer.total-steps", "3")
    assert "rank table" in proc.stderr
    got = steps(first)
    assert sorted(got) == [1, 2, 3]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr", "actor/entropy", "critic/score/mean"):
        assert key in got[3], key
    assert got[2]["actor/kl_loss"] > 0, "the reference model did not take part"
    assert sorted(os.listdir(os.path.join(first, "checkpoints"))) == ["latest", "step_2", "step_3"]

    second = str(tmp_path / "second")
    proc = launch(second, "--trainer.total-steps", "3",
                  "--checkpoint.resume", os.path.join(first, "checkpoints", "step_2"))
    assert "resumed from" in proc.stderr, proc.stderr[-3000:]
    resumed = steps(second)
    assert sorted(resumed) == [3]
    assert resumed[3] == got[3], {k: (resumed[3][k], got[3].get(k)) for k in resumed[3] if resumed[3][k] != got[3].get(k)}

    # HF export of a megatron checkpoint (its hf copy; one process, no megatron layout): the
    # trained weights under HF names, loadable by transformers, equal between the two jobs' step 3
    from transformers import AutoModelForCausalLM

    from spmd_rl.export import export_hf, load_model_state
    from spmd_rl.models import resolve_model_path

    initial = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny-random", cache_dir=None))
    exported = [load_model_state(os.path.join(run, "checkpoints", "step_3")) for run in (first, second)]
    names = {n for n, _ in initial.named_parameters()}  # tied: no lm_head.weight
    assert set(exported[0]) == names, set(exported[0]) ^ names
    for name, p in initial.named_parameters():
        a, b = exported[0][name], exported[1][name]
        assert a.shape == p.shape and a.dtype == torch.float32, name
        assert torch.equal(a, b), f"{name}: the resumed job's step-3 weights differ"
    assert any(not torch.equal(exported[0][n], p.detach()) for n, p in initial.named_parameters()), "not trained"
    folder = export_hf(first, tmp_path / "hf")  # the newest step of the run
    model = AutoModelForCausalLM.from_pretrained(folder)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), exported[0][name]), name


def test_megatron_with_a_reward_pool(tmp_path):
    """pp 2 over global ranks 0-1, the reward model on rank 2: megatron-core's groups are built on every
    rank with a world of 2; the steps train and the reward model's scores reach the loss."""
    out = str(tmp_path / "pool")
    launch(out, "--trainer.total-steps", "2", "--checkpoint.every", "0", "--checkpoint.no-save-final",
           "--pools.reward-ranks", "1", "--reward.model.path", "tiny-random-rm", "--reward.model.micro-batch-size", "2",
           nproc=3)
    got = steps(out)
    assert sorted(got) == [1, 2]
    assert got[2]["actor/grad_norm"] > 0 and got[2]["actor/kl_loss"] > 0
    assert "reward/model_score/mean" in got[2]
