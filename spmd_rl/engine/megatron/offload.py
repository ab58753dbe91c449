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
one GPU runs take, which is what the tests check.
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
