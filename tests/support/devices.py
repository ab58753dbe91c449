"""Skip markers for tests that need GPUs. A CPU test needs none of these: its ranks and subprocesses
run with the GPUs hidden (``spmd_rl.distributed.testing.cpu_env``), on any machine.

    from support.devices import cuda, needs_gpus
    @cuda                  # one CUDA GPU, in this process
    @needs_gpus(2)         # two, e.g. for run_distributed(..., backend="nccl", cuda=True): spawned ranks

The count comes from NVML (``torch.cuda.device_count()``), which leaves CUDA uninitialised in the
test process, so it can still fork CPU ranks afterwards."""

from __future__ import annotations

import pytest

from spmd_rl.distributed.testing import cuda_devices


def needs_gpus(n: int = 1) -> pytest.MarkDecorator:
    have = cuda_devices()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPU(s); this machine shows {have}")


cuda = needs_gpus(1)
