"""The rollout on a pool of its own (``pools.rollout_ranks`` > 0): its ranks serve generation to the
actor's pool, step by step, in lockstep with it.

    # rollout-pool ranks (spmd_rl.serve.serve_pool dispatches by pool membership)
    code = RolloutServer(link=link, engine=engine, ...).serve()   # until the trainer says stop (0) or abort (1)
    # actor-pool ranks, inside the trainer's stages
    link.sync_weights(actor.named_full_tensors(dtype))    # weight_sync: every actor rank iterates
    rows = link.generate(prompt_ids, sampling, kind="train")   # gen: this actor rank's rows, as tensors
    link.close(error)                                     # stop, or abort with the error

Both ends are the rollout role on the service protocol (:mod:`spmd_rl.distributed.service`).
Everything that moves is a tensor (:mod:`spmd_rl.distributed.bridge`) except the controller's
short commands (global rank 0 to every rollout rank: ``weights``, ``generate`` with the sampling
settings, and with multi-turn episodes the round's data rows, ``stop``, ``abort``). One ``generate`` round:

1. global rank 0 (holding the step's prompts) routes the prompts to the rollout ranks: replica
   ``d`` of the rollout layout gets the ``d``-th contiguous share, all its tp x pp ranks alike;
2. each replica generates ``n`` responses per prompt (seed per replica, as on a colocated rollout,
   so a separate pool with the same data-parallel size samples the same responses), or with
   episodes plays ``n`` episodes of each prompt's data row (:mod:`spmd_rl.episodes.runner`);
3. the responses are routed to the actor ranks in the actor's layout: each actor data-parallel
   rank gets its contiguous share of the step's rows (training) or each actor rank an even share
   (validation), so no relayout follows.

Weights: after every update the actor's full tensors go from actor rank 0 (or, with several
processes per GPU, from the actor rank on the same GPU, by CUDA IPC) to the rollout ranks in
buckets (:class:`~spmd_rl.distributed.bridge.WeightBridge`), streamed into the engine's
``load_weights``. Commands are first in, first out, so new weights wait until the rounds issued
before them are generated, unless ``rollout.partial``: then the engine asks the server every
``rollout.partial_chunk`` decode steps (:meth:`RolloutServer.swap`), which reads one counter in the
c10d store (the weight transfers the controller announced, ``WEIGHTS_KEY``; a look that never
blocks, which gloo's point-to-point receives cannot give) and, when a transfer is announced, takes
the commands up to it (a later round's command with its prompts is kept for its turn), loads the
weights mid-generation and tells the engine to continue the unfinished responses under them. With
``rollout.stage_weights`` the same look (:meth:`RolloutServer.stage`) receives the transfer into a
staging copy and keeps it for its turn, so the actor does not wait for the round to end. Every
token carries the policy version of the weights that sampled it. A rollout rank that fails (loading weights or generating) answers the next round
with its error, and every actor rank raises it; an actor rank that fails sends ``abort``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from spmd_rl.distributed.bridge import (
    PROMPT_SPEC, RowRoute, TransferStats, WeightBridge, pack_prompts, recv_rows, send_rows, settle, unpack_prompts,
)
from spmd_rl.distributed.comm import split_even
from spmd_rl.distributed.dims import RolloutLayout
from spmd_rl.distributed.pools import PoolSpec
from spmd_rl.distributed.service import ServiceLink, ServiceServer, store_count
from spmd_rl.seeds import replica_seed

log = logging.getLogger("spmd_rl")

CONTROLLER = 0
"""Global rank of the controller: the actor pool's first rank."""
WEIGHTS_KEY = "spmd_rl/rollout/weights_sent"
"""c10d store counter: weight transfers the controller has announced to the rollout pool."""
COMMANDS_KEY = "spmd_rl/rollout/commands_sent"
"""c10d store counter: commands the controller has sent to the rollout pool (a streaming rollout
rank looks at it between decode steps: a look that never blocks)."""


