"""Asynchronous batch sources (``trainer.max_staleness`` S > 0, a rollout pool): the rollout pool
generates ahead while the actor trains, and a step trains on rows at most S policy versions old.

    source = RoundsAhead(rollout, staleness=S, total_steps=T, ...)     # whole rounds, S + 1 in flight
    source = StreamedGroups(rollout, staleness=S, total_steps=T, ...)  # rollout.stream: groups as they end
    source.start(step, version)                     # the weights out, then the pipeline filled
    batch = source.next_batch(step, acc, timer)     # wait_rollout, reward
    source.weights_changed(step, version, timer)    # wait_weights, then more work issued

**Rounds**: a round is one step's ``data.train_batch_size`` prompts; S + 1 rounds are in flight and
step t trains on round t, generated with weights at most S versions old (:class:`InFlight`).
**Streamed groups** (``rollout.stream``): the controller keeps (S + 1) x ``data.train_batch_size``
prompts issued; the rollout pool sends each group (the ``n`` responses of a prompt) as it completes,
and a step takes the next complete groups, dropping and issuing again those more than S versions old
(:class:`GroupsInFlight`, :mod:`spmd_rl.rollout.pool_stream`). Either way a checkpoint holds what was
in flight (:attr:`in_flight`) and a resumed run issues it again, generated with the resumed weights.
Every token carries the policy version that sampled it (``batch["staleness"]``, ``async/*`` metrics).
Every actor rank runs the same calls in lockstep; only the controller (rank 0) sends prompts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from spmd_rl.data.batch import RolloutBatch
from spmd_rl.metrics import MetricAccumulator
from spmd_rl.rollout.pool_stream import GroupStream
from spmd_rl.source.rollout import PoolRollout, Rows
from spmd_rl.source.rounds import RoundSource
from spmd_rl.source.rows import staleness
from spmd_rl.step import StageTimer


class InFlight:
    """Rounds in flight: (step, prompt indices), oldest first. A checkpoint holds them; a resumed
    run generates them again (with the resumed weights)."""

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


class GroupsInFlight(InFlight):
    """``rollout.stream``: the prompts issued to the rollout pool and not trained on yet, by round
    (``round -> {position: prompt index}``). A checkpoint holds them in :class:`InFlight`'s format
    (a round with the prompts it has left)."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds: dict[int, dict[int, int]] = {}  # type: ignore[assignment]
        self.next_round = 1

    @property
    def outstanding(self) -> int:
        """Prompts issued and not trained on (complete, generating, or waiting to start)."""
        return sum(len(r) for r in self.rounds.values())

    def add(self, round_: int, indices: list[int]) -> None:
        self.rounds[round_] = dict(enumerate(indices))
        self.next_round = max(self.next_round, round_ + 1)

    def sample(self, round_: int, position: int) -> int:
        return self.rounds[round_][position]

    def take(self, groups: list[tuple[int, int]], dropped: list[tuple[int, int]],
             reissued: list[tuple[int, list[tuple[int, int]]]]) -> list[int]:
        """The prompt indices of a step's complete ``groups``, which leave the flight with the
        ``dropped`` (too stale) ones. ``reissued``: the rounds that issued the dropped groups' prompts
        again (new round, the dropped groups in its order), registered first: a group of theirs can
        complete, and be among ``groups``, in the same take."""
        for round_, keys in reissued:
            self.add(round_, [self.sample(*key) for key in keys])
        taken = [self.sample(*key) for key in groups]
        for round_, position in groups + dropped:
            del self.rounds[round_][position]
            if not self.rounds[round_]:
                del self.rounds[round_]
        return taken

    def state_dict(self) -> dict:
        return {"rounds": [[r, *left.values()] for r, left in sorted(self.rounds.items())]}


class AheadSource(RoundSource, ABC):
    """What both asynchronous sources share: the weights go out after each update (``wait_weights``:
    the pool loads them once it is done with the work issued before), then more work is issued."""

    rollout: PoolRollout

    def __init__(self, rollout: PoolRollout, *, staleness: int, total_steps: int, **parts) -> None:
        super().__init__(rollout, **parts)
        self.staleness, self.total_steps = staleness, total_steps
        self.batch_size = self.prompts.sampler.batch_size  # data.train_batch_size

    def start(self, step: int, version: int) -> None:
        self.version = version
        self.rollout.sync(self.actor, version)
        self.refill(step)

    def weights_changed(self, step: int, version: int, timer: StageTimer) -> None:
        self.version = version
        with timer("wait_weights"):
            self.rollout.sync(self.actor, version)
        self.refill(step)

    @abstractmethod
    def refill(self, step: int) -> None:
        """Issue the work that keeps the pipeline full after ``step``."""

    def rows_batch(self, rows: Rows, acc: MetricAccumulator) -> RolloutBatch:
        """The rows as a batch with their staleness against the weights this step updates."""
        batch = self.batch_of(rows, acc)
        staleness(batch, rows.out, version=self.version, max_staleness=self.staleness,
                  weight=self.layout.place.sum_weight, acc=acc)
        return batch


