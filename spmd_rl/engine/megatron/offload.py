"""The megatron engine's offload: tensors' storages emptied on the device between phases and refilled
in place, so every view into them (megatron's parameters and ``main_grad`` inside the DDP buffers,
the distributed optimizer's shards, AdamW's moments) stays valid without re-pointing anything.

    parking = HostParking(pin=on_gpu)
    parking.park(params, keep=True)        # copy to host memory, then free the device storage
    parking.park(grads, keep=False)        # free only: the next update zeroes them anyway
    parking.unpark()                       # re-allocate on the device and copy back (bit-exact)

A storage is parked once however many tensors view it (deduplicated by the storage itself). Host
copies are allocated (pinned on GPU) at the first park and reused by the next ones, so a cycle costs
two copies and no pinning. On CPU runs the same swap happens between two host storages: nothing is
gained there, but the code path (every tensor unusable while parked, restored bit for bit) is the
one GPU runs take, which is what the tests check. :class:`MegatronOffload` holds the engine's
``offload`` / ``onload`` built on two parkings (parameters with their gradients; the optimizer).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    key: int
    nbytes: int
    host: torch.UntypedStorage | None  # None: contents dropped, zeros on unpark


class HostParking:
    """Storages moved out of device memory and back (see the module docstring)."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.parked: list[_Parked] = []
        self._hosts: dict[int, torch.UntypedStorage] = {}  # storage identity -> reusable host copy

    @property
    def bytes_parked(self) -> int:
        return sum(p.nbytes for p in self.parked)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, or while its storage is parked the same view of the host copy (reads
        and in-place writes reach the contents that :meth:`unpark` restores)."""
        key = tensor.untyped_storage()._cdata
        for p in self.parked:
            if p.key == key and p.host is not None:
                return torch.empty(0, dtype=tensor.dtype).set_(p.host, tensor.storage_offset(), tensor.shape,
                                                               tensor.stride())
        return tensor

    def park(self, tensors: Iterable[torch.Tensor], *, keep: bool) -> None:
        """Free the storages of ``tensors`` (copied to host memory first when ``keep``)."""
        seen = {p.key for p in self.parked}
        for storage in _storages(tensors):
            key = storage._cdata  # the StorageImpl: the same object however often it is resized
            nbytes = storage.nbytes()
            if key in seen or nbytes == 0:
                continue
            seen.add(key)
            host = None
            if keep:
                host = self._hosts.get(key)
                if host is None or host.nbytes() != nbytes:
                    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
                    self._hosts[key] = host
                host.copy_(storage, non_blocking=self.pin)
            self.parked.append(_Parked(storage, key, nbytes, host))
        if self.pin:
            torch.cuda.synchronize()  # the copies have landed before their device memory is reused
        for p in self.parked:
            p.storage.resize_(0)

    def unpark(self) -> None:
        """Re-allocate every parked storage at its old size and copy its contents back (zeros where
        they were dropped)."""
        for p in self.parked:
            p.storage.resize_(p.nbytes)
            if p.host is None:
                torch.empty(0, dtype=torch.uint8, device=p.storage.device).set_(p.storage, 0, (p.nbytes,)).zero_()
            else:
                p.storage.copy_(p.host, non_blocking=self.pin)
        self.parked = []


def _storages(tensors: Iterable[torch.Tensor]) -> Iterable[torch.UntypedStorage]:
    for t in tensors:
        if t is not None:
            yield t.untyped_storage()


class MegatronOffload:
    """The offload methods of :class:`~spmd_rl.engine.megatron.engine.MegatronEngine` (a mixin:
    they read its model chunks, distributed optimizer and its two :class:`HostParking`)."""

    def _param_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The parameters (megatron DDP's parameter buffers) and their gradient buffers (``main_grad``)."""
        params = [p.detach() for chunk in self.model for p in chunk.parameters()]
        grads = [p.main_grad for chunk in self.model for p in chunk.parameters() if hasattr(p, "main_grad")]
        return params, grads

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The distributed optimizer's fp32 main weights and AdamW moments on this engine's device
        (not AdamW's step counts, kept on the host; not main weights that are views of the parameters)."""
        if self.optimizer is None:
            return []
        params = {p.untyped_storage()._cdata for p in self._param_tensors()[0]}
        out = []
        for _, _, main in self._main_params():
            for t in (main, *self._moments(main)):
                if t.device.type == self.device.type and t.untyped_storage()._cdata not in params:
                    out.append(t)
        return out

    def _moments(self, main: torch.Tensor) -> list[torch.Tensor]:
        """AdamW's tensors (moments) of one main parameter."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            state = opt.optimizer.state.get(main)
            if state is not None:
                return [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"]
        return []

    def _park(self, *, params: bool, optimizer: bool) -> None:
        if optimizer and not self._parked_optimizer.parked:
            self._parked_optimizer.park(self._optimizer_tensors(), keep=True)
        if params and not self._parked_params.parked:
            weights, grads = self._param_tensors()
            self._parked_params.park(weights, keep=True)
            self._parked_params.park(grads, keep=False)  # zeroed by the next update before use
        if self.on_gpu:
            torch.cuda.empty_cache()

    def offload(self) -> None:
        """Between phases: the parameters and their gradient buffers to host memory when
        ``actor.megatron.param_offload`` (``ref.param_offload`` for the reference), the optimizer's
        fp32 main weights and AdamW moments when ``actor.megatron.optimizer_offload``. Storages are
        emptied and refilled in place (:mod:`.offload`): exact, and every view stays valid.
        Idempotent; on CPU runs it does the same swap between host buffers (nothing is freed)."""
        self._park(params=self.param_offload, optimizer=self.optimizer_offload)

    def onload(self, *, optimizer: bool = False) -> None:
        """Parameters (and gradient buffers) back on the device; the optimizer state too when
        ``optimizer`` (only the update needs it). Idempotent."""
        self._parked_params.unpark()
        if optimizer:
            self._parked_optimizer.unpark()
