"""The pieces of a trainer step that are not the trainer: where this rank's rows are in each layout
(:class:`Placement`) and the stage timer (:class:`StageTimer`).

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


__all__ = ["Placement", "StageTimer"]
