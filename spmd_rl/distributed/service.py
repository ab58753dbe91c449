"""The one protocol between the actor's pool (``global``: the clients) and a pool that serves it
(rollout, teacher, reward: the servers). Each role is a small pair of classes on it, kept with the
role (:mod:`spmd_rl.rollout.pool`, :mod:`spmd_rl.distill`, :mod:`spmd_rl.reward.server`), and one
function dispatches every serving rank (:func:`spmd_rl.serve.serve_pool`)::

    link = ServiceLink(role="teacher", clients=[0, 1], servers=[2, 3])     # on the ranks of both pools
    link.command("score", {"num_rows": 8})     # the controller (first client) to every server, in order
    results = link.request(rows)               # every_client links: each client's rows, split over the servers
    link.close(error)                          # stop (error None), or abort with the error

    class Server(ServiceServer):               # a server rank: serve() until stop (0) or abort (1)
        def handle(self, kind, payload): ...   # one command; failures go through self.fail(...)

* **Commands.** Messages are ``(kind, payload)`` pickles over the world's CPU backend (gloo), first
  in, first out per sender. The controller sends them without waiting (:meth:`ServiceLink.command`;
  sends not done yet are kept, with their buffers, until they are); with ``counter`` it also adds
  one to a c10d store counter per command, so that a busy server can look, without blocking,
  whether one waits (:func:`store_count`). Tensors that go with a command travel on their own
  routes (:mod:`spmd_rl.distributed.bridge`).
* **Requests** (``every_client``): each client sends its rows split over the servers and reads one
  answer per server (:meth:`ServiceLink.request`); a server gathers one request from every client
  still running (:meth:`ServiceServer.gather`) and answers each (:meth:`ServiceServer.reply`).
* **Shutdown.** :meth:`ServiceLink.close` tells every server ``stop``, or ``abort`` with the error
  (the controller alone, or with ``every_client`` each client), waiting at most ``close_timeout_s``
  per server (a dead or busy one is skipped with a warning). :meth:`ServiceServer.serve` returns 0
  after ``stop``, 1 after ``abort`` or when this server failed.
* **Errors.** A server that fails records its error (:meth:`ServiceServer.fail`: rank, host, what
  and the exception) and answers the next round with it instead of results (``send_rows(...,
  error=)``, :meth:`ServiceServer.reply_error`); every client rank raises it as
  :class:`~spmd_rl.distributed.comm.RemoteFailure`. A client that fails anywhere else aborts
  (``close(error)``): the servers stop, and a server with requests still coming answers them with
  that error until every client is done (:meth:`ServiceServer.drain`), so no client waits for it.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from spmd_rl.distributed.bridge import settle
from spmd_rl.distributed.comm import RemoteFailure, isend_object, recv_object, send_object, split_even

log = logging.getLogger("spmd_rl")

STOP, ABORT = "stop", "abort"


def store_count(key: str, add: int = 0) -> int:
    """The c10d store counter ``key`` after adding ``add`` (0: a look that never blocks)."""
    from torch.distributed.distributed_c10d import _get_default_store  # torch has no public name for it

    return int(_get_default_store().add(key, add))


class ServiceLink:
    """One rank's end of the link between the clients and the servers of one role (built on the
    ranks of both pools). ``every_client``: each client sends requests and closes (the reward pool);
    otherwise the controller (the first client) alone commands and closes."""

    def __init__(self, *, role: str, clients: Sequence[int], servers: Sequence[int], close_timeout_s: float = 60.0,
                 counter: str | None = None, every_client: bool = False) -> None:
        self.role = role
        self.clients, self.servers = list(clients), list(servers)
        if not self.clients or not self.servers or set(self.clients) & set(self.servers):
            raise ValueError(f"the {role} link needs disjoint, non-empty client {self.clients} and server "
                             f"{self.servers} ranks")
        self.controller = self.clients[0]
        self.close_timeout_s = close_timeout_s
        self.counter = counter
        self.every_client = every_client
        self.rank = dist.get_rank()
        self.seq = 0  # requests sent (client) or gathered (server)
        self.closed = False
        self.pending: list = []  # sends not completed yet, with their buffers

    @property
    def is_controller(self) -> bool:
        return self.rank == self.controller

    def hold(self, sends: list) -> None:
        """Keep nonblocking sends (``(work, buffer)`` pairs) until they are done."""
        self.pending = settle(self.pending) + list(sends)

    def command(self, kind: str, payload: Any = None) -> None:
        """The controller sends ``(kind, payload)`` to every server without waiting; a no-op elsewhere."""
        if not self.is_controller:
            return
        self.pending = settle(self.pending)
        if self.counter is not None:
            store_count(self.counter, 1)
        for r in self.servers:
            self.pending += isend_object((kind, payload), r)

    def request(self, rows: Sequence[Any]) -> list[Any]:
        """Every client, once per round (rows possibly empty): ``rows`` split in contiguous, near-equal
        slices over the servers; one result per row back, in order. Raises
        :class:`~spmd_rl.distributed.comm.RemoteFailure` after reading every answer when a server failed."""
        self.seq += 1
        chunks = split_even(rows, len(self.servers))
        for server, chunk in zip(self.servers, chunks):
            try:
                send_object(("rows", (self.seq, chunk)), server)
            except RuntimeError as e:  # the server died or timed out
                raise RemoteFailure(server, f"could not send the rows ({e})") from e
        results: list[Any] = []
        failures: list[RemoteFailure] = []
        for server, chunk in zip(self.servers, chunks):
            try:
                _, (kind, (seq, payload)) = recv_object(server)
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
        """Tell every server ``stop``, or ``abort`` with ``error``; at most ``close_timeout_s`` per
        server. Only the controller sends, or every client with ``every_client``; once."""
        if self.closed:
            return
        self.closed = True
        if not (self.every_client or self.is_controller):
            return
        if self.counter is not None and self.is_controller:
            store_count(self.counter, 1)
        message = (STOP, None) if error is None else (ABORT, error)
        for r in self.servers:
            try:
                send_object(message, r, timeout_s=self.close_timeout_s)
            except RuntimeError as e:
                log.warning("could not tell %s rank %d to %s: %s", self.role, r, message[0], e)


@dataclass
class Requests:
    """What a server gathered in one request round."""

    seq: int
    rows: dict[int, list[Any]] = field(default_factory=dict)
    """Rows by client global rank (clients that sent rows this round)."""
    aborted: dict[int, str] = field(default_factory=dict)
    """Clients that aborted, with their error message (the run is failing)."""
    stopped: bool = False
    """Every client said stop (the run ended normally) and none aborted."""


class ServiceServer:
    """The loop of a serving rank: :meth:`setup`, then one command at a time (:meth:`next_command`,
    :meth:`handle`) until ``stop`` (0; 1 when this server failed) or ``abort`` (1)."""

    loading = ""
    """What :meth:`setup` does, for its error message (``loading the {role}`` when empty)."""

    def __init__(self, link: ServiceLink) -> None:
        self.link = link
        self.where = f"{link.role} rank {link.rank} ({socket.gethostname()})"
        self.error: str | None = None  # this server's first failure, answered to the clients
        self.pending: list = []  # sends not taken yet, with their buffers
        self.done: dict[int, str | None] = {}  # every_client: client -> None (stop) or its abort message

    # ------------------------------------------------------------------ what a role implements
    def setup(self) -> None:
        """Build what the role serves (a failure is answered to the clients at their first round)."""

    def handle(self, kind: str, payload: Any) -> None:
        raise RuntimeError(f"{self.where}: unknown command {kind!r} from the controller")

    def next_command(self) -> tuple[str, Any]:
        """The next command from the controller."""
        return self.receive()

    def on_abort(self, error: str) -> None:
        """A client aborted with ``error``: what to do before returning 1."""

    def teardown(self) -> None:
        """Release what :meth:`setup` built."""

    # ------------------------------------------------------------------ the loop
    def serve(self) -> int:
        """Serve until the clients stop (0) or abort (1); 1 too when this server failed."""
        try:
            self.setup()
        except Exception as e:  # noqa: BLE001 - answered to the clients at their first round
            self.fail(self.loading or f"loading the {self.link.role}", e)
        try:
            while True:
                kind, payload = self.next_command()
                if kind == STOP:
                    return 1 if self.error else 0
                if kind == ABORT:
                    log.error("%s: stopping, the trainer failed: %s", self.where, payload)
                    self.on_abort(payload)
                    return 1
                self.handle(kind, payload)
        finally:
            self.pending = settle(self.pending)  # what the clients never took (they stopped) is dropped
            self.teardown()

    def fail(self, what: str, e: BaseException) -> str:
        """Record (the first) failure of this server, ``"{where}: {what} failed: {type}: {message}"``,
        logged with its traceback; the next answer carries it."""
        message = f"{self.where}: {what} failed: {type(e).__name__}: {e}"
        log.error("%s", message, exc_info=e)
        if self.error is None:
            self.error = message
        return message

    def receive(self) -> tuple[str, Any]:
        """The controller's next message (blocks in gloo, no busy wait, up to the group's timeout)."""
        return recv_object(self.link.controller)[1]

    # ------------------------------------------------------------------ every_client: request rounds
    @property
    def all_done(self) -> bool:
        """Every client has sent stop or abort."""
        return len(self.done) == len(self.link.clients)

    def gather(self, *, drain: bool = False) -> Requests:
        """The next request round: rows from every client still running. Returns early when a client
        aborts. With ``drain`` (after an abort) returns after each single message, rows of any round
        included, so that a late client is answered at once."""
        if not drain:
            self.link.seq += 1
        got = Requests(seq=self.link.seq)
        aborts = sum(m is not None for m in self.done.values())
        while not self.all_done:
            if not drain and (sum(m is not None for m in self.done.values()) > aborts
                              or all(c in got.rows or c in self.done for c in self.link.clients)):
                break
            sender, (kind, payload) = recv_object(None)
            if sender not in self.link.clients:
                raise RuntimeError(f"rank {sender} is not a client of the {self.link.role} link "
                                   f"(clients {self.link.clients})")
            if kind == "rows":
                seq, rows = payload
                if seq != self.link.seq and not drain:
                    raise RuntimeError(f"rank {sender} sent round {seq} while this server is at round {self.link.seq}")
                got.rows[sender] = rows
            else:
                self.done[sender] = payload if kind == ABORT else None
            if drain:
                break
        got.aborted = {c: m for c, m in self.done.items() if m is not None}
        got.stopped = not got.aborted and self.all_done
        return got

    def reply(self, got: Requests, results: dict[int, list[Any]]) -> None:
        """Answer every client that sent rows this round with its results (one per row)."""
        for client in sorted(got.rows):
            send_object(("ok", (got.seq, results[client])), client)

    def reply_error(self, got: Requests, message: str) -> None:
        """Answer every client that sent rows this round with ``message`` instead of results (a
        client that has gone away is skipped)."""
        for client in sorted(got.rows):
            try:
                send_object(("error", (got.seq, message)), client, timeout_s=self.link.close_timeout_s)
            except RuntimeError as e:
                log.warning("could not send the error to rank %d: %s", client, e)

    def drain(self, got: Requests, message: str) -> None:
        """Answer this round's and any later rows with ``message`` until every client has stopped or
        aborted (or a receive fails: a client died, or the timeout passed)."""
        self.reply_error(got, message)
        while not self.all_done:
            try:
                got = self.gather(drain=True)
            except RuntimeError as e:
                log.warning("%s: stopped waiting for the clients: %s", self.where, e)
                return
            self.reply_error(got, message)


__all__ = ["ABORT", "STOP", "Requests", "ServiceLink", "ServiceServer", "store_count"]
