"""Tensors between pools: a step's rows and a model's weights, without pickles or disk.

Rows. A step's rows have one global order (rollout replica by replica). Each rank of one pool holds
a contiguous range of them and each rank of another pool wants one; :class:`RowRoute` says which
piece goes from which holder to which taker (a row held by several ranks, e.g. the tp ranks of one
replica, is sent once, by the lowest of them), and :func:`send_rows` / :func:`recv_rows` move the
pieces point to point as tensors over the world's CPU backend (gloo)::

    route = RowRoute(sources={2: (0, 8), 3: (8, 16)}, dests={0: (0, 8), 1: (8, 16)})
    send_rows(route, {"response_ids": ids, "logprobs": lp}, first_row=0)       # on ranks 2 and 3
    rows = recv_rows(route, ROW_SPEC)                                          # on ranks 0 and 1

Each piece is a fixed-size int64 header (status, rows, the trailing shape of every tensor) and
then one message per tensor; pieces with different lengths are right-padded when joined. A holder
that failed sends status ``1`` and its error message instead (the only pickle, a short string),
and every taker raises :class:`~spmd_rl.distributed.comm.RemoteFailure` with it: no taker waits for
rows that will never come.

Weights. :class:`WeightBridge` streams full, Hugging Face-named tensors from one actor rank to the
rollout ranks in buckets of ``bucket_bytes``, after every update: a short control message names
each bucket's tensors (names, shapes, dtypes), then the bucket travels as one flat tensor per dtype,
by ``broadcast`` over the bridge's group (NCCL between GPUs, gloo on the CPU), or, when sender and
receiver share a GPU (``pools.colocate`` > 1, where NCCL cannot hold both), as a CUDA IPC handle
over gloo: the receiver copies straight from the sender's memory. The receiver hands the tensors
one by one to the rollout engine's ``load_weights``, which shards them to its own layout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from spmd_rl.distributed.comm import RemoteFailure, broadcast_object, isend_object, recv_object

log = logging.getLogger("spmd_rl")

_HEADER_DIMS = 3  # trailing dimensions a routed tensor may have (rows x up to 3 more)


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class RowRoute:
    """Which rows each rank holds (``sources``) and wants (``dests``), as ``[start, end)`` ranges
    of the step's global row order, keyed by global rank. Holders and takers are disjoint."""

    sources: Mapping[int, tuple[int, int]]
    dests: Mapping[int, tuple[int, int]]

    def __post_init__(self) -> None:
        both = set(self.sources) & set(self.dests)
        if both:
            raise ValueError(f"RowRoute: ranks {sorted(both)} both hold and take rows")

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """``(source, dest, start, end)`` for every piece, in (dest, start) order: each row a
        destination wants comes from the lowest-ranked source holding it."""
        out = []
        for dst in sorted(self.dests):
            start, end = self.dests[dst]
            row = start
            while row < end:
                holders = [s for s in sorted(self.sources) if self.sources[s][0] <= row < self.sources[s][1]]
                if not holders:
                    raise ValueError(f"RowRoute: no source holds row {row} (wanted by rank {dst})")
                src = holders[0]
                stop = min(end, self.sources[src][1])
                out.append((src, dst, row, stop))
                row = stop
        return out

    def sends(self, rank: int) -> list[tuple[int, int, int]]:
        """``(dest, start, end)`` of the pieces ``rank`` sends."""
        return [(d, a, b) for s, d, a, b in self.pieces() if s == rank]

    def receives(self, rank: int) -> list[tuple[int, int, int]]:
        """``(source, start, end)`` of the pieces ``rank`` receives, in row order."""
        return [(s, a, b) for s, d, a, b in self.pieces() if d == rank]

    def senders(self) -> list[int]:
        return sorted({s for s, *_ in self.pieces()})


