"""The built-in rollout's weights and memory between rollouts, mixed into
:class:`~spmd_rl.rollout.native.NativeRollout` (as :mod:`spmd_rl.engine.fsdp_state` is into the FSDP engine).

    engine.load_weights(actor.named_full_tensors())   # the trainer's sync: in-place copies by HF name
    engine.sleep(2)                                   # KV cache and graphs freed, weights to host (CPU: dropped)
    engine.wake_up()                                  # back on the device, the cache reallocated

It reads the engine's ``model``, ``device``, ``_fast`` (the fast decoder, or None), ``_targets`` (HF name
-> the tensor to copy into), ``_quantized`` (HF name -> the FP8 unit that quantises it, and its module), ``_storage`` (the units that own storage: the fast path's fused tensors and
every other parameter or buffer once), ``_host_copies``, ``_sleep_level``, ``_dropped`` and
``_dropped_units``, and calls its ``forget_prefixes``.
"""

from __future__ import annotations

import gc
from typing import Iterable

import torch

from .layers import Fused
from .slots import free_bytes, size


class OwnTensor:
    """A parameter or buffer that owns its storage, as :class:`~spmd_rl.rollout.fast.Fused` presents its
    tensors to ``sleep(2)`` / ``wake_up``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor.data]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        self.tensor.data = tensors[0]


class RolloutWeights:
    """``load_weights``, ``sleep`` / ``wake_up``, ``close`` and the checks around them (module docstring)."""

    @property
    def needs_weights(self) -> bool:
        """After a level-2 sleep on the CPU, until :meth:`load_weights` has written every parameter; never
        on a GPU, where a level-2 sleep keeps the weights in host memory."""
        return bool(self._dropped)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, full_tensor)`` pairs into the model, casting dtype and device.

        For tied embeddings either ``lm_head.weight`` or ``model.embed_tokens.weight`` may be sent
        (or both); they are the same tensor here. A weight the rollout holds in FP8 (``--rollout.dtype
        fp8``) is quantised into its rows instead (one scale per row: rows loaded apart quantise as the
        whole tensor would).
        """
        self._restore_storages()
        self.forget_prefixes()  # K/V of the old weights
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._targets.get(name)
                if target is None:
                    valid = list(self._targets)
                    raise KeyError(f"NativeRollout.load_weights: unknown weight {name!r}; the model has "
                                   f"{len(valid)} names such as {valid[:4]}")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"NativeRollout.load_weights: {name} has shape {tuple(tensor.shape)}, "
                                     f"the rollout model expects {tuple(target.shape)}")
                quantized = self._quantized.get(name)
                if quantized is not None:
                    unit, module = quantized
                    unit.load(module, tensor)
                else:
                    target.copy_(tensor)
                self._dropped.discard(id(target))

    def room_for_weights(self) -> str | None:
        """None when one more copy of the weights fits in this device's free memory (a staged transfer,
        ``rollout.stage_weights``), else what is missing, in words."""
        free = free_bytes(self.device)
        need = sum(t.numel() * t.element_size() for unit in self._storage for t in unit.tensors())
        if free is None or need * 1.05 <= free:
            return None
        return f"a staging copy of the weights needs {size(need)}, {size(free)} is free"

    def sleep(self, level: int) -> None:
        """0: keep everything on the device (a no-op: the next rollout reuses the KV cache and the
        captured CUDA graphs); 1: free the KV cache and the CUDA graphs; 2: also move the weights to
        (pinned) host memory on a GPU, or drop them on the CPU (:meth:`needs_weights` until
        :meth:`load_weights` writes them again: the trainer's next sync does).

        The freed memory goes back to torch's caching allocator, where the colocated actor's passes
        reuse it; the cache is not emptied to the driver, so the next rollout does not allocate afresh
        (docs/PERF.md, "Sleep / wake"). The released graphs' private
        pool stays reserved until torch empties its cache (it does so by itself before failing an
        allocation)."""
        if level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level must be 0, 1 or 2, got {level}")
        if level == 0:
            return
        if self._fast is not None:
            self._fast.release()
        if level == 2 and self._sleep_level < 2 and self.device.type == "cpu":
            self._drop_weights()
        elif level == 2 and self._sleep_level < 2:
            if self._host_copies is None:
                pin = self.device.type == "cuda"
                self._host_copies = [[torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                                      for t in unit.tensors()] for unit in self._storage]
            for unit, hosts in zip(self._storage, self._host_copies):
                for t, host in zip(unit.tensors(), hosts):
                    host.copy_(t, non_blocking=True)
            self._synchronize()
            for unit, hosts in zip(self._storage, self._host_copies):
                unit.replace(hosts)
        self._sleep_level = max(self._sleep_level, level)

    def wake_up(self) -> None:
        """Bring the weights back to the device (after ``sleep(2)``) and reallocate the fast path's KV
        cache (its CUDA graphs are recaptured on first use); a no-op when awake. On the CPU the weights a
        level-2 sleep dropped must have been loaded first."""
        if self._dropped:
            names = [n for n, p in self.model.named_parameters() if id(p) in self._dropped]
            raise RuntimeError(f"NativeRollout.wake_up: a level-2 sleep on the CPU dropped the weights and "
                               f"{len(names)} parameter(s) were not loaded since, such as {names[:3]}; "
                               "call load_weights with every parameter first")
        if self._sleep_level == 2 and self.device.type != "cpu":
            for unit in self._storage:
                unit.replace([t.to(self.device, non_blocking=True) for t in unit.tensors()])
            self._synchronize()
        if self._sleep_level and self._fast is not None:
            self._fast.restore()
        self._sleep_level = 0

    def _drop_weights(self) -> None:
        """Give the weights' memory back: the tensors of every unit holding parameters (buffers stay: no
        sync sends them) become one-element placeholders of their shapes; views and tied names follow,
        as for the host copies of a GPU."""
        params = {id(p) for p in self.model.parameters()}
        self._dropped_units = [u for u in self._storage if isinstance(u, Fused) or id(u.tensor) in params]
        for unit in self._dropped_units:
            unit.replace([t.new_empty((1,) * t.dim()).expand(t.shape) for t in unit.tensors()])
        self._dropped = params

    def _restore_storages(self) -> None:
        """Memory again for the weights :meth:`_drop_weights` gave back (uninitialised: loads fill it)."""
        for unit in self._dropped_units:
            unit.replace([torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in unit.tensors()])
        self._dropped_units = []

    def close(self) -> None:
        if self._fast is not None:
            self._fast.release()
        self._targets, self._storage, self._host_copies, self._fast = {}, [], None, None
        self.model = None  # type: ignore[assignment]
        self._free_cached_memory()

    def _check_awake(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"NativeRollout.{what}: the engine was closed")
        if self._sleep_level:
            raise RuntimeError(f"NativeRollout.{what}: the engine is asleep (level {self._sleep_level}); "
                               "call wake_up() first")

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_cached_memory(self) -> None:
        if self.device.type == "cuda":
            gc.collect()  # tensors held only by reference cycles go before the cache is emptied
            torch.cuda.empty_cache()


__all__ = ["OwnTensor", "RolloutWeights"]
