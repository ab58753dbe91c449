"""The test harness's device contract (``spmd_rl.distributed.testing``): CPU ranks are CPU processes
on any machine, and CUDA ranks are spawned onto the GPUs, skipped where there are too few."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist

from conftest import REPO
from spmd_rl.distributed.env import DistEnv
from spmd_rl.distributed.testing import cpu_env, run_distributed
from support.devices import needs_gpus


def _what_a_rank_sees(rank: int, world: int) -> dict:
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return {"cuda": torch.cuda.is_available(), "device": str(DistEnv().pick_device("auto")),
            "backend": dist.get_backend(), "sum": t.item()}


def test_cpu_ranks_see_no_gpu_on_any_machine() -> None:
    assert run_distributed(_what_a_rank_sees, 2) == [{"cuda": False, "device": "cpu", "backend": "gloo", "sum": 3.0}] * 2


def test_a_cpu_subprocess_sees_no_gpu() -> None:
    code = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, timeout=120,
                         cwd=REPO, check=True)
    assert out.stdout.split() == ["False", "0"]


def _on_the_gpu(rank: int, world: int) -> dict:
    t = torch.ones(1, device="cuda") * (rank + 1)
    dist.all_reduce(t)
    return {"device": str(t.device), "sum": t.item()}


@needs_gpus(1)
def test_cuda_ranks_are_spawned_onto_the_gpus() -> None:
    assert run_distributed(_on_the_gpu, 1, backend="nccl", cuda=True) == [{"device": "cuda:0", "sum": 1.0}]
