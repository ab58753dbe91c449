"""The pieces of a trainer step that are not the trainer: where this rank's rows are in each layout
(:class:`Placement`), the stage timer (:class:`StageTimer`), the rollout's seed per replica, and the
rounds asynchronous GRPO keeps in flight (:class:`InFlight`).

    place = Placement.of(plan, pool_rank)         # rollout / actor dp coordinates, sum weight
    timer = StageTimer(step); with timer("gen"): ...   # seconds, profiler range, watchdog heartbeat
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from spmd_rl.distributed import watchdog
from spmd_rl.plan import Plan
from spmd_rl.profiling import STAGE_PREFIX


class StageTimer:
    """Seconds per stage of one step; each stage is also a profiler range and a watchdog heartbeat
    (:mod:`spmd_rl.distributed.watchdog`: a rank stuck in a stage is named, not waited for)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        with torch.profiler.record_function(STAGE_PREFIX + name), watchdog.current().stage(name, self.step):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class Placement:
    """Where this rank's rows are in the rollout and the actor layouts (global-pool-local ranks).

    The tp x pp ranks of one rollout replica generate the same rows and each keeps a contiguous
    share (its ``mp`` rank), so the rank order (dp, mp) = pool rank order is the global row order.
    The actor's dp ranks then take their rows from that order (:func:`relayout`)."""

    rollout_dp: int
    rollout_dp_size: int
    rollout_mp: int
    rollout_mp_size: int
    actor_dp: int
    actor_dp_size: int
    sum_weight: float
    """1.0 on the one rank of each actor dp group that adds its rows to sums over the pool, else 0.0."""

    @classmethod
    def of(cls, p: Plan, rank: int) -> Placement:
        if p.rollout_separate:  # rows arrive from the rollout pool already in the actor's layout
            dp = p.dp_rank(rank)
            return cls(rollout_dp=dp, rollout_dp_size=p.dp_size, rollout_mp=0, rollout_mp_size=1, actor_dp=dp,
                       actor_dp_size=p.dp_size, sum_weight=float(p.counts_in_sums(rank)))
        c = p.rollout.coords(rank)
        return cls(rollout_dp=c["dp"], rollout_dp_size=p.rollout_dp_size, rollout_mp=c["pp"] * p.rollout.tp + c["tp"],
                   rollout_mp_size=p.rollout.tp * p.rollout.pp, actor_dp=p.dp_rank(rank), actor_dp_size=p.dp_size,
                   sum_weight=float(p.counts_in_sums(rank)))

    def rollout_source(self, rank: int, pool_size: int) -> tuple[int, int]:
        """Rows' origin for :func:`relayout`: the replica (one model per rank) or the rank's own share."""
        return (rank, pool_size) if self.rollout_mp_size > 1 else (self.rollout_dp, self.rollout_dp_size)


class InFlight:
    """Asynchronous GRPO's rounds in flight: (step, prompt indices), oldest first. A checkpoint holds
    them; a resumed run generates them again (with the resumed weights)."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, list[int]]] = []
        self.restored: list[tuple[int, list[int]]] = []
        self.next_step = 1

    def add(self, step: int, indices: list[int]) -> None:
        self.rounds.append((step, list(indices)))
        self.next_step = step + 1

    def pop(self) -> tuple[int, list[int]]:
        return self.rounds.pop(0)

    def reissue(self) -> list[tuple[int, list[int]]]:
        """The rounds a resumed checkpoint held (to generate again); after them, new ones."""
        out, self.restored = self.restored, []
        return out

    def state_dict(self) -> dict:
        return {"rounds": [[step, *indices] for step, indices in self.rounds]}

    def load_state_dict(self, state: dict) -> None:
        self.restored = [(int(r[0]), [int(i) for i in r[1:]]) for r in state["rounds"]]


class GroupsInFlight:
    """``rollout.stream``: the prompts issued to the rollout pool and not trained on yet, by round
    (``round -> {position: prompt index}``). A checkpoint holds them (the same format as
    :class:`InFlight`: a round with the prompts it has left); a resumed run issues them again."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[int, int]] = {}
        self.restored: list[tuple[int, list[int]]] = []
        self.next_round = 1

    @property
    def outstanding(self) -> int:
        """Prompts issued and not trained on (complete, generating, or waiting to start)."""
        return sum(len(r) for r in self.rounds.values())

    def add(self, round_: int, indices: list[int]) -> None:
        self.rounds[round_] = dict(enumerate(indices))
        self.next_round = max(self.next_round, round_ + 1)

    def reserve(self) -> int:
        """A new round's number (the controller, issuing the prompts of dropped groups again)."""
        self.next_round += 1
        return self.next_round - 1

    def sample(self, round_: int, position: int) -> int:
        return self.rounds[round_][position]

    def take(self, groups: list[tuple[int, int]], dropped: list[tuple[int, int]],
             reissued: list[tuple[int, list[int]]]) -> list[int]:
        """The prompt indices of a step's complete ``groups``, which leave the flight with the
        ``dropped`` (too stale) ones. ``reissued``: the rounds that issued the dropped prompts again,
        registered first: a group of theirs can complete, and be among ``groups``, in the same take."""
        for round_, indices in reissued:
            self.add(round_, indices)
        taken = [self.sample(*key) for key in groups]
        for round_, position in groups + dropped:
            del self.rounds[round_][position]
            if not self.rounds[round_]:
                del self.rounds[round_]
        return taken

    def reissue(self) -> list[tuple[int, list[int]]]:
        out, self.restored = self.restored, []
        return out

    def state_dict(self) -> dict:
        return {"rounds": [[r, *left.values()] for r, left in sorted(self.rounds.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.restored = [(int(r[0]), [int(i) for i in r[1:]]) for r in state["rounds"]]


__all__ = ["GroupsInFlight", "InFlight", "Placement", "StageTimer"]
