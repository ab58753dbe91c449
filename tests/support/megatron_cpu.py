"""TEST SUPPORT ONLY: run megatron-core 0.16 on CPU processes joined by gloo.

    from support.megatron_cpu import install_megatron_cpu_shims
    install_megatron_cpu_shims()   # in every test process, before building a megatron engine

megatron-core is written for CUDA: its RNG tracker saves and restores CUDA generator states, the
pipeline schedules and p2p code allocate with ``device="cuda"`` / ``torch.cuda.current_device()``
and call ``torch.cuda.synchronize()``, and the MoE dispatcher touches CUDA streams. On a CPU-only
torch those calls raise. This module redirects them to the CPU for the duration of a test process:

* ``torch.cuda.current_device`` -> the CPU device; ``synchronize``, ``empty_cache`` -> no-ops;
* the CUDA RNG state functions (torch's and megatron's private ones) -> the CPU generator, so
  megatron's tracker forks the CPU generator (dropout is 0 in every test, so no draw depends on it);
* a TorchFunctionMode that rewrites ``device="cuda"`` / ``cuda:N`` / an int device in any torch
  call to the CPU (the literal allocations inside the schedules);
* ``Tensor.type()`` names a CPU tensor as its CUDA type (``torch.cuda.FloatTensor``): the distributed
  optimizer checks that name;
* ``pin_memory=True`` in any torch call -> False (a CPU-only torch has no pinned allocator);
* ``torch.cuda.current_stream`` / ``stream`` / ``Stream`` / ``Event`` -> inert stand-ins;
* ``all_to_all_single`` split sizes given as tensors (the MoE dispatcher keeps them on the device,
  which is the CPU here) -> lists of ints, as torch's binding requires.

Never imported by the product (``spmd_rl``): on a GPU machine megatron-core runs unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrite every CUDA device argument of a torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):  # megatron's RoPE slices for context parallelism from pinned memory
            kwargs = dict(kwargs, pin_memory=False)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.cuda:
            return args[0]
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and result.startswith("torch."):
            # the distributed optimizer accepts only torch.cuda.*Tensor type names
            return result if result.startswith("torch.cuda.") else "torch.cuda." + result[len("torch."):]
        return result


def _ints(sizes):
    return None if sizes is None else [int(x) for x in sizes]


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _Inert:
    """Stands in for a CUDA stream or event: every method is a no-op returning another stand-in
    (``stream.record_event().synchronize()``); all stand-ins are equal (one stream on the CPU)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *a, **k: _Inert()

    def __eq__(self, other) -> bool:
        return isinstance(other, _Inert)

    def __hash__(self) -> int:
        return 0


def install_megatron_cpu_shims() -> None:
    """Idempotent; call in each process that builds a megatron engine on the CPU."""
    global _INSTALLED
    if _INSTALLED:
        return
    # The condition is "this process runs on the CPU", not "the machine has no GPU": CPU test
    # processes are started with the GPUs hidden (spmd_rl.distributed.testing.cpu_env), also on a GPU host.
    assert not torch.cuda.is_available(), (
        "the megatron CPU shims are for CPU test processes: start this one with CUDA_VISIBLE_DEVICES='' "
        "(spmd_rl.distributed.testing's run_distributed / run_program / cpu_env do)")
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _Inert()  # type: ignore[assignment]
    torch.cuda.Stream = _Inert  # type: ignore[assignment,misc]
    torch.cuda.Event = _Inert  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]

    all_to_all_single = torch.distributed.all_to_all_single

    def all_to_all_int_splits(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return all_to_all_single(output, input, _ints(output_split_sizes), _ints(input_split_sizes), *args, **kwargs)

    torch.distributed.all_to_all_single = all_to_all_int_splits
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _CpuDeviceMode().__enter__()  # process-wide: test processes are spawned for one test body
    _INSTALLED = True


__all__ = ["install_megatron_cpu_shims"]
