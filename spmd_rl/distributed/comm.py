"""Moving data between ranks and failing together.

All pools live in one world, so data crosses ranks and pools with torch.distributed: gloo for
small Python objects (prompt indices, per-row metadata), the device backend for tensors.

    indices = broadcast_object(draw() if rank == 0 else None, src=0, group=g)
    batch = relayout(batch, src=(dp_rank, dp_size), dst=(dp_rank2, dp_size2), group=g, pad_token_id=p)
    with fail_together(group=g, what="reward"):
        scores = scorer(...)     # an exception on one rank stops every rank with its message

A rank that raises while the others enter a collective would hang the job until the timeout;
``fail_together`` turns that into the same clear error on every rank of the group.

Between pools, small Python objects go point to point over gloo (:func:`send_object`,
:func:`isend_object`, :func:`recv_object`); a serving pool's answer that is an error is raised as
:class:`RemoteFailure`. The protocol between the actor's pool and a serving pool is
:mod:`spmd_rl.distributed.service`.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
from datetime import timedelta
from typing import Any, Iterator, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger("spmd_rl")

Rows = TypeVar("Rows", bound="RowBatch")


class RowBatch(Protocol):
    """What :func:`relayout` moves: rows that go to a device, concatenate and select, as
    :class:`spmd_rl.data.batch.RolloutBatch` does (named here, not imported: this layer is below it)."""

    def __len__(self) -> int: ...

    def to(self: Rows, device: torch.device) -> Rows: ...

    def select(self: Rows, rows: range) -> Rows: ...

    @staticmethod
    def concat(parts: list[Any], pad_token_id: int) -> Any: ...

class RankFailure(RuntimeError):
    """Raised on every rank of a group when any rank failed inside :func:`fail_together`;
    ``failures``: (rank, host, exception type name, message) of each rank that failed."""

    def __init__(self, message: str, failures: list[tuple[int, str, str, str]] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def broadcast_object(obj: Any, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """``obj`` from global rank ``src`` to every rank of ``group``."""
    if _world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    n = _world(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def relayout(batch: Rows, *, src: tuple[int, int], dst: tuple[int, int],
             group: dist.ProcessGroup | None, pad_token_id: int) -> Rows:
    """Re-lay rows owned by ``src`` = (dp rank, dp size) to the ``dst`` = (dp rank, dp size) layout.

    Rows are in global order when read rank by rank over the source data-parallel ranks; the
    destination takes contiguous equal slices of that order, so all responses of a prompt (which
    are contiguous) stay together when the per-rank row count is a multiple of ``rollout.n``.
    Identity (no communication) when both layouts split the rows the same way.
    """
    if src == dst:
        return batch
    parts = all_gather_objects((src[0], batch.to(torch.device("cpu"))), group)
    by_src: dict[int, Rows] = {}
    for src_rank, part in parts:
        by_src.setdefault(src_rank, part)  # ranks sharing a source dp rank hold the same rows
    if sorted(by_src) != list(range(src[1])):
        raise RuntimeError(f"relayout: expected source dp ranks 0..{src[1] - 1}, got {sorted(by_src)}")
    full = type(batch).concat([by_src[r] for r in range(src[1])], pad_token_id)
    dst_rank, dst_size = dst
    if len(full) % dst_size:
        raise ValueError(f"relayout: {len(full)} rows do not split over {dst_size} data-parallel ranks")
    size = len(full) // dst_size
    return full.select(range(dst_rank * size, (dst_rank + 1) * size))


@contextlib.contextmanager
def fail_together(*, group: dist.ProcessGroup | None = None, what: str) -> Iterator[None]:
    """Run the block on every rank; if any rank raised, raise on all of them.

    The failing rank re-raises its own exception (so its type and traceback survive); the others
    raise :class:`RankFailure` naming the failing rank(s) and their messages.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every error must reach the other ranks
        error = e
    if _world(group) > 1:
        me = dist.get_rank()
        kind = None if error is None else type(error).__name__
        message = None if error is None else f"{kind}: {error}"
        reports = all_gather_objects((me, socket.gethostname(), message, kind), group)
        failed = [(r, h, m, k) for r, h, m, k in reports if m is not None]
        if failed and error is None:
            lines = "\n".join(f"  rank {r} ({h}): {m}" for r, h, m, _ in failed)
            raise RankFailure(f"{what} failed on {len(failed)} rank(s):\n{lines}",
                              [(r, h, k, m[len(k) + 2:]) for r, h, m, k in failed])
    if error is not None:
        raise error



# --------------------------------------------------------------------------- between pools


class RemoteFailure(RuntimeError):
    """A rank of another pool answered with an error, or stopped answering."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.message = message


def send_object(obj: Any, dst: int, *, timeout_s: float | None = None) -> None:
    """Pickle ``obj`` and send it to global rank ``dst`` over gloo (a size, then the bytes).

    Blocks until ``dst`` receives it; with ``timeout_s`` gives up after that long (RuntimeError).
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    for tensor in (torch.tensor([payload.numel()], dtype=torch.long), payload):
        if timeout_s is None:
            dist.send(tensor, dst=dst)
        else:
            dist.isend(tensor, dst=dst).wait(timeout=timedelta(seconds=timeout_s))


def isend_object(obj: Any, dst: int) -> list[tuple[Any, torch.Tensor]]:
    """:func:`send_object` without waiting: ``(work, buffer)`` pairs to keep until the works are
    done (the receiver may take the object later; messages to one rank arrive in sending order)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return [(dist.isend(t, dst=dst), t) for t in (torch.tensor([payload.numel()], dtype=torch.long), payload)]


def recv_object(src: int | None = None) -> tuple[int, Any]:
    """``(sender, object)`` from global rank ``src``, or from whichever rank sends first when
    ``src`` is None. Blocks in gloo (no busy wait) up to the process group's timeout."""
    size = torch.zeros(1, dtype=torch.long)
    sender = dist.recv(size, src=src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=sender)
    return sender, pickle.loads(payload.numpy().tobytes())


def split_even(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``parts`` contiguous slices whose lengths differ by at most one (earlier ones longer)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out