def response_spec(pad_token_id: int, *, episodes: bool = False, experts: bool = False,
                  ) -> dict[str, tuple[torch.dtype, float]]:
    """The response tensors a round routes, with their dtypes and pad values; with ``episodes`` also
    what :func:`~spmd_rl.episodes.runner.episode_rows` adds (each episode's prompt, context mask and
    ``env_*`` counts), which only episode rounds route; with ``experts`` each generated token's experts
    (``routed_experts``, router replay)."""
    spec = {"response_ids": (torch.long, pad_token_id), "response_mask": (torch.float32, 0.0),
            "logprobs": (torch.float32, 0.0), "truncated": (torch.long, 0), "versions": (torch.long, -1),
            "gen_seconds": (torch.float32, 0.0)}
    if episodes:
        spec.update(EPISODE_SPEC)
    if experts:
        spec["routed_experts"] = (torch.int16, -1)
    return spec


EPISODE_SPEC: dict[str, tuple[torch.dtype, float]] = {
    "context_mask": (torch.float32, 0.0), "prompt_ids": (torch.long, 0), "prompt_lengths": (torch.long, 0),
    "env_reward": (torch.float32, 0.0), "env_turns": (torch.long, 0), "env_tool_calls": (torch.long, 0),
    "env_tool_errors": (torch.long, 0), "env_failed": (torch.long, 0), "env_seconds": (torch.float32, 0.0),
    "env_fed_tokens": (torch.long, 0), "env_reused_tokens": (torch.long, 0)}
"""An episode round's tensors beyond a single-turn round's (``prompt_ids`` padded with 0, as the runner's)."""


@dataclass(frozen=True)
class RolloutRoutes:
    """Where one round's prompts and responses go (pure: every rank computes the same)."""

    rollout: RolloutLayout
    rollout_pool: PoolSpec
    actor_pool: PoolSpec
    actor_dp: tuple[int, ...]
    """The actor data-parallel rank of each actor-pool rank."""

    def prompt_ranges(self, num_prompts: int, *, even: bool) -> dict[int, tuple[int, int]]:
        """Per rollout rank (global): its replica's prompts. ``even``: equal shares (training);
        else ceil-sized shares, the last ones possibly empty (validation)."""
        rdp = self.rollout.dp_size
        share = num_prompts // rdp if even else math.ceil(num_prompts / rdp)
        out = {}
        for local in range(self.rollout_pool.size):
            d = self.rollout.coords(local)["dp"]
            out[self.rollout_pool.start + local] = (min(d * share, num_prompts), min((d + 1) * share, num_prompts))
        return out

    def response_sources(self, prompts: dict[int, tuple[int, int]], n: int) -> dict[int, tuple[int, int]]:
        """Per rollout rank: the response rows it sends, a share of its replica's rows (tp x pp ranks
        of one replica split them, as on a colocated rollout)."""
        mp = self.rollout.tp * self.rollout.pp
        out = {}
        for rank, (a, b) in prompts.items():
            c = self.rollout.coords(rank - self.rollout_pool.start)
            m = c["pp"] * self.rollout.tp + c["tp"]
            parts = split_even(range(a * n, b * n), mp)[m]
            out[rank] = (parts[0], parts[-1] + 1) if parts else (b * n, b * n)
        return out

    def actor_ranges(self, num_rows: int, *, by_dp: bool) -> dict[int, tuple[int, int]]:
        """Per actor rank (global): ``by_dp`` its data-parallel rank's contiguous share (training),
        else an even share over the pool's ranks (validation: each row scored once)."""
        out = {}
        if by_dp:
            dp_size = max(self.actor_dp) + 1
            size = num_rows // dp_size
            for local, d in enumerate(self.actor_dp):
                out[self.actor_pool.start + local] = (d * size, (d + 1) * size)
        else:
            start = 0
            for local, part in enumerate(split_even(range(num_rows), self.actor_pool.size)):
                out[self.actor_pool.start + local] = (start, start + len(part))
                start += len(part)
        return out


