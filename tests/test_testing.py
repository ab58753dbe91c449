"""The test harness's device contract (``spmd_rl.distributed.testing``): CPU ranks are CPU processes
on any machine, and CUDA ranks are spawned onto the GPUs, skipped where there are too few. Its
rendezvous ports: never one an outgoing connection or another test process can take."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import torch
import torch.distributed as dist

from conftest import REPO
from spmd_rl.distributed.env import DistEnv
from spmd_rl.distributed import testing
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed
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


def test_rendezvous_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice(tmp_path) -> None:
    # two processes at once, as two pytest-xdist workers: one shared record (TMPDIR), no port twice
    code = "from spmd_rl.distributed.testing import free_port; print(*[free_port() for _ in range(40)])"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=cpu_env(TMPDIR=str(tmp_path)), cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    ports = [int(p) for proc in procs for p in proc.communicate(timeout=120)[0].split()]
    assert len(ports) == 80 and len(set(ports)) == 80, sorted(ports)
    span = testing._below_ephemeral_range()
    if span is not None:  # Linux: where no outgoing connection takes a source port
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
        assert all(1024 <= p < low for p in ports), (low, sorted(ports))


def test_a_port_in_use_or_handed_out_is_skipped(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(testing, "PORTS_FILE", str(tmp_path / "ports"))
    held = []
    for _ in range(50):  # a listened-on port whose neighbour nothing holds
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
        busy = s.getsockname()[1]
        if testing._bindable(busy + 1):
            break
    else:
        raise AssertionError("50 listening ports in a row had their next port taken")
    try:
        monkeypatch.setattr(testing, "_below_ephemeral_range", lambda: (busy, busy + 2))
        port = free_port()
        assert port == busy + 1  # the only one nothing listens on
        with pytest.raises(RuntimeError, match=f"no free TCP port in {busy}..{busy + 1} .1 handed out"):
            free_port()  # busy + 1 is reserved for the test that got it
    finally:
        for s in held:
            s.close()