def _header(status: int, rows: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    dims = [0] * (_HEADER_DIMS * len(tensors))
    for i, t in enumerate(tensors):
        if t.dim() - 1 > _HEADER_DIMS:
            raise ValueError(f"send_rows: a tensor of shape {tuple(t.shape)} has more than {_HEADER_DIMS} trailing dims")
        for j, size in enumerate(t.shape[1:]):
            dims[i * _HEADER_DIMS + j] = size
    return torch.tensor([status, rows, *dims], dtype=torch.long)


def send_rows(route: RowRoute, tensors: Mapping[str, torch.Tensor], *, first_row: int,
              error: str | None = None, wait: bool = True) -> list[tuple[Any, torch.Tensor]]:
    """Send this rank's pieces: ``tensors`` (row-major, dim 0 = rows, CPU) hold the rows from
    ``first_row`` on. With ``error`` (this rank failed) every taker of a piece gets the message instead.

    ``wait=False`` returns at once with the ``(work, buffer)`` pairs to keep until they complete
    (:func:`settle`): the takers may receive the rows later, in the order they were sent."""
    me = dist.get_rank()
    names = list(tensors)
    pending: list[tuple[Any, torch.Tensor]] = []
    for dst, start, end in route.sends(me):
        if error is not None:
            header = _header(1, 0, [])
            pending.append((dist.isend(header, dst=dst), header))
            pending += isend_object(error, dst)
            continue
        parts = [tensors[k][start - first_row:end - first_row].contiguous() for k in names]
        header = _header(0, end - start, parts)
        pending.append((dist.isend(header, dst=dst), header))
        pending += [(dist.isend(p, dst=dst), p) for p in parts]
    if wait:
        settle(pending, block=True)
        return []
    return pending


def settle(pending: list[tuple[Any, torch.Tensor]], *, block: bool = False) -> list[tuple[Any, torch.Tensor]]:
    """The sends of ``pending`` not done yet (all of them waited for with ``block``)."""
    if block:
        for work, _ in pending:
            work.wait()
        return []
    return [(w, t) for w, t in pending if not w.is_completed()]


def recv_rows(route: RowRoute, spec: Mapping[str, tuple[torch.dtype, float]]) -> dict[str, torch.Tensor]:
    """This rank's rows: ``spec`` names each tensor with its dtype and pad value, in the order the
    holders send them (the same mapping order on both sides). Pieces are joined in row order,
    right-padded on dim 1 when their lengths differ. Raises :class:`RemoteFailure` when a holder failed."""
    me = dist.get_rank()
    names = list(spec)
    pieces: list[list[torch.Tensor]] = []
    failure: RemoteFailure | None = None
    for src, start, end in route.receives(me):
        header = torch.zeros(2 + _HEADER_DIMS * len(names), dtype=torch.long)
        dist.recv(header, src=src)
        if header[0].item() != 0:
            _, message = recv_object(src)
            failure = failure or RemoteFailure(src, str(message))
            continue
        rows = int(header[1].item())
        if rows != end - start:
            raise RuntimeError(f"recv_rows: rank {src} sent {rows} rows, expected {end - start} (rows {start}..{end - 1})")
        part = []
        for i, name in enumerate(names):
            dims = [int(d) for d in header[2 + i * _HEADER_DIMS: 2 + (i + 1) * _HEADER_DIMS].tolist()]
            shape = (rows, *[d for d in dims if d > 0])
            t = torch.empty(shape, dtype=spec[name][0])
            dist.recv(t, src=src)
            part.append(t)
        pieces.append(part)
    if failure is not None:
        raise failure
    out = {}
    for i, name in enumerate(names):
        ts = [p[i] for p in pieces]
        if ts and ts[0].dim() > 1:
            width = max(t.shape[1] for t in ts)
            ts = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=spec[name][1])
                  if t.shape[1] < width else t for t in ts]
        out[name] = torch.cat(ts) if ts else torch.empty(0, dtype=spec[name][0])
    return out


PROMPT_SPEC = {"prompt_ids": (torch.long, 0), "prompt_lengths": (torch.long, 0)}
"""Token lists (prompts) as routed tensors: right-padded ids and their lengths."""