def routes_of(plan: Any) -> RolloutRoutes:
    """The routes of a :class:`~spmd_rl.plan.Plan` with a separate rollout pool."""
    actor = plan.global_pool
    return RolloutRoutes(rollout=plan.rollout, rollout_pool=plan.rollout_pool, actor_pool=actor,
                         actor_dp=tuple(plan.dp_rank(k) for k in range(actor.size)))


@dataclass
class Round:
    """One generation round issued to the rollout pool and not taken back yet."""

    kind: str
    num_prompts: int
    n: int
    pad_token_id: int
    rows: dict[str, torch.Tensor] | None = None
    """Received ahead of its turn (a later round was taken first)."""
    episodes: bool = False
    """Multi-turn episodes: its rows carry :data:`EPISODE_SPEC` too."""
    experts: bool = False
    """Its rows carry each generated token's experts (``routed_experts``, router replay)."""


class RolloutLink(ServiceLink):
    """One rank's end of the link between the actor pool and the rollout pool (the rollout role's
    client on :class:`~spmd_rl.distributed.service.ServiceLink`).

    Built on every rank of both pools (see :func:`spmd_rl.world.build_run_groups`);
    ``bridge`` is this rank's weight bridge (None on actor ranks that send no weights). Rounds are
    first in, first out: :meth:`issue` sends a round's command and prompts without waiting (the
    rollout pool may still be busy with earlier rounds), :meth:`take` receives the oldest round's
    rows; :meth:`generate` is both, for a synchronous step.
    """

    def __init__(self, *, routes: RolloutRoutes, bridge: WeightBridge | None, close_timeout_s: float = 60.0) -> None:
        super().__init__(role="rollout", clients=routes.actor_pool.ranks, servers=routes.rollout_pool.ranks,
                         close_timeout_s=close_timeout_s, counter=COMMANDS_KEY)
        self.routes = routes
        self.bridge = bridge
        self.last_transfer: TransferStats | None = None
        self.rounds: list[Round] = []  # the queue between the pools, oldest first
        self.max_in_flight: int | None = None  # its bound (the trainer's: S + 1 training rounds + a validation one)
        self.record_experts = False  # the rollout ranks record experts (actor.router_replay): rows carry them

    @property
    def rollout_ranks(self) -> list[int]:
        return self.servers

    @property
    def in_flight(self) -> int:
        """Rounds issued and not taken back."""
        return len(self.rounds)

    # ------------------------------------------------------------------ actor side
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Every actor rank calls this with the actor's full tensors (a collective over the actor
        pool); the ranks holding a bridge send them to the rollout ranks, which load them after the
        rounds issued before (so this waits for those to be generated)."""
        if self.rank == CONTROLLER:
            # Announced before the command is sent: a rollout rank in the middle of a round that sees the
            # count receives the commands up to it, which completes the sends of rounds issued since (their
            # prompts), the sends this rank settles before it sends the command.
            store_count(WEIGHTS_KEY, 1)
        self.command("weights", version)
        if self.bridge is not None:
            self.last_transfer = self.bridge.send(named_tensors)
        else:
            for _ in named_tensors:  # the gathers are collective over the actor pool
                pass

    def issue(self, prompts: list[list[int]] | None, sampling: dict[str, Any], *, kind: str, num_prompts: int,
              pad_token_id: int, rows: list[dict] | None = None) -> None:
        """Start one round: ``prompts`` (all of them, on the controller; None elsewhere) go to the
        rollout pool, which generates ``sampling["n"]`` responses each when it gets there. ``rows``
        (episodes; a list on every actor rank, the round's data rows on the controller): each
        prompt's data row, sent in the command (small dicts), and ``n`` episodes of each are played."""
        if self.max_in_flight is not None and len(self.rounds) >= self.max_in_flight:
            raise RuntimeError(f"RolloutLink.issue: {len(self.rounds)} rounds in flight already, the bound is "
                               f"{self.max_in_flight}: take one first")
        episodes = {} if rows is None else {"rows": rows}
        self.command("generate", {"kind": kind, "num_prompts": num_prompts, "pad_token_id": pad_token_id, **sampling,
                                  **episodes})
        if self.rank == CONTROLLER:
            assert prompts is not None and len(prompts) == num_prompts
            route = RowRoute(sources={CONTROLLER: (0, num_prompts)},
                             dests=self.routes.prompt_ranges(num_prompts, even=kind == "train"))
            self.hold(send_rows(route, pack_prompts(prompts), first_row=0, wait=False))
        self.rounds.append(Round(kind, num_prompts, sampling["n"], pad_token_id, episodes=rows is not None,
                                 experts=self.record_experts and rows is None))

    def take(self, *, last: bool = False) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
        """The oldest round's rows for this actor rank (the newest with ``last``, the older ones
        received and kept for their turn): its ``[start, end)`` row range and the tensors
        (``response_ids``, ``response_mask``, ``logprobs``, ``truncated``, per-token ``versions``:
        the policy version of the weights that sampled each token; per row ``gen_seconds``: how
        long its replica generated)."""
        if not self.rounds:
            raise RuntimeError("RolloutLink.take: no round in flight")
        for r in self.rounds[:len(self.rounds) if last else 1]:  # rows arrive in the order rounds were issued
            if r.rows is None:
                r.rows = self._receive(r)
        r = self.rounds.pop(-1 if last else 0)
        return self._dests(r)[self.rank], r.rows

    def _dests(self, r: Round) -> dict[int, tuple[int, int]]:
        return self.routes.actor_ranges(r.num_prompts * r.n, by_dp=r.kind == "train")

    def _receive(self, r: Round) -> dict[str, torch.Tensor]:
        prompt_ranges = self.routes.prompt_ranges(r.num_prompts, even=r.kind == "train")
        route = RowRoute(sources=self.routes.response_sources(prompt_ranges, r.n), dests=self._dests(r))
        return recv_rows(route, response_spec(r.pad_token_id, episodes=r.episodes, experts=r.experts))

    def generate(self, prompts: list[list[int]] | None, sampling: dict[str, Any], *, kind: str,
                 num_prompts: int, pad_token_id: int) -> tuple[tuple[int, int], dict[str, torch.Tensor]]:
        """One round, issued and taken (no other round in flight)."""
        if self.rounds:
            raise RuntimeError(f"RolloutLink.generate with {len(self.rounds)} rounds in flight: take them first")
        self.issue(prompts, sampling, kind=kind, num_prompts=num_prompts, pad_token_id=pad_token_id)
        return self.take()


class RolloutServer(ServiceServer):
    """The loop of a rollout-pool rank (the rollout role's server on
    :class:`~spmd_rl.distributed.service.ServiceServer`): commands from the controller until
    ``stop`` or ``abort``."""

    def __init__(self, *, link: RolloutLink, engine: Any, replica: int, sleep_level: int, partial: bool = False,
                 partial_chunk: int = 32, stage_weights: bool = False, episodes: Any = None) -> None:
        """``replica``: this rank's rollout data-parallel rank (added to training seeds, as colocated);
        ``partial``: load weights that arrive during a training round and continue its responses
        under them, looking every ``partial_chunk`` decode steps (``rollout.partial``);
        ``stage_weights``: receive them then into a staging copy, loaded after the round
        (``rollout.stage_weights``); ``episodes``: the run's episode runner
        (:func:`spmd_rl.episodes.build.build_episode_runner`), which plays the rounds that carry data rows."""
        super().__init__(link)
        self.episodes = episodes
        self.link: RolloutLink = link
        self.engine, self.replica, self.sleep_level = engine, replica, sleep_level
        self.partial, self.partial_chunk, self.stage_weights = partial, partial_chunk, stage_weights
        self.staging_refused = False  # a staged copy did not fit once (warned once)
        self.version = 0  # the policy version of the weights held
        self.weights_taken = 0  # weight transfers received (compared with the store's WEIGHTS_KEY)
        self.versions: list[int] = []  # the current round's weights: first, then one per swap
        # commands taken during a generation: (kind, payload, what came with it: a round's prompts, or the
        # tensors of a staged weight transfer)
        self.queued: list[tuple[str, Any, Any]] = []
        self.ahead: Any = None  # what came with the command being handled, when it was taken during a generation

    def next_command(self) -> tuple[str, Any]:
        """The next command: one taken during a generation, else the controller's next."""
        kind, payload, self.ahead = self.queued.pop(0) if self.queued else (*self.receive(), None)
        return kind, payload

    def handle(self, kind: str, payload: Any) -> None:
        if kind == "weights":
            self.load_weights(payload, staged=self.ahead)
        elif kind == "generate":
            self._generate(payload, self.ahead)
        else:
            super().handle(kind, payload)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def swap(self) -> bool:
        """The engine's look for new weights during a training round (``rollout.partial``): if the
        controller announced a transfer not taken yet, take the commands up to it (a round issued
        earlier is received with its prompts and kept for its turn), load the weights and say so."""
        if store_count(WEIGHTS_KEY) <= self.weights_taken:
            return False
        while True:
            kind, payload = self.receive()
            if kind == "weights":  # loaded (or failed: the round's rows then carry the error)
                self.load_weights(payload)
                self.versions.append(self.version)
                return True
            self.queued.append((kind, payload, self.prompts_of(payload) if kind == "generate" else None))

    def stage(self) -> None:
        """The engine's look during a training round with ``rollout.stage_weights``: a weight transfer
        the controller announced is received now into a staging copy, so the actor goes on, and is
        loaded when the round ends, in its turn (the commands before it are taken and kept, as
        :meth:`swap` does). One transfer at most waits so: a second one waits for the first's load."""
        waiting = any(kind == "weights" for kind, *_ in self.queued)
        if waiting or store_count(WEIGHTS_KEY) <= self.weights_taken:
            return
        while True:
            kind, payload = self.receive()
            if kind == "weights":
                self.queued.append((kind, payload, self.receive_staged()))
                return
            self.queued.append((kind, payload, self.prompts_of(payload) if kind == "generate" else None))

    def receive_staged(self) -> list[tuple[str, torch.Tensor]] | None:
        """A weight transfer's tensors, received now and held; None (received later, when loaded)
        when one more copy of the weights does not fit in this rank's memory."""
        assert self.link.bridge is not None
        short = self.engine.room_for_weights()
        if short:
            if not self.staging_refused:
                log.warning("%s: rollout.stage_weights: %s; weights are received when the round ends", self.where,
                            short)
            self.staging_refused = True
            return None
        self.weights_taken += 1
        return list(self.link.bridge.receive())

    def load_weights(self, version: int, staged: list[tuple[str, torch.Tensor]] | None = None) -> None:
        """Load a transfer: received now, or held since :meth:`receive_staged` (``staged``)."""
        assert self.link.bridge is not None
        if staged is None:
            self.weights_taken += 1
        self.version = int(version)
        tensors = self.link.bridge.receive() if staged is None else iter(staged)
        try:
            if self.error is None:
                self.engine.load_weights(tensors)
        except Exception as e:  # noqa: BLE001 - reported to the actor pool at the next round
            self.fail("loading the weights", e)
        for _ in tensors:  # receive the rest of the transfer, which the sender goes on broadcasting
            pass

    def hooks(self) -> dict[str, Any]:
        """What the engine calls while it decodes a training round's (or the stream's) rows."""
        if self.partial:
            return {"swap": self.swap, "swap_every": self.partial_chunk}
        if self.stage_weights:
            return {"look": self.stage, "swap_every": self.partial_chunk}
        return {}

    def prompts_of(self, p: dict[str, Any]) -> list[list[int]]:
        """This rank's prompts of the round ``p`` (its replica's share), from the controller."""
        prompt_ranges = self.link.routes.prompt_ranges(p["num_prompts"], even=p["kind"] == "train")
        return unpack_prompts(recv_rows(RowRoute(sources={CONTROLLER: (0, p["num_prompts"])}, dests=prompt_ranges),
                                        PROMPT_SPEC))

    def _generate(self, p: dict[str, Any], prompts: list[list[int]] | None) -> None:
        """One round: ``prompts`` when they were received ahead (during the previous round), else now."""
        routes, me = self.link.routes, self.link.rank
        train = p["kind"] == "train"
        prompt_ranges = routes.prompt_ranges(p["num_prompts"], even=train)
        prompts = self.prompts_of(p) if prompts is None else prompts
        n = p["n"]
        route = RowRoute(sources=routes.response_sources(prompt_ranges, n),
                         dests=routes.actor_ranges(p["num_prompts"] * n, by_dp=train))
        first = prompt_ranges[me][0] * n
        tensors: dict[str, torch.Tensor] = {}
        error = self.error
        if error is None and prompts:
            try:
                a, b = prompt_ranges[me]
                tensors = self._play(p, prompts, p["rows"][a:b] if "rows" in p else None, train)
            except Exception as e:  # noqa: BLE001 - the actor ranks raise it
                error = self.fail("generation", e)
            error = error or self.error  # weights that failed to load mid-round (rollout.partial)
            if error is not None:
                tensors = {}
        # Not waited for: the actor pool takes the rows when its schedule gets there.
        self.pending = settle(self.pending) + send_rows(route, tensors, first_row=first, error=error, wait=False)

    def _play(self, p: dict[str, Any], prompts: list[list[int]], rows: list[dict] | None,
              train: bool) -> dict[str, torch.Tensor]:
        """This replica's rows of round ``p``: ``n`` responses to each of ``prompts``, or with data
        ``rows`` ``n`` episodes of each, played by the episode runner (the seeds as on a colocated rollout)."""
        start, n = time.perf_counter(), p["n"]
        sampling = dict(temperature=p["temperature"], top_p=p["top_p"], top_k=p["top_k"],
                        max_new_tokens=p["max_new_tokens"], seed=replica_seed(p["seed"], self.replica if train else 0))
        self.engine.wake_up()
        self.versions = [self.version]
        if rows is not None:
            if self.episodes is None:
                raise RuntimeError("a round of episodes reached a rollout rank built without an episode runner")
            # Weights wait for the round's end (plan() refuses rollout.partial with episodes): every token,
            # the model's and the environment's between its turns, is of the weights held now.
            out = self.episodes.run(self.engine, rows, n=n, sampling=sampling)
            out["versions"] = torch.full(out["response_ids"].shape, self.version, dtype=torch.long)
        else:
            # weights may change mid-round only in training rounds: validation's are issued after the sync
            g = self.engine.generate(prompts, n=n, **sampling, **(self.hooks() if train else {}))
            out = {"response_ids": g.response_ids.cpu(), "response_mask": g.response_mask.float().cpu(),
                   "logprobs": g.logprobs.float().cpu(), "truncated": g.truncated.long().cpu(),
                   "versions": (torch.tensor(self.versions)[g.weight_swaps] if g.weight_swaps is not None
                                else torch.full(g.response_ids.shape, self.version, dtype=torch.long))}
            if g.routed_experts is not None:  # router replay: each generated token's experts
                out["routed_experts"] = g.routed_experts
        self.engine.sleep(self.sleep_level)
        out["gen_seconds"] = torch.full((len(prompts) * n,), time.perf_counter() - start)
        # sent in the order the takers receive them
        spec = response_spec(0, episodes=rows is not None, experts=rows is None and "routed_experts" in out)
        return {k: out[k].to(dtype) for k, (dtype, _) in spec.items()}


__all__ = ["COMMANDS_KEY", "CONTROLLER", "EPISODE_SPEC", "WEIGHTS_KEY", "Round", "RolloutLink", "RolloutRoutes", "RolloutServer",
           "response_spec", "routes_of"]
