"""Groups streamed from the rollout pool to the actor pool (``rollout.stream``, asynchronous GRPO).

    # actor-pool ranks (the trainer)
    stream = GroupStream(link, pad_token_id=pad)
    stream.issue(prompts, sampling, round_=r, num_prompts=B)     # the controller sends (None elsewhere)
    taken = stream.take(count=B, policy_version=v, max_staleness=S, actor_group=g)   # every actor rank
    # rollout-pool ranks
    StreamServer(link=link, engine=engine, ...).serve()

Without it, a round's rows travel when the whole round is generated and step t trains on round t.
With it, the rollout ranks generate every round's prompts in one stream (:meth:`NativeRollout.stream`:
a finished row's slot takes the next prompt's row, whichever round it belongs to) and send each
GROUP (the ``n`` responses of one prompt) to the controller (global rank 0) the moment its last
response ends. The controller receives groups in the order they complete, from whichever rollout
rank sends first (a tagged receive from any source), and a step trains on the next
``data.train_batch_size`` complete groups: a slow group does not hold up the groups behind it.

* **Bounded.** The trainer keeps at most (S + 1) x ``data.train_batch_size`` prompts issued and not
  trained on (``S = trainer.max_staleness``); ``async/queue_depth`` is the number of groups that
  were complete and waiting when the step took its own (a c10d store counter of groups sent, minus
  those received).
* **Staleness.** A group whose oldest token is more than S policy versions behind the weights the
  step updates is dropped when it is taken and its prompt issued again (``async/dropped_groups``),
  so no update uses a sample more than S versions old (``async/staleness/max`` <= S).
* **Order.** The groups a step takes are laid out sorted by (round, position), so the same set of
  groups gives the same batch whatever order it completed in; which groups complete first depends
  on timing, so a streamed run with S > 0 is not reproducible sample for sample.
* **Weights.** Without ``rollout.partial`` the rollout stops feeding new rows when weights are
  announced, lets the live rows finish, loads them and goes on (a drain); with it, the live rows
  continue under the new weights at the next look (every ``rollout.partial_chunk`` decode steps).
  With ``rollout.stage_weights`` the drain starts at that look too, and the transfer is received then
  into a staging copy, so the actor does not wait for the drain.
  Validation rounds and ``stop`` drain the stream the same way.
* **Messages.** A group is a header ``[status, round, position, n, width, microseconds the rank
  has generated so far]`` (status 1: the length of an error message, which follows) and two
  tensors: int64 ``[n, 2 x width + 2]`` (token ids, their policy versions, length, truncated) and
  float32 ``[n, width]`` (log-probs), all on the stream's tag. A rollout rank that fails sends
  status 1 and its message; every actor rank raises it. ``async/rollout_busy_s``: the most seconds
  a rollout rank generated between two takes (from those counters).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spmd_rl.distributed.bridge import RowRoute, pack_prompts, recv_rows, send_rows, settle
from spmd_rl.distributed.comm import RemoteFailure, broadcast_object
from spmd_rl.distributed.service import store_count
from spmd_rl.seeds import replica_seed

from .pool import COMMANDS_KEY, CONTROLLER, WEIGHTS_KEY, RolloutLink, RolloutServer, response_spec

STREAM_TAG = 7
"""Point-to-point tag of streamed groups (apart from the rounds' rows, which use the default tag)."""
STREAMED_KEY = "spmd_rl/rollout/groups_sent"
"""c10d store counter: groups the rollout pool sent to the controller."""
_HEADER = 6


@dataclass
class Group:
    """One prompt's ``n`` responses, as the controller received them."""

    round: int
    position: int
    ids: torch.Tensor  # [n, width]
    versions: torch.Tensor  # [n, width], -1 past each response
    lengths: torch.Tensor  # [n]
    truncated: torch.Tensor  # [n]
    logprobs: torch.Tensor  # [n, width]

    @property
    def key(self) -> tuple[int, int]:
        return self.round, self.position

    @property
    def oldest(self) -> int:
        """The policy version of its oldest token."""
        valid = self.versions[self.versions >= 0]
        return int(valid.min()) if valid.numel() else 1 << 62


@dataclass
class Taken:
    """What a step took, the same on every actor rank."""

    groups: list[tuple[int, int]]  # (round, position), sorted: the step's prompt order
    dropped: list[tuple[int, int]]  # too stale: their prompts were issued again
    reissued: list[tuple[int, list[tuple[int, int]]]]  # (new round, the dropped groups whose prompts it holds)
    queue_depth: int
    rollout_busy_s: float  # the most seconds a rollout rank generated since the previous take
    rows: tuple[int, int]  # this rank's [start, end) of the step's rows
    tensors: dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------- actor side

class GroupStream:
    """The actor pool's end of the stream, on every actor rank (module docstring). The controller
    keeps each issued prompt until its group is taken, so that a group too stale to train on is
    issued again here, as a new round; every rank learns of it from :attr:`Taken.reissued`."""

    def __init__(self, link: RolloutLink, *, pad_token_id: int) -> None:
        self.link, self.pad_token_id = link, pad_token_id
        self.last_round = 0  # the newest round issued (a round issued again takes the next number)
        self.prompts: dict[tuple[int, int], list[int]] = {}  # controller: (round, position) -> prompt ids
        self.sampling: dict[int, dict[str, Any]] = {}  # controller: each live round's sampling settings
        self.received = 0  # groups the controller received
        self.busy: dict[int, float] = {}  # per rollout rank, its seconds generating so far

    def issue(self, prompts: list[list[int]] | None, sampling: dict[str, Any], *, round_: int,
              num_prompts: int) -> None:
        """Add round ``round_``'s ``num_prompts`` prompts (on the controller; None elsewhere) to the
        rollout pool's stream, a ceil-sized share per rollout replica. Only the controller sends."""
        self.last_round = max(self.last_round, round_)
        if self.link.rank != CONTROLLER:
            return
        assert prompts is not None and len(prompts) == num_prompts
        self.sampling[round_] = sampling
        self.prompts.update(((round_, position), ids) for position, ids in enumerate(prompts))
        # kind "stream": a ceil-sized share per replica, as the server's prompts_of routes it (even shares: "train")
        self.link.command("stream", {"kind": "stream", "round": round_, "num_prompts": num_prompts,
                                     "pad_token_id": self.pad_token_id, **sampling})
        route = RowRoute(sources={CONTROLLER: (0, num_prompts)},
                         dests=self.link.routes.prompt_ranges(num_prompts, even=False))
        self.link.hold(send_rows(route, pack_prompts(prompts), first_row=0, wait=False))

    def take(self, *, count: int, policy_version: int, max_staleness: int,
             actor_group: dist.ProcessGroup | None) -> Taken:
        """Every actor rank: the next ``count`` complete groups no more than ``max_staleness``
        versions behind ``policy_version``, this rank's rows of them in the actor layout."""
        controller = self.link.rank == CONTROLLER
        meta, tensors = self._receive(count, policy_version, max_staleness) if controller else (None, None)
        meta = broadcast_object(meta, src=CONTROLLER, group=actor_group)
        if "error" in meta:
            raise RemoteFailure(*meta["error"])
        for round_, _ in meta["reissued"]:
            self.last_round = max(self.last_round, round_)
        rows = meta["n"] * len(meta["groups"])
        dests = self.link.routes.actor_ranges(rows, by_dp=True)
        route = RowRoute(sources={CONTROLLER: (0, rows)}, dests={r: s for r, s in dests.items() if r != CONTROLLER})
        if controller:
            send_rows(route, tensors, first_row=0)
            a, b = dests[CONTROLLER]
            mine = {k: v[a:b] for k, v in tensors.items()}
        else:
            mine = recv_rows(route, response_spec(0))
        return Taken(groups=[tuple(k) for k in meta["groups"]], dropped=[tuple(k) for k in meta["dropped"]],
                     reissued=[(r, [tuple(k) for k in keys]) for r, keys in meta["reissued"]],
                     queue_depth=meta["queue_depth"], rollout_busy_s=meta["rollout_busy_s"], rows=dests[self.link.rank],
                     tensors=mine)

    def _receive(self, count: int, policy_version: int, max_staleness: int) -> tuple[dict, dict | None]:
        """The controller: groups in the order they complete until ``count`` fresh ones, the stale
        ones issued again; what every rank learns (or the rollout rank's error) and the rows."""
        fresh: list[Group] = []
        dropped, reissued = [], []
        waiting = store_count(STREAMED_KEY) - self.received
        busy_before = dict(self.busy)
        try:
            while len(fresh) < count:
                g = self._recv_group()
                if policy_version - g.oldest > max_staleness:
                    dropped.append(g.key)
                    reissued.append(self._again(g.key))
                else:
                    fresh.append(g)
        except RemoteFailure as e:  # every actor rank raises it, not the controller alone
            return {"error": (e.rank, e.message)}, None
        fresh.sort(key=lambda g: g.key)
        for g in fresh:
            del self.prompts[g.key]
        live = {r for r, _ in self.prompts}
        self.sampling = {r: v for r, v in self.sampling.items() if r in live}
        busy = max((t - busy_before.get(r, 0.0) for r, t in self.busy.items()), default=0.0)
        meta = {"groups": [g.key for g in fresh], "dropped": dropped, "reissued": reissued,
                "queue_depth": max(waiting, 0), "n": fresh[0].ids.shape[0], "rollout_busy_s": busy}
        return meta, _rows_of(fresh)

    def _again(self, key: tuple[int, int]) -> tuple[int, list[tuple[int, int]]]:
        """A dropped group's prompt, issued again as a new round of one prompt."""
        ids, sampling = self.prompts.pop(key), self.sampling[key[0]]
        round_ = self.last_round + 1
        self.issue([ids], sampling, round_=round_, num_prompts=1)
        return round_, [key]

    def _recv_group(self) -> Group:
        header = torch.zeros(_HEADER, dtype=torch.long)
        src = dist.recv(header, src=None, tag=STREAM_TAG)
        status, round_, position, n, width, extra = header.tolist()
        if status != 0:
            message = torch.empty(extra, dtype=torch.uint8)  # extra: the message's length in bytes
            dist.recv(message, src=src, tag=STREAM_TAG)
            raise RemoteFailure(src, bytes(message.tolist()).decode(errors="replace"))
        packed = torch.empty(n, 2 * width + 2, dtype=torch.long)
        logprobs = torch.empty(n, width, dtype=torch.float32)
        dist.recv(packed, src=src, tag=STREAM_TAG)
        dist.recv(logprobs, src=src, tag=STREAM_TAG)
        self.received += 1
        self.busy[src] = extra / 1e6  # its seconds generating so far
        return Group(round_, position, packed[:, :width], packed[:, width:2 * width], packed[:, -2], packed[:, -1],
                     logprobs)


def _rows_of(groups: list[Group]) -> dict[str, torch.Tensor]:
    """The groups' rows as the response tensors a round routes, right-padded to the widest."""
    width = max(g.ids.shape[1] for g in groups)

    def cat(name: str, pad: float) -> torch.Tensor:
        parts = [getattr(g, name) for g in groups]
        if parts[0].dim() > 1:
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts]
        return torch.cat(parts)

    lengths = cat("lengths", 0)
    return {"response_ids": cat("ids", 0), "response_mask": (torch.arange(width)[None, :] < lengths[:, None]).float(),
            "logprobs": cat("logprobs", 0.0), "truncated": cat("truncated", 0), "versions": cat("versions", -1),
            "gen_seconds": torch.zeros(len(lengths))}


