"""Moving data between ranks and failing together.

All pools live in one world, so data crosses ranks and pools with torch.distributed: gloo for
small Python objects (prompt indices, per-row metadata), the device backend for tensors.

    indices = broadcast_object(draw() if rank == 0 else None, src=0, group=g)
    batch = relayout(batch, src=(dp_rank, dp_size), dst=(dp_rank2, dp_size2), group=g, pad_token_id=p)
    with fail_together(group=g, what="reward"):
        scores = scorer(...)     # an exception on one rank stops every rank with its message

A rank that raises while the others enter a collective would hang the job until the timeout;
``fail_together`` turns that into the same clear error on every rank of the group.

Between pools, :class:`PoolExchange` carries rows from the ``global`` pool's ranks (clients) to a
serving pool's ranks (servers, e.g. the reward pool) and results back, point to point over gloo::

    ex = PoolExchange(clients=range(0, 3), servers=[3])
    scores = ex.request(rows)          # client: rows split over the servers, results in row order
    ex.close()                         # client: "stop" (or close(error=...) = "abort")
    inbound = ex.receive()             # server: blocks (no busy wait) for every client's rows
    ex.reply(inbound, {client: results})
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
from dataclasses import dataclass, field
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
    """Raised on every rank of a group when any rank failed inside :func:`fail_together`."""


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
        message = None if error is None else f"{type(error).__name__}: {error}"
        reports = all_gather_objects((me, socket.gethostname(), message), group)
        failed = [(r, h, m) for r, h, m in reports if m is not None]
        if failed and error is None:
            lines = "\n".join(f"  rank {r} ({h}): {m}" for r, h, m in failed)
            raise RankFailure(f"{what} failed on {len(failed)} rank(s):\n{lines}")
    if error is not None:
        raise error



# --------------------------------------------------------------------------- between pools


class RemoteFailure(RuntimeError):
    """A server rank of a :class:`PoolExchange` answered with an error, or stopped answering."""

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


def tell_servers(ranks: Sequence[int], error: str | None, *, timeout_s: float, role: str) -> None:
    """Tell each serving rank of a pool to ``stop`` (``error`` None) or to ``abort`` with ``error``;
    at most ``timeout_s`` per rank (a dead or busy one is skipped with a warning)."""
    message = ("stop", None) if error is None else ("abort", error)
    for r in ranks:
        try:
            send_object(message, r, timeout_s=timeout_s)
        except RuntimeError as e:
            log.warning("could not tell %s rank %d to %s: %s", role, r, message[0], e)


def split_even(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``parts`` contiguous slices whose lengths differ by at most one (earlier ones longer)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


@dataclass
class Inbound:
    """What a server received in one exchange round."""

    seq: int
    rows: dict[int, list[Any]] = field(default_factory=dict)
    """Rows by client global rank (clients that sent rows this round)."""
    aborted: dict[int, str] = field(default_factory=dict)
    """Clients that aborted, with their error message (the run is failing)."""
    stopped: bool = False
    """Every client said stop (the run ended normally) and none aborted."""


class PoolExchange:
    """Rows from client ranks to server ranks and one result per row back, point to point.

    One round per :meth:`request`: every client sends each server one message (its rows split in
    contiguous, near-equal slices, possibly empty); each server receives from every client in
    arrival order (``recv`` from any source), computes, and answers every client; each client
    reads the answers server by server and joins them in row order. A server waits in a blocking
    gloo receive, which sleeps in the kernel rather than spinning. Collective-free: the clients'
    and servers' own groups stay free for their work.

    Ending: each client sends ``stop`` when done, or ``abort`` with its error in its exception
    path (:meth:`close`); a server returns from :meth:`receive` at once on an abort, and with
    ``stopped`` once every client has stopped. After an abort a server keeps answering late rows
    with the error (``receive(drain=True)``) until every client is done, so that no client waits
    on it. A server that fails answers with its error
    instead of results, and the client raises :class:`RemoteFailure`. Waits are bounded by the
    process group's timeout (``trainer.dist_timeout_s``); :meth:`close` by ``close_timeout_s``.
    """

    def __init__(self, *, clients: Sequence[int], servers: Sequence[int], close_timeout_s: float = 60.0) -> None:
        self.clients = list(clients)
        self.servers = list(servers)
        if not self.clients or not self.servers or set(self.clients) & set(self.servers):
            raise ValueError(f"PoolExchange needs disjoint, non-empty client {self.clients} and server {self.servers} ranks")
        self.rank = dist.get_rank()
        self.close_timeout_s = close_timeout_s
        self.seq = 0
        self._done: dict[int, str | None] = {}  # server side: client -> None (stop) or abort message
        self._closed = False

    # ------------------------------------------------------------------ client side
    def request(self, rows: Sequence[Any]) -> list[Any]:
        """Send ``rows`` to the servers; return one result per row, in order. Every client calls
        this once per round (with possibly no rows). Raises :class:`RemoteFailure` after reading
        every server's answer when any server failed."""
        self.seq += 1
        chunks = split_even(rows, len(self.servers))
        for server, chunk in zip(self.servers, chunks):
            try:
                send_object(("rows", self.seq, chunk), server)
            except RuntimeError as e:  # the server died or timed out
                raise RemoteFailure(server, f"could not send the rows ({e})") from e
        results: list[Any] = []
        failures: list[RemoteFailure] = []
        for server, chunk in zip(self.servers, chunks):
            try:
                _, (kind, seq, payload) = recv_object(server)
            except RuntimeError as e:  # the server died or timed out: stop reading, nothing to sync with
                raise RemoteFailure(server, f"no answer ({e})") from e
            if kind == "error":
                failures.append(RemoteFailure(server, str(payload)))
            elif seq != self.seq or len(payload) != len(chunk):
                raise RemoteFailure(server, f"answered round {seq} with {len(payload)} results; expected round "
                                            f"{self.seq} with {len(chunk)}")
            else:
                results.extend(payload)
        if failures:
            raise failures[0]
        return results

    def close(self, error: str | None = None) -> None:
        """Tell every server this client is done: ``stop``, or ``abort`` with ``error``. Waits at
        most ``close_timeout_s`` per server (a dead or busy server is skipped with a warning);
        calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        message = ("stop", self.seq, None) if error is None else ("abort", self.seq, error)
        for server in self.servers:
            try:
                send_object(message, server, timeout_s=self.close_timeout_s)
            except RuntimeError as e:
                log.warning("could not tell rank %d to %s: %s", server, message[0], e)

    # ------------------------------------------------------------------ server side
    def receive(self, *, drain: bool = False) -> Inbound:
        """The next round: rows from every client that has not stopped. Returns early when a
        client aborts. With ``drain`` (after an abort) returns after each single message, rows of
        any round included, so that a late client can be answered at once."""
        if not drain:
            self.seq += 1
        inbound = Inbound(seq=self.seq)
        aborts = sum(m is not None for m in self._done.values())
        while not self.all_done:
            if not drain and (sum(m is not None for m in self._done.values()) > aborts
                              or all(c in inbound.rows or c in self._done for c in self.clients)):
                break
            sender, (kind, seq, payload) = recv_object(None)
            if sender not in self.clients:
                raise RuntimeError(f"rank {sender} is not a client of this exchange (clients {self.clients})")
            if kind == "rows":
                if seq != self.seq and not drain:
                    raise RuntimeError(f"rank {sender} sent round {seq} while this server is at round {self.seq}")
                inbound.rows[sender] = payload
            else:
                self._done[sender] = payload if kind == "abort" else None
            if drain:
                break
        inbound.aborted = {c: m for c, m in self._done.items() if m is not None}
        inbound.stopped = not inbound.aborted and self.all_done
        return inbound

    @property
    def all_done(self) -> bool:
        """Every client has sent stop or abort."""
        return len(self._done) == len(self.clients)

    def reply(self, inbound: Inbound, results: dict[int, list[Any]]) -> None:
        """Answer every client that sent rows this round with its results (one per row)."""
        for client in sorted(inbound.rows):
            send_object(("ok", inbound.seq, results[client]), client)

    def reply_error(self, inbound: Inbound, message: str) -> None:
        """Answer every client that sent rows this round with ``message`` instead of results.
        A client that has gone away is skipped."""
        for client in sorted(inbound.rows):
            try:
                send_object(("error", inbound.seq, message), client, timeout_s=self.close_timeout_s)
            except RuntimeError as e:
                log.warning("could not send the error to rank %d: %s", client, e)
