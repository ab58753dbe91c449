"""DAPO's dynamic sampling (``algo.filter_groups``): rounds of prompts until a step holds
``data.train_batch_size`` groups whose scores differ.

    sampling = DynamicSampling(train_batch_size=8, n=4, max_rounds=10, group=pool_group,
                               actor_dp=dp, actor_dp_size=dp_size, pad_token_id=pad)
    chosen = sampling.begin()                  # one step's choice
    while not chosen.add(round_batch):         # a round, scored, in the actor's layout
        round_batch = ...                      # the caller generates round chosen.rounds
    batch = chosen.finish(acc)                 # the step's batch

A group whose ``rollout.n`` scores are all equal has zero advantage under every group estimator,
so it adds nothing to the policy gradient (it only dilutes token-mean normalisation). Each round
is a whole step's worth of prompts (``data.train_batch_size``), generated, scored and already in
the actor's data-parallel layout. After each round every rank gathers the round's scores (one
small object gather over the pool), so every rank computes the same flags and the same decision:
the loop is lockstep by construction, with no rank-local branch. Informative groups are kept in
round order (then prompt order within a round); once at least ``train_batch_size`` are kept the
first ``train_batch_size`` form the step's batch, as verl's DAPO trims its concatenated batch.
A step still short after ``max_rounds`` rounds raises on every rank, as verl's DAPO does ("check if
your data are too difficult"); ``max_rounds=0`` never stops.

The kept rows are then gathered once and re-laid: each actor data-parallel rank takes its
contiguous ``train_batch_size * n / dp size`` rows, whole groups, with ``group_index`` renumbered
0..train_batch_size-1 in that order, exactly the shape an unfiltered step has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.comm import all_gather_objects


def informative(scores: Sequence[float], groups: Sequence[int]) -> dict[int, bool]:
    """Per group id: whether its scores are not all equal (verl keeps a group when its std > 0)."""
    seen: dict[int, tuple[float, float]] = {}
    for s, g in zip(scores, groups):
        lo, hi = seen.get(g, (s, s))
        seen[g] = (min(lo, s), max(hi, s))
    return {g: hi > lo for g, (lo, hi) in seen.items()}


def select(flags_by_round: Sequence[dict[int, bool]], need: int) -> list[tuple[int, int]]:
    """The first ``need`` informative (round, group) pairs in round order, then group order."""
    out: list[tuple[int, int]] = []
    for r, flags in enumerate(flags_by_round):
        for g in sorted(flags):
            if flags[g] and len(out) < need:
                out.append((r, g))
    return out


class DynamicSampling:
    """The rounds of one step under ``algo.filter_groups`` on the actor's pool (see the module doc)."""

    def __init__(self, *, train_batch_size: int, n: int, max_rounds: int, group: dist.ProcessGroup | None,
                 actor_dp: int, actor_dp_size: int, pad_token_id: int) -> None:
        self.need, self.n, self.max_rounds = train_batch_size, n, max_rounds
        self.group, self.dp, self.dp_size, self.pad = group, actor_dp, actor_dp_size, pad_token_id

    def round_flags(self, batch: RolloutBatch) -> dict[int, bool]:
        """The informative flag of every group of a round, the same on every rank: the rows' scores
        by group, gathered over the pool (ranks of one dp group hold the same rows: counted once)."""
        parts = all_gather_objects((self.dp, batch["group_index"].tolist(), batch["scores"].tolist()), self.group)
        scores: list[float] = []
        groups: list[int] = []
        seen: set[int] = set()
        for dp, g, s in parts:
            if dp not in seen:
                seen.add(dp)
                groups += g
                scores += s
        return informative(scores, groups)

    def begin(self) -> ChosenGroups:
        """A step's choice, fed round by round."""
        return ChosenGroups(self)

    def assemble(self, kept: list[tuple[list[tuple[int, int]], RolloutBatch]]) -> RolloutBatch:
        """This rank's share of the selected groups: every rank's kept rows gathered, ordered by (round,
        group) (rows of a group keep their order), cut into equal contiguous shares by actor dp rank."""
        keys = [k for ks, _ in kept for k in ks]
        mine = RolloutBatch.concat([b for _, b in kept], self.pad)
        parts = all_gather_objects((self.dp, keys, mine), self.group)
        by_dp: dict[int, tuple[list[tuple[int, int]], RolloutBatch]] = {}
        for dp, k, b in parts:
            by_dp.setdefault(dp, (k, b))  # ranks of one dp group hold the same rows
        all_keys = [k for dp in sorted(by_dp) for k in by_dp[dp][0]]
        full = RolloutBatch.concat([by_dp[dp][1] for dp in sorted(by_dp)], self.pad)
        if len(full) != self.need * self.n:
            raise RuntimeError(f"dynamic sampling kept {len(full)} rows, expected data.train_batch_size "
                               f"({self.need}) * rollout.n ({self.n})")
        order = sorted(range(len(full)), key=lambda i: all_keys[i])  # stable: a group's rows keep their order
        groups = {key: pos for pos, key in enumerate(sorted(set(all_keys)))}
        full = full.select(order)
        full["group_index"] = torch.tensor([groups[all_keys[i]] for i in order], dtype=torch.long)
        size = len(full) // self.dp_size
        return full.select(range(self.dp * size, (self.dp + 1) * size))


