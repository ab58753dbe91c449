"""Asynchronous GRPO's schedule (``trainer.max_staleness`` S > 0, on a rollout pool): what is in flight
between the pools, and when it goes out and comes back.

    schedule = AsyncSchedule(link, staleness=S, stream=cfg.rollout.stream, ...)
    schedule.start(step)                         # after the first weight sync (and after a resume)
    taken = schedule.take(step, policy_version)  # the step's rows, this rank's share
    ...                                          # the update, then the new weights to the pool
    schedule.refill(step)                        # more work for the rollout pool

Two ways, one interface. **Rounds** (the default): a round is one step's ``data.train_batch_size``
prompts; S + 1 rounds are in flight and step t trains on round t, generated with weights at most S
versions old (:class:`~spmd_rl.step.InFlight`). **Streamed groups** (``rollout.stream``): the
controller keeps (S + 1) x ``data.train_batch_size`` prompts issued, the rollout pool sends each
group (the n responses of a prompt) as it completes, and a step takes the next complete groups,
dropping and issuing again those more than S versions old
(:class:`~spmd_rl.step.GroupsInFlight`, :mod:`spmd_rl.rollout.pool_stream`). Either way a checkpoint
holds what was in flight (:attr:`AsyncSchedule.in_flight`), and a resumed run issues it again. The
trainer turns what :meth:`AsyncSchedule.take` returns into its batch and its staleness metrics.

Every actor rank runs the same calls in lockstep; only the controller (rank 0) draws prompts and
sends commands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from spmd_rl.rollout.pool import RolloutLink
from spmd_rl.rollout.pool_stream import issue_stream, take_groups
from spmd_rl.step import GroupsInFlight, InFlight


@dataclass
class Taken:
    """A step's rows from the rollout pool: the prompt index of each of the step's prompts, this rank's
    ``[start, end)`` of its rows (prompt-major, n per prompt), their tensors (with per-token
    ``versions``), and the queue's metrics (maxima over the step)."""

    indices: list[int]
    rows: tuple[int, int]
    out: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


class AsyncSchedule:
    """The actor pool's side of the pipeline to the rollout pool (module docstring): its
    :attr:`in_flight` is what a checkpoint saves."""

    def __init__(self, link: RolloutLink, *, group: dist.ProcessGroup | None, staleness: int, stream: bool,
                 total_steps: int, batch_size: int, pad_token_id: int, draw: Callable[[], list[int]],
                 prompts: Callable[[list[int]], list[list[int]] | None], sampling: Callable[[int], dict]) -> None:
        """``group``: the actor pool; ``draw()``: the next batch's prompt indices (collective over it);
        ``prompts(indices)``: their token ids on the controller, None elsewhere; ``sampling(k)``: round
        k's sampling settings."""
        self.link, self.group, self.staleness, self.stream = link, group, staleness, stream
        self.total_steps, self.batch_size, self.pad_token_id = total_steps, batch_size, pad_token_id
        self.draw, self.prompts, self.sampling = draw, prompts, sampling
        self.in_flight: InFlight | GroupsInFlight = GroupsInFlight() if stream else InFlight()

    def start(self, step: int) -> None:
        """Fill the pipeline after ``step``: what a checkpoint held first (generated again with the
        resumed weights), then new rounds up to S + 1."""
        if self.stream:
            self.refill(step)
            return
        restored = self.in_flight.reissue()
        self.in_flight.next_step = restored[0][0] if restored else step + 1
        for k, indices in restored:
            self._issue(k, indices)
        self.refill(step)

    def refill(self, step: int) -> None:
        """After ``step``'s weights went to the pool: issue what keeps S + 1 rounds (or that many
        rounds' prompts) in flight, no more than the remaining steps need."""
        if self.stream:
            for round_, indices in self.in_flight.reissue():
                self._issue_round(round_, indices)
            need = (self.total_steps - step) * self.batch_size
            limit = (self.staleness + 1) * self.batch_size
            while self.in_flight.outstanding + self.batch_size <= limit and self.in_flight.outstanding < need:
                self._issue_round(self.in_flight.next_round)
            return
        while self.in_flight.next_step <= min(step + self.staleness + 1, self.total_steps):
            self._issue(self.in_flight.next_step)

    def take(self, step: int, policy_version: int) -> Taken:
        """``step``'s rows: the oldest round in flight, or the next ``data.train_batch_size`` complete
        groups no more than S versions behind ``policy_version``."""
        if self.stream:
            got = take_groups(self.link, count=self.batch_size, policy_version=policy_version,
                              max_staleness=self.staleness, actor_group=self.group,
                              reissue=self._reissue)
            indices = self.in_flight.take(got.groups, got.dropped, got.reissued)
            return Taken(indices, got.rows, got.tensors, {"async/queue_depth": float(got.queue_depth),
                                                          "async/dropped_groups": float(len(got.dropped)),
                                                          "async/rollout_busy_s": got.rollout_busy_s})
        round_step, indices = self.in_flight.pop()
        assert round_step == step, (round_step, step)
        rows, out = self.link.take()
        busy = out["gen_seconds"].max().item() if len(out["gen_seconds"]) else 0.0
        return Taken(indices, rows, out, {"async/queue_depth": float(self.link.in_flight),
                                          "async/rollout_busy_s": busy})

    # ------------------------------------------------------------------ issuing
    def _issue(self, step: int, indices: list[int] | None = None) -> None:
        """Rounds: start generating ``step``'s batch (``indices``: a round a checkpoint held; else a draw)."""
        indices = self.draw() if indices is None else indices
        self.in_flight.add(step, indices)
        self.link.issue(self.prompts(indices), self.sampling(step), kind="train", num_prompts=len(indices),
                        pad_token_id=self.pad_token_id)

    def _issue_round(self, round_: int, indices: list[int] | None = None) -> None:
        """Streamed groups: add a round of prompts to the pool's stream."""
        indices = self.draw() if indices is None else indices
        self.in_flight.add(round_, indices)
        issue_stream(self.link, self.prompts(indices), self.sampling(round_), round_=round_,
                     num_prompts=len(indices), pad_token_id=self.pad_token_id)

    def _reissue(self, keys: list[tuple[int, int]]) -> tuple[int, list[int]]:
        """The controller, for groups dropped as too stale: their prompts again, as a new round."""
        assert isinstance(self.in_flight, GroupsInFlight)
        indices = [self.in_flight.sample(*key) for key in keys]
        round_ = self.in_flight.reserve()
        issue_stream(self.link, self.prompts(indices), self.sampling(round_), round_=round_,
                     num_prompts=len(indices), pad_token_id=self.pad_token_id)
        return round_, indices


__all__ = ["AsyncSchedule", "Taken"]
