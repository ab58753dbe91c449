"""Synchronous batch sources: each step's prompts generated with the newest weights.

    source = SyncRounds(rollout, actor=actor, prompts=prompts, scorer=scorer, layout=layout)
    batch = source.next_batch(step, acc, timer)      # weight_sync, gen, reward, relayout
    source = FilteredRounds(source, DynamicSampling(...))   # DAPO: more rounds until enough groups differ

:class:`SyncRounds` serves the colocated rollout and a rollout pool at ``trainer.max_staleness`` 0
alike (:mod:`spmd_rl.source.rollout` hides which). Stages, each under the step's timer:
``weight_sync`` (the rollout gets the actor's weights if it holds an older version), ``gen`` (rank
0 draws the prompts, the rollout generates ``rollout.n`` responses each), ``reward`` (each rank
scores the rows it holds) and ``relayout`` (colocated rows move from the rollout's layout to the
actor's data-parallel layout; a pool's rows arrive in it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from spmd_rl.algo.filtering import DynamicSampling
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.comm import relayout
from spmd_rl.metrics import MetricAccumulator
from spmd_rl.source.rollout import Rows
from spmd_rl.source.rows import Scorer, StepPrompts, row_weight, to_batch
from spmd_rl.step import Placement, StageTimer


@dataclass(frozen=True)
class ActorLayout:
    """Where rows must end: this rank's placement, its rank in the actor's pool and the pool's size
    and group, and the pad id (for a relayout)."""

    place: Placement
    rank: int
    size: int
    group: dist.ProcessGroup | None
    pad_token_id: int


class RoundSource:
    """What every batch source shares: the rollout, the prompts, the scorer and the actor's layout;
    ``version`` is the policy version the actor's weights are."""

    in_flight: Any = None
    """What a checkpoint saves of the rounds in flight (None: nothing is ever in flight)."""

    def __init__(self, rollout: Any, *, actor: Any, prompts: StepPrompts, scorer: Scorer,
                 layout: ActorLayout) -> None:
        self.rollout, self.actor, self.prompts, self.scorer, self.layout = rollout, actor, prompts, scorer, layout
        self.version = 0

    def start(self, step: int, version: int) -> None:
        """Before the first step (and after a resume at ``step``, weights at ``version``)."""
        self.version = version

    def weights_changed(self, step: int, version: int, timer: StageTimer) -> None:
        """``step``'s update made the actor's weights ``version``."""
        self.version = version

    def batch_of(self, rows: Rows, acc: MetricAccumulator) -> RolloutBatch:
        """The rows as a batch, with the response metrics."""
        return to_batch(rows, self.prompts.ids, place=self.layout.place, n=self.prompts.rollout.n, acc=acc)

    def finish(self, rows: Rows, batch: RolloutBatch, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        """Score the rows where they are, then move them to the actor's data-parallel layout."""
        lay = self.layout
        with timer("reward"):
            self.scorer(batch, acc, weight=row_weight(rows, lay.place))
        if rows.actor_layout:
            return batch
        with timer("relayout"):
            return relayout(batch, src=lay.place.rollout_source(lay.rank, lay.size),
                            dst=(lay.place.actor_dp, lay.place.actor_dp_size), group=lay.group,
                            pad_token_id=lay.pad_token_id)


class SyncRounds(RoundSource):
    """Each step: the newest weights to the rollout, a draw of prompts, their responses, scored."""

    def next_batch(self, step: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        return self.round(step, 0, acc, timer)

    def round(self, step: int, round_: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        """Round ``round_`` of ``step``'s prompts (> 0: DAPO's extra rounds), scored, in the actor's layout."""
        with timer("weight_sync"):  # after round 0 a no-op unless the rollout dropped its weights (level 2)
            self.rollout.sync(self.actor, self.version)
        with timer("gen"):
            rows = self.rollout.generate(self.prompts.draw(), self.prompts.ids, self.prompts.sampling(step, round_))
            batch = self.batch_of(rows, acc)
        return self.finish(rows, batch, acc, timer)


class FilteredRounds:
    """DAPO's dynamic sampling (``algo.filter_groups``) over synchronous rounds: rounds of prompts
    until the step holds ``data.train_batch_size`` groups whose scores differ
    (:class:`~spmd_rl.algo.filtering.DynamicSampling` decides, the same on every rank)."""

    in_flight = None

    def __init__(self, rounds: SyncRounds, sampling: DynamicSampling) -> None:
        self.rounds, self.sampling = rounds, sampling

    def start(self, step: int, version: int) -> None:
        self.rounds.start(step, version)

    def weights_changed(self, step: int, version: int, timer: StageTimer) -> None:
        self.rounds.weights_changed(step, version, timer)

    def next_batch(self, step: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        chosen = self.sampling.begin()
        batch = self.rounds.round(step, 0, acc, timer)
        while not chosen.add(batch):
            batch = self.rounds.round(step, chosen.rounds, acc, timer)
        return chosen.finish(acc)


__all__ = ["ActorLayout", "FilteredRounds", "RoundSource", "SyncRounds"]