class ChosenGroups:
    """One step's rounds under ``algo.filter_groups``: :meth:`add` each round until it says the
    step holds enough informative groups, then :meth:`finish`. Every rank adds the same rounds and
    gets the same answers (the flags are gathered over the pool)."""

    def __init__(self, sampling: DynamicSampling) -> None:
        self.sampling = sampling
        self.flags: list[dict[int, bool]] = []
        self.kept: list[tuple[list[tuple[int, int]], RolloutBatch]] = []  # (row keys (round, group), rows) per round

    @property
    def rounds(self) -> int:
        """Rounds added so far (the number of the next one)."""
        return len(self.flags)

    def add(self, batch: RolloutBatch) -> bool:
        """Round :attr:`rounds`, scored and in the actor's layout: keep its informative groups; whether
        the step holds ``data.train_batch_size`` of them. Raises once ``algo.max_sample_rounds`` rounds
        (0 = no limit) were not enough."""
        s, r = self.sampling, len(self.flags)
        self.flags.append(s.round_flags(batch))
        chosen = set(select(self.flags, s.need))
        rows = [i for i, g in enumerate(batch["group_index"].tolist()) if (r, g) in chosen]
        self.kept.append(([(r, int(batch["group_index"][i])) for i in rows], batch.select(rows)))
        if len(chosen) >= s.need:
            return True
        if s.max_rounds and r + 1 >= s.max_rounds:
            raise ValueError(
                f"algo.filter_groups: {len(chosen)} of data.train_batch_size={s.need} groups with differing "
                f"scores after algo.max_sample_rounds={s.max_rounds} rounds ({self.dropped} groups had all "
                f"rollout.n={s.n} scores equal): the prompts are too easy or too hard for the policy; raise "
                f"--algo.max-sample-rounds (0 = no limit) or train without --algo.filter-groups")
        return False

    @property
    def dropped(self) -> int:
        """Groups generated and not informative, over the rounds so far."""
        return sum(not f for flags in self.flags for f in flags.values())

    def finish(self, acc) -> RolloutBatch:
        """This rank's rows of the step's batch; logs ``batch/sample_rounds`` and ``batch/filtered_groups``
        (groups dropped over all rounds: generated minus informative)."""
        acc.add("batch/sample_rounds", float(len(self.flags)))  # the same on every rank: the mean is the value
        acc.add("batch/filtered_groups", float(self.dropped))
        return self.sampling.assemble(self.kept)


__all__ = ["ChosenGroups", "DynamicSampling", "informative", "select"]
