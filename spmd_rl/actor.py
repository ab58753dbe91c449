"""The actor's update, the stage ``update`` of a step (as :mod:`spmd_rl.critic` holds the critic's).

    update = ActorUpdate(engine, cfg=cfg, mini_batches=4, sum_weight=place.sum_weight, group=group,
                         device=env.device, temperature=1.0, logs_rollout_gap=True)
    update(batch, acc)      # actor.ppo_epochs x mini_batches optimizer steps; their metrics into acc

Each mini-batch's loss is normalised by the global token and sequence counts of the data-parallel
mini-batch (:func:`global_counts`), so that summed over its micro-batches and the ranks it is the
global mean whatever the layout. Where no old-log-prob forward ran (one optimizer step per batch,
see :meth:`spmd_rl.trainer.Trainer.need_old_logprobs`) the update's own log-probs, detached, are the
old ones, and with ``logs_rollout_gap`` the update compares them with the rollout's itself
(:func:`log_rollout_gap`: ``rollout/logprob_abs_diff``, ``async/logprob_abs_diff_fresh``). The loss
metrics stay device tensors until the mini-batch ends and are then read in one device-to-host copy (no
sync per micro-batch).

Rollout correction (:func:`spmd_rl.algo.rollout_correction`, ``algo.rollout_is*`` / ``algo.rollout_rs*``):
the ``rollout_corr/*`` diagnostics are logged every step whose rows carry the rollout's log-probs, global
over the actor's ranks. Where old log-probs exist before the update, the importance weights and the
rejection mask are computed once for the step's whole batch (batch normalisation global); rejected
tokens leave the loss and its token counts. ``algo.rollout_rs`` and ``algo.rollout_is_batch_normalize``
need the old log-probs before the first micro-batch: without an old-log-prob forward the update runs
one itself. Otherwise (one optimizer step, weights only) each micro-batch weights its tokens from the
update's own log-probs, and the diagnostics are computed from them after the mini-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.algo.correction import NoValidToken, rollout_correction
from spmd_rl.algo.objective import actor_objective
from spmd_rl.config import Config
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.engine import LossFn, TrainEngine
from spmd_rl.metrics import MetricAccumulator

# metrics that are a rank's part of a global mean (summed over ranks), not a mean over its own tokens
GLOBAL_PARTS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/distill_kl")
Pending = list[tuple[str, torch.Tensor, "torch.Tensor | None"]]  # (metric, value, tokens or None: a global part)


def global_counts(mini: RolloutBatch, *, sum_weight: float, group: dist.ProcessGroup | None) -> tuple[float, float]:
    """The response tokens and rows of the data-parallel mini-batch ``mini`` is this rank's part of
    (``sum_weight``: what this rank's rows count, 0 where another rank holds the same rows); tokens rejected
    by the rollout correction (``loss_mask``) are not counted."""
    mask = mini["loss_mask"] if "loss_mask" in mini else mini["response_mask"]  # after rejection (algo.rollout_rs)
    counts = torch.tensor([mask.sum().item(), float(len(mini))], dtype=torch.float64) * sum_weight
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    tokens, rows = counts.tolist()
    return tokens, rows


def rollout_gap(logprobs: torch.Tensor, batch: RolloutBatch) -> Pending:
    """``(metric, token mean, tokens)`` device tensors of the gap between ``logprobs`` (the trainer's,
    ``[B, T]``, of ``batch``'s rows) and the rollout's: ``rollout/logprob_abs_diff`` over the response
    tokens and, for a batch with per-token ``staleness``, ``async/logprob_abs_diff_fresh`` over the
    tokens the current weights sampled (only numerical mismatch, as on-policy)."""
    device = logprobs.device
    mask = batch["response_mask"].to(device)
    gap = (logprobs.detach() - batch["rollout_logprobs"].to(device)).abs() * mask
    tokens = mask.sum()
    out: Pending = [("rollout/logprob_abs_diff", gap.sum() / tokens.clamp(min=1), tokens)]
    if "staleness" in batch:
        fresh = (batch["staleness"].to(device) == 0).to(mask.dtype) * mask  # (a concat pads with 0)
        out.append(("async/logprob_abs_diff_fresh", (gap * fresh).sum() / fresh.sum().clamp(min=1), fresh.sum()))
    return out


def log_rollout_gap(acc: MetricAccumulator, logprobs: torch.Tensor, batch: RolloutBatch) -> None:
    """Add :func:`rollout_gap`'s metrics to ``acc`` as token-weighted means (one device-to-host copy);
    what the trainer calls after its old-log-prob forward, and the update where none ran."""
    pending = rollout_gap(logprobs, batch)
    pairs = torch.stack([torch.stack([v, t]).double() for _, v, t in pending]).tolist()
    for (key, _, _), (value, tokens) in zip(pending, pairs):
        if tokens > 0:
            acc.add(key, value, tokens)


class ActorUpdate:
    """``actor.ppo_epochs`` passes over ``mini_batches`` mini-batches of a step's rows (module docstring);
    collective over ``group`` (the actor's pool)."""

    def __init__(self, engine: TrainEngine, *, cfg: Config, mini_batches: int, sum_weight: float,
                 group: dist.ProcessGroup | None, device: torch.device, temperature: float,
                 logs_rollout_gap: bool) -> None:
        self.engine, self.cfg, self.mini_batches = engine, cfg, mini_batches
        self.updates = mini_batches * cfg.actor.ppo_epochs  # optimizer steps per batch
        self.sum_weight, self.group, self.device = sum_weight, group, device
        self.temperature, self.logs_rollout_gap = temperature, logs_rollout_gap

    def __call__(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        cfg = self.cfg
        stash = None if self._correct_step(batch, acc) else self._stash_for(batch)
        try:
            for _epoch in range(cfg.actor.ppo_epochs):
                for mini in batch.chunks(self.mini_batches):
                    self._mini_batch(mini, acc, stash)
                    stash = self._log_stash(stash, acc)
        finally:
            for key in ("loss_mask", "is_weights"):  # the step's correction, for this update only
                batch.tensors.pop(key, None)

    def _mini_batch(self, mini: RolloutBatch, acc: MetricAccumulator, stash: list | None) -> None:
        """One optimizer step over ``mini``; its metrics into ``acc``."""
        cfg = self.cfg
        global_tokens, global_seqs = global_counts(mini, sum_weight=self.sum_weight, group=self.group)
        global_tokens = max(global_tokens, 1.0)  # every token rejected (algo.rollout_rs): the loss is 0, not 0 / 0
        pending: Pending = []
        stats = self.engine.train_mini_batch(
            self.engine.micro_batches(mini, micro_batch_size=cfg.actor.micro_batch_size),
            self._loss_fn(global_tokens, global_seqs, pending, stash), temperature=self.temperature,
            need_entropy_grad=cfg.algo.entropy_coef > 0)
        self._read(pending, acc)
        # grad_norm and lr are identical on every rank; weight 1 per rank keeps the mean exact.
        skipped = stats.get("skipped", 0.0)  # a non-finite update the engine was allowed to skip
        if not skipped:
            acc.add("actor/grad_norm", stats["grad_norm"])
        acc.add("actor/skipped_updates", skipped * self.updates)  # mean x count = count
        acc.add("actor/lr", stats["lr"])
        if "moe_aux_loss" in stats:  # an MoE actor's router load-balancing loss (this rank's mean)
            acc.add("actor/moe_aux_loss", stats["moe_aux_loss"])

    # ------------------------------------------------------------------ rollout correction
    def _correct_step(self, batch: RolloutBatch, acc: MetricAccumulator) -> bool:
        """The step-level rollout correction where old log-probs exist (or are needed: a forward here
        when no old-log-prob pass ran): ``is_weights`` and ``loss_mask`` into ``batch``, the metrics into
        ``acc``. False where it is left to the micro-batches (no old log-probs, none needed)."""
        algo = self.cfg.algo
        if "rollout_logprobs" not in batch:
            return False
        if "old_logprobs" not in batch:
            if algo.rollout_rs is None and not (algo.rollout_is != "none" and algo.rollout_is_batch_normalize):
                return False
            logprobs, _ = self.engine.compute_logprobs(batch, temperature=self.temperature,
                                                       micro_batch_size=self.cfg.actor.micro_batch_size)
            batch["old_logprobs"] = logprobs.cpu()
            if self.logs_rollout_gap:
                log_rollout_gap(acc, logprobs, batch)
        weights, mask = self._correction(batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"], acc)
        if weights is not None:
            batch["is_weights"] = weights
        if algo.rollout_rs is not None:
            batch["loss_mask"] = mask
        return True

    def _correction(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, acc: MetricAccumulator,
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """:func:`rollout_correction` over the actor's ranks with the config's settings; its metrics
        (global, the same on every rank) into ``acc``."""
        algo, home = self.cfg.algo, mask.device
        old, rollout, mask = old.to(self.device), rollout.to(self.device), mask.to(self.device)  # the device's speed
        try:
            weights, new_mask, metrics = rollout_correction(
                old, rollout, mask, is_level=algo.rollout_is_level,
                is_threshold=algo.rollout_is_threshold, is_batch_normalize=algo.rollout_is_batch_normalize,
                rs=algo.rollout_rs, rs_threshold=algo.rollout_rs_threshold, group=self.group,
                sum_weight=self.sum_weight)
        except NoValidToken:  # nothing to weigh or reject (every row empty on every rank)
            return None, mask.to(home)
        for key, value in metrics.items():
            acc.add(key, value)
        return (None if weights is None else weights.to(home)), new_mask.to(home)

    def _stash_for(self, batch: RolloutBatch) -> list | None:
        """Where the micro-batches' own log-probs will serve as the old ones (one optimizer step per
        batch), a list that collects them for the step's diagnostics; else None."""
        if "rollout_logprobs" not in batch or "old_logprobs" in batch or self.updates != 1:
            return None
        return []

    def _log_stash(self, stash: list | None, acc: MetricAccumulator) -> None:
        """The diagnostics of the log-probs the mini-batch's micro-batches stashed (see ``_stash_for``)."""
        if stash is None:
            return None
        width = max([t.shape[1] for t, _, _ in stash], default=1)
        old, rollout, mask = (torch.cat([torch.nn.functional.pad(parts[i], (0, width - parts[i].shape[1]))
                                         for parts in stash]) if stash else torch.zeros(0, width)
                              for i in range(3))
        self._correction(old, rollout, mask, acc)
        return None

    def _loss_fn(self, global_tokens: float, global_seqs: float, pending: Pending, stash: list | None) -> LossFn:
        """The actor objective of a micro-batch over the mini-batch's global counts; its metrics go to
        ``pending`` as device tensors (and its own log-probs, as the old ones, to ``stash``)."""
        cfg, device = self.cfg, self.device

        def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: RolloutBatch):
            response_mask = micro["response_mask"].to(device)
            mask = micro["loss_mask"].to(device) if "loss_mask" in micro else response_mask  # rejected tokens out
            old = micro["old_logprobs"].to(device) if "old_logprobs" in micro else logprobs.detach()
            ref = micro["ref_logprobs"].to(device) if "ref_logprobs" in micro else None
            sampled = micro["rollout_logprobs"].to(device) if cfg.algo.rollout_is != "none" else None
            teacher = micro["teacher_logprobs"].to(device) if "teacher_logprobs" in micro else None
            weights = micro["is_weights"].to(device) if "is_weights" in micro else None
            loss, metrics = actor_objective(
                logprobs, entropy, old_logprobs=old, advantages=micro["advantages"].to(device),
                response_mask=mask, ref_logprobs=ref, algo=cfg.algo, global_tokens=global_tokens,
                global_seqs=global_seqs, rollout_logprobs=sampled, teacher_logprobs=teacher, is_weights=weights)
            tokens = mask.sum()
            if "old_logprobs" not in micro:  # no old-log-prob forward ran: the update's own are the old ones
                if self.logs_rollout_gap:
                    pending.extend(rollout_gap(old, micro))
                if stash is not None:
                    stash.append((old, micro["rollout_logprobs"].to(device), response_mask))
            for key, value in metrics.items():
                pending.append((key, value.detach(), None if key in GLOBAL_PARTS else tokens))
            return loss, metrics

        return loss_fn

    def _read(self, pending: Pending, acc: MetricAccumulator) -> None:
        """A mini-batch's metrics in one device-to-host copy: global parts summed, the others token means."""
        if not pending:
            return
        pairs = torch.stack([torch.stack([v, v if t is None else t]).float().reshape(2) for _, v, t in pending]).tolist()
        for (key, _, tokens), (value, weight) in zip(pending, pairs):
            if tokens is None:  # a global part
                acc.add_sum(key, value * self.sum_weight / self.updates)
            elif weight > 0:  # (a micro-batch without such tokens adds nothing)
                acc.add(key, value, weight)


__all__ = ["ActorUpdate", "global_counts", "log_rollout_gap", "rollout_gap"]
