"""Where a step's batch comes from: one object the training loop asks for the next batch and tells
when the weights changed.

    source = build_batch_source(rollout, actor=actor, prompts=prompts, scorer=scorer, layout=layout,
                                staleness=S, stream=cfg.rollout.stream, dynamic=dapo_or_none, total_steps=T)
    source.start(step, version)                    # before the first step (after a resume too)
    batch = source.next_batch(step, acc, timer)    # scored, in the actor's data-parallel layout
    source.weights_changed(step, version, timer)   # after the update
    source.in_flight                               # what a checkpoint saves (None: nothing in flight)

Its implementations: synchronous rounds, colocated or on a rollout pool (:class:`SyncRounds`),
DAPO's extra rounds over them (:class:`FilteredRounds`), rounds generated ahead on a rollout pool
(:class:`RoundsAhead`, ``trainer.max_staleness`` > 0) and streamed groups (:class:`StreamedGroups`,
``rollout.stream``). The loop does not know which one it has; none of them calls back into it.
"""

from __future__ import annotations

from typing import Any, Protocol

from spmd_rl.algo.filtering import DynamicSampling
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.metrics import MetricAccumulator
from spmd_rl.source.ahead import GroupsInFlight, InFlight, RoundsAhead, StreamedGroups
from spmd_rl.source.rollout import Episodes, LocalRollout, PoolRollout, Rows
from spmd_rl.source.rounds import ActorLayout, FilteredRounds, SyncRounds
from spmd_rl.source.rows import Scorer, StepPrompts
from spmd_rl.step import StageTimer


class BatchSource(Protocol):
    """What the training loop may call (module docstring)."""

    in_flight: Any

    def start(self, step: int, version: int) -> None: ...

    def next_batch(self, step: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch: ...

    def weights_changed(self, step: int, version: int, timer: StageTimer) -> None: ...


def build_batch_source(rollout: LocalRollout | PoolRollout, *, staleness: int, stream: bool,
                       dynamic: DynamicSampling | None, total_steps: int, **parts: Any) -> BatchSource:
    """The source for the run's settings (``plan()`` has checked they go together); ``parts``: the
    ``actor``, ``prompts``, ``scorer`` and ``layout`` every source takes."""
    if staleness > 0:
        kind = StreamedGroups if stream else RoundsAhead
        return kind(rollout, staleness=staleness, total_steps=total_steps, **parts)
    rounds = SyncRounds(rollout, **parts)
    return FilteredRounds(rounds, dynamic) if dynamic is not None else rounds


__all__ = ["ActorLayout", "BatchSource", "Episodes", "FilteredRounds", "GroupsInFlight", "InFlight", "LocalRollout", "PoolRollout",
           "Rows", "RoundsAhead", "Scorer", "StepPrompts", "StreamedGroups", "SyncRounds", "build_batch_source"]