# ---------------------------------------------------------------------------------------- rollout side

class StreamServer(RolloutServer):
    """A rollout rank's loop with ``rollout.stream``: ``stream`` commands feed one continuous
    generation; other commands wait for it to drain (weights too, unless ``partial``)."""

    def __init__(self, *, max_prompt_length: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_prompt_length = max_prompt_length
        self.commands_taken = 0
        self.waiting: list[tuple[tuple[int, int, int], list[int]]] = []  # rows not started: ((round, pos, j), ids)
        self.open: dict[tuple[int, int], list] = {}  # groups with responses still going: their finished rows
        self.sampling: dict[str, Any] | None = None  # the newest stream command's settings
        self.held: int | None = None  # rollout.partial: a weights command received, loaded at the next look
        self.streams = 0
        self.busy_s, self.stream_start = 0.0, 0.0  # seconds generating before this stream; its start
        self.error_sent = False

    def receive(self) -> tuple[str, Any]:
        """The controller's next message, counted (compared with the store's ``COMMANDS_KEY``)."""
        message = super().receive()
        self.commands_taken += 1
        return message

    def next_command(self) -> tuple[str, Any]:
        while True:
            if self.held is not None:  # rollout.partial: weights the stream ended before loading
                version, self.held = self.held, None
                self.load_weights(version)
            if self.error is not None:  # e.g. weights that failed to load: the controller raises it
                self.send_error(self.error)
            if self.queued or not self.waiting or self.error is not None:
                break
            self._stream()  # rows a drain left: go on with them first
        return super().next_command()

    def handle(self, kind: str, payload: Any) -> None:
        if kind == "stream":
            self._add(payload, self.prompts_of(payload))
            self._stream()
        else:  # weights, or a validation round
            super().handle(kind, payload)

    def _add(self, p: dict[str, Any], prompts: list[list[int]]) -> None:
        """Queue a stream command's prompts (this replica's share) as rows."""
        first = self.link.routes.prompt_ranges(p["num_prompts"], even=False)[self.link.rank][0]
        self.sampling = p
        for i, ids in enumerate(prompts):
            for j in range(p["n"]):
                self.waiting.append(((p["round"], first + i, j), ids))

    def _take(self, kind: str, payload: Any) -> None:
        """A command received during the stream: prompts join it, anything else waits for it to end."""
        if kind == "stream":
            self._add(payload, self.prompts_of(payload))
        elif kind == "weights" and self.partial:
            self.held = payload
        elif kind == "weights" and self.stage_weights:  # received now, loaded after the drain
            self.queued.append((kind, payload, self.receive_staged()))
        else:
            self.queued.append((kind, payload, self.prompts_of(payload) if kind == "generate" else None))

    def stage(self) -> None:
        """``rollout.stage_weights``: the stream's look for commands (a weight transfer is received at
        once into a staging copy); none once a command waits for the drain."""
        if not self.queued:
            self._poll()

    def _poll(self) -> None:
        """Receive the commands the controller announced (never blocks)."""
        while store_count(COMMANDS_KEY) > self.commands_taken:
            kind, payload = self.receive()
            self._take(kind, payload)
            if kind == "weights" or self.queued:
                return  # the weights' tensors follow their command: loaded by swap() or after the drain

    def swap(self) -> bool:
        if self.held is not None:
            version, self.held = self.held, None
            self.load_weights(version)
            self.versions.append(self.version)
            return True
        if store_count(WEIGHTS_KEY) <= self.weights_taken:
            return False
        while True:
            kind, payload = self.receive()
            if kind == "weights":
                self.load_weights(payload)
                self.versions.append(self.version)
                return True
            self._take(kind, payload)

    def _feed(self, k: int) -> list[tuple[tuple[int, int, int], list[int]]]:
        if not self.queued:
            self._poll()
        if self.queued or self.error:  # a command waits for the stream to drain
            return []
        out, self.waiting = self.waiting[:k], self.waiting[k:]
        for key, _ in out:
            self.open.setdefault(key[:2], [])
        return out

    def _done(self, key: tuple[int, int, int], tokens: torch.Tensor, logprobs: torch.Tensor, swaps: torch.Tensor,
              truncated: bool) -> None:
        rows = self.open[key[:2]]
        rows.append((key[2], tokens, logprobs, torch.tensor(self.versions)[swaps], truncated))
        if len(rows) == self.sampling["n"]:
            del self.open[key[:2]]
            self.send_group(key[0], key[1], sorted(rows, key=lambda r: r[0]))

    def send_group(self, round_: int, position: int, rows: list) -> None:
        n, width = len(rows), max(max(len(r[1]) for r in rows), 1)
        packed = torch.zeros(n, 2 * width + 2, dtype=torch.long)
        packed[:, width:2 * width] = -1
        logprobs = torch.zeros(n, width)
        for i, (_, tokens, lp, versions, truncated) in enumerate(rows):
            k = len(tokens)
            packed[i, :k], packed[i, width:width + k], logprobs[i, :k] = tokens, versions, lp
            packed[i, -2], packed[i, -1] = k, int(truncated)
        busy_us = round((self.busy_s + time.perf_counter() - self.stream_start) * 1e6)
        header = torch.tensor([0, round_, position, n, width, busy_us])
        self.pending = settle(self.pending) + [(dist.isend(t, dst=CONTROLLER, tag=STREAM_TAG), t)
                                               for t in (header, packed, logprobs)]
        store_count(STREAMED_KEY, 1)

    def send_error(self, message: str) -> None:
        if self.error_sent:
            return
        self.error_sent = True
        data = torch.tensor(list(message.encode()), dtype=torch.uint8)
        header = torch.tensor([1, 0, 0, 0, 0, len(data)])
        self.pending = settle(self.pending) + [(dist.isend(t, dst=CONTROLLER, tag=STREAM_TAG), t) for t in (header, data)]

    def _stream(self) -> None:
        """Generate until the waiting rows are done and a command other than ``stream`` waits (or none)."""
        p = self.sampling
        if self.error is not None:
            self.send_error(self.error)
            self.waiting, self.open = [], {}
            return
        self.streams += 1
        try:
            self.engine.wake_up()
            self.versions = [self.version]
            self.stream_start = time.perf_counter()
            self.engine.stream(feed=self._feed, done=self._done, temperature=p["temperature"], top_p=p["top_p"],
                               top_k=p["top_k"], max_new_tokens=p["max_new_tokens"],
                               max_prompt_length=self.max_prompt_length,
                               seed=replica_seed(p["seed"], self.replica, stream=self.streams), **self.hooks())
            self.busy_s += time.perf_counter() - self.stream_start
        except Exception as e:  # noqa: BLE001 - the actor ranks raise it
            self.fail("generation", e)
        if self.error is not None:
            self.send_error(self.error)
            self.waiting, self.open = [], {}


__all__ = ["STREAMED_KEY", "STREAM_TAG", "GroupStream", "StreamServer", "Taken"]