class RoundsAhead(AheadSource):
    """Whole rounds, S + 1 in flight; step t trains on round t."""

    def __init__(self, rollout: PoolRollout, **parts) -> None:
        super().__init__(rollout, **parts)
        self.in_flight = InFlight()

    def start(self, step: int, version: int) -> None:
        """What a checkpoint held first (generated again with the resumed weights), then new rounds."""
        self.version = version
        self.rollout.sync(self.actor, version)
        restored = self.in_flight.reissue()
        self.in_flight.next_step = restored[0][0] if restored else step + 1
        for k, indices in restored:
            self.issue(k, indices)
        self.refill(step)

    def refill(self, step: int) -> None:
        """Keep S + 1 rounds in flight after ``step``, no more than the remaining steps need."""
        while self.in_flight.next_step <= min(step + self.staleness + 1, self.total_steps):
            self.issue(self.in_flight.next_step, self.prompts.draw())

    def issue(self, step: int, indices: list[int]) -> None:
        self.in_flight.add(step, indices)
        self.rollout.issue(self.prompts.ids, indices, self.prompts.sampling(step))

    def next_batch(self, step: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        with timer("wait_rollout"):
            round_step, indices = self.in_flight.pop()
            if round_step != step:
                raise RuntimeError(f"asynchronous rounds out of order: step {step} took round {round_step}")
            span, out = self.rollout.link.take()
            rows = Rows(indices, span, out, weight=None, actor_layout=True)
            batch = self.rows_batch(rows, acc)
            acc.add_max("async/queue_depth", float(self.rollout.link.in_flight))
            acc.add_max("async/rollout_busy_s", out["gen_seconds"].max().item() if len(out["gen_seconds"]) else 0.0)
        return self.finish(rows, batch, acc, timer)


class StreamedGroups(AheadSource):
    """``rollout.stream``: a step trains on the next ``data.train_batch_size`` complete groups."""

    def __init__(self, rollout: PoolRollout, **parts) -> None:
        super().__init__(rollout, **parts)
        self.in_flight = GroupsInFlight()
        self.stream = GroupStream(rollout.link, pad_token_id=self.layout.pad_token_id)

    def refill(self, step: int) -> None:
        """Issue again what a checkpoint held, then rounds while (S + 1) rounds' prompts are not issued,
        no more than the remaining steps need."""
        for round_, indices in self.in_flight.reissue():
            self.issue(round_, indices)
        need = (self.total_steps - step) * self.batch_size
        limit = (self.staleness + 1) * self.batch_size
        while self.in_flight.outstanding + self.batch_size <= limit and self.in_flight.outstanding < need:
            self.issue(self.in_flight.next_round, self.prompts.draw())

    def issue(self, round_: int, indices: list[int]) -> None:
        """Add a round of prompts to the pool's stream."""
        self.in_flight.add(round_, indices)
        prompts = self.prompts
        self.stream.issue([prompts.ids[i] for i in indices] if prompts.is_controller else None,
                          prompts.sampling(round_), round_=round_, num_prompts=len(indices))

    def next_batch(self, step: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        with timer("wait_rollout"):
            got = self.stream.take(count=self.batch_size, policy_version=self.version, max_staleness=self.staleness,
                                   actor_group=self.layout.group)  # too stale: dropped and issued again
            indices = self.in_flight.take(got.groups, got.dropped, got.reissued)
            rows = Rows(indices, got.rows, got.tensors, weight=None, actor_layout=True)
            batch = self.rows_batch(rows, acc)
            acc.add_max("async/queue_depth", float(got.queue_depth))
            acc.add_max("async/dropped_groups", float(len(got.dropped)))
            acc.add_max("async/rollout_busy_s", got.rollout_busy_s)
        return self.finish(rows, batch, acc, timer)


__all__ = ["GroupsInFlight", "InFlight", "RoundsAhead", "StreamedGroups"]
