"""The megatron engine on the actor pool next to a rollout pool and a teacher pool (CPU, gloo, tiny
models, 2 or 4 forked ranks through ``tests/support/megatron_pool_train.py``).

* megatron tp 2 on a 2-rank actor pool + a 2-rank rollout pool computes what the colocated megatron
  tp 2 run computes (rollout dp 2 in both): the same metrics for 3 steps, the same checkpoints bit
  for bit, and the weights the rollout pool holds after the last update are the actor's (its
  checkpoint's HF copy) bit for bit;
* the colocated run's checkpoint resumes on 2 actor + 1 rollout + 1 teacher ranks, two processes per
  device (``pools.colocate 2``), asynchronous (``trainer.max_staleness 1``) with on-policy
  distillation: the rollout pool holds no trained state and first loads the resumed weights; the
  reverse KL to the teacher falls.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.distributed.testing import run_program
from support.tiny import tiny_model_folder
from test_pools import assert_same, learning_metrics
from test_train_e2e import TINY

pytest.importorskip("megatron.core")

MEGATRON = ["--actor.engine", "megatron", "--actor.megatron.tp", "2"]
SAVES = ["--checkpoint.every", "2", "--checkpoint.keep", "2"]


def launch(out_dir: str, *flags: str, nproc: int, record: str | None = None) -> subprocess.CompletedProcess:
    """``spmd_rl.train`` with the megatron CPU shims; with ``record`` the rollout ranks save the
    weights they hold after each load into that folder (``support.megatron_pool_train``)."""
    env = dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1",
               SPMD_RL_TEST_ROLLOUT_WEIGHTS=record or "")
    proc = run_program("support.megatron_pool_train", [*TINY, *MEGATRON, "--trainer.output-dir", out_dir, *flags],
                       nproc=nproc, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return proc


def hf_copy(out_dir: str, step: int) -> dict[str, torch.Tensor]:
    """The actor's full HF-named weights after ``step`` updates (the checkpoint's export copy)."""
    from spmd_rl.export import load_model_state

    return load_model_state(os.path.join(out_dir, "checkpoints", f"step_{step}"))


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{what}: {differ}"


def loads(folder: str, rank: int) -> list[dict[str, torch.Tensor]]:
    """What rollout rank ``rank`` held after each of its weight loads, in order."""
    count = len([f for f in os.listdir(folder) if f.startswith(f"rank{rank}_")])
    return [torch.load(os.path.join(folder, f"rank{rank}_load{k}.pt")) for k in range(count)]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> str:
    """megatron tp 2 on 2 ranks, rollout colocated (dp 2): 3 steps, validation at 0, 2, 3, checkpoints at 2 and 3."""
    out = str(tmp_path_factory.mktemp("colocated") / "run")
    launch(out, "--trainer.total-steps", "3", "--trainer.val-every", "2", *SAVES, nproc=2)
    return out


def test_rollout_pool_matches_colocated_and_holds_the_actors_weights(colocated, tmp_path):
    out, record = str(tmp_path / "pool"), str(tmp_path / "weights")
    os.makedirs(record)
    launch(out, "--trainer.total-steps", "3", "--trainer.val-every", "2", *SAVES, "--pools.rollout-ranks", "2",
           nproc=4, record=record)
    base = learning_metrics(colocated)
    assert len(base) == 6 and sum("val/accuracy" in m for m in base) == 3
    assert_same(base, learning_metrics(out), "megatron tp 2 with a rollout pool")
    for step in (2, 3):
        assert_same_weights(hf_copy(out, step), hf_copy(colocated, step), f"step {step}: pool vs colocated actor")
    final = hf_copy(out, 3)
    for rank in (2, 3):  # loaded after updates 1, 2 and 3 (the last for the final validation)
        held = loads(record, rank)
        assert len(held) == 3, len(held)
        assert_same_weights(held[-1], final, f"rollout rank {rank} after update 3")


def test_resume_on_pools_asynchronous_with_a_teacher_pool(colocated, tmp_path):
    """The colocated step-2 checkpoint resumed on 2 actor + 1 rollout + 1 teacher ranks, two per device
    (the rollout rank takes its weights from actor rank 0 over their own pair group), one step
    off-policy, distillation only (no reward): the rollout rank first loads the resumed weights,
    staleness reaches 1, and the reverse KL to the teacher falls."""
    out, record = str(tmp_path / "resumed"), str(tmp_path / "weights")
    os.makedirs(record)
    teacher = tiny_model_folder(None, layers=3, hidden=96, seed=7)
    proc = launch(out, "--checkpoint.resume", os.path.join(colocated, "checkpoints", "step_2"),
                  "--trainer.total-steps", "8", "--trainer.val-every", "0", "--checkpoint.no-save-final",
                  "--pools.rollout-ranks", "1", "--pools.teacher-ranks", "1", "--pools.colocate", "2",
                  "--trainer.max-staleness", "1", "--teacher.model.path", teacher, "--algo.distill-coef", "1.0",
                  "--reward.fn", "support.rewards:zero", nproc=4, record=record)
    assert "resumed from" in proc.stderr, proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [m["step"] for m in rows] == [3, 4, 5, 6, 7, 8]
    assert max(m["async/staleness/max"] for m in rows) == 1
    resumed = hf_copy(colocated, 2)
    assert_same_weights(loads(record, 2)[0], resumed, "the rollout rank's first load after the resume")
    kl = [m["actor/distill_kl"] for m in rows]
    assert sum(kl[-3:]) / 3 < 0.6 * sum(kl[:2]) / 2, f"the reverse KL to the teacher did not fall: {kl}"