def pack_prompts(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt ids and their lengths."""
    width = max((len(p) for p in prompts), default=0)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
    return {"prompt_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long)}


def unpack_prompts(t: dict[str, torch.Tensor]) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(t["prompt_ids"], t["prompt_lengths"].tolist())]


# --------------------------------------------------------------------------- weights


@dataclass
class TransferStats:
    """One weight transfer as the sender saw it."""

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class WeightBridge:
    """Full tensors from one sender rank to the receiver ranks of one group, bucket by bucket.

    ``mode``: ``"broadcast"`` (the group's collective: NCCL between GPUs, gloo on the CPU) or
    ``"ipc"`` (sender and receivers share a GPU: CUDA IPC handles over a gloo group). Every member
    calls :meth:`send` (the sender) or :meth:`receive` (the others) for each transfer.
    """

    def __init__(self, *, group: dist.ProcessGroup | None, sender: int, device: torch.device,
                 mode: str = "broadcast", bucket_bytes: int = 512 << 20) -> None:
        if mode not in ("broadcast", "ipc"):
            raise ValueError(f"WeightBridge mode must be 'broadcast' or 'ipc', got {mode!r}")
        if mode == "ipc" and device.type != "cuda":
            raise ValueError("WeightBridge mode 'ipc' needs CUDA tensors")
        self.group, self.sender, self.device, self.mode = group, sender, device, mode
        self.bucket_bytes = bucket_bytes

    # ------------------------------------------------------------------ sender
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> TransferStats:
        """Stream ``named_tensors`` to the receivers; returns what was sent and how fast."""
        stats = TransferStats()
        start = time.perf_counter()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                self._send_bucket(bucket, stats)
                bucket, size = [], 0
        if bucket:
            self._send_bucket(bucket, stats)
        broadcast_object(None, src=self.sender, group=self.group)  # the end of this transfer
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - start
        return stats

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], stats: TransferStats) -> None:
        meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
        flats = _flatten_by_dtype(bucket, self.device)
        if self.mode == "ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            handles = {dtype: reduce_tensor(flat) for dtype, flat in flats.items()}
            torch.cuda.synchronize(self.device)  # the receivers read the buffers as soon as they get the handles
            broadcast_object((meta, handles), src=self.sender, group=self.group)
            dist.barrier(group=self.group)  # every receiver has copied: the buffers may go
        else:
            broadcast_object((meta, None), src=self.sender, group=self.group)
            for flat in flats.values():
                dist.broadcast(flat, src=self.sender, group=self.group)
        stats.bytes += sum(f.numel() * f.element_size() for f in flats.values())
        stats.buckets += 1

    # ------------------------------------------------------------------ receivers
    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sender's tensors, one by one (views into the bucket being received); iterate to the end."""
        while True:
            message = broadcast_object(None, src=self.sender, group=self.group)
            if message is None:
                return
            meta, handles = message
            dtypes = sorted({d for _, _, d in meta})
            if self.mode == "ipc":
                flats = {d: _rebuild_ipc(handles[d]).to(self.device, copy=True) for d in dtypes}
                torch.cuda.synchronize(self.device)
                dist.barrier(group=self.group)
            else:
                flats = {}
                for d in dtypes:
                    numel = sum(_numel(shape) for _, shape, dt in meta if dt == d)
                    flats[d] = torch.empty(numel, dtype=getattr(torch, d), device=self.device)
                    dist.broadcast(flats[d], src=self.sender, group=self.group)
            offsets = dict.fromkeys(dtypes, 0)
            for name, shape, d in meta:
                n = _numel(shape)
                yield name, flats[d][offsets[d]:offsets[d] + n].view(shape)
                offsets[d] += n


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _flatten_by_dtype(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """One flat tensor per dtype on ``device``, tensors in bucket order (sorted dtype names as keys)."""
    by_dtype: dict[str, list[torch.Tensor]] = {}
    for _, t in bucket:
        by_dtype.setdefault(str(t.dtype).removeprefix("torch."), []).append(t.reshape(-1).to(device))
    return {d: torch.cat(by_dtype[d]) for d in sorted(by_dtype)}


def _rebuild_ipc(handle: tuple) -> torch.Tensor:
    fn, args = handle
    return fn(*args)


__all__ = ["PROMPT_SPEC", "RowRoute", "TransferStats", "WeightBridge", "pack_prompts", "recv_rows", "send_rows", "settle",
           "unpack_prompts"]
