"""The actor's update, the stage ``update`` of a step (as :mod:`spmd_rl.critic` holds the critic's).

    update = ActorUpdate(engine, cfg=cfg, mini_batches=4, sum_weight=place.sum_weight, group=group,
                         device=env.device, temperature=1.0, logs_rollout_gap=True)
    update(batch, acc)      # actor.ppo_epochs x mini_batches optimizer steps; their metrics into acc

Each mini-batch's loss is normalised by the global token and sequence counts of the data-parallel
mini-batch (:func:`global_counts`), so that summed over its micro-batches and the ranks it is the
global mean whatever the layout. Where no old-log-prob forward ran (one optimizer step per batch,
see :meth:`spmd_rl.trainer.Trainer.need_old_logprobs`) the update's own log-probs, detached, are the
old ones, and with ``logs_rollout_gap`` the update compares them with the rollout's itself
(``rollout/logprob_abs_diff``, ``async/logprob_abs_diff_fresh``). The loss metrics stay device
tensors until the mini-batch ends and are then read in one device-to-host copy (no sync per
micro-batch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    (``sum_weight``: what this rank's rows count, 0 where another rank holds the same rows)."""
    counts = torch.tensor([mini["response_mask"].sum().item(), float(len(mini))], dtype=torch.float64) * sum_weight
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    tokens, rows = counts.tolist()
    return tokens, rows


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
        for _epoch in range(cfg.actor.ppo_epochs):
            for mini in batch.chunks(self.mini_batches):
                global_tokens, global_seqs = global_counts(mini, sum_weight=self.sum_weight, group=self.group)
                pending: Pending = []
                stats = self.engine.train_mini_batch(
                    self.engine.micro_batches(mini, micro_batch_size=cfg.actor.micro_batch_size),
                    self._loss_fn(global_tokens, global_seqs, pending), temperature=self.temperature,
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

    def _loss_fn(self, global_tokens: float, global_seqs: float, pending: Pending) -> LossFn:
        """The actor objective of a micro-batch over the mini-batch's global counts; its metrics go to
        ``pending`` as device tensors."""
        cfg, device = self.cfg, self.device

        def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: RolloutBatch):
            mask = micro["response_mask"].to(device)
            old = micro["old_logprobs"].to(device) if "old_logprobs" in micro else logprobs.detach()
            ref = micro["ref_logprobs"].to(device) if "ref_logprobs" in micro else None
            sampled = micro["rollout_logprobs"].to(device) if cfg.algo.rollout_is != "none" else None
            teacher = micro["teacher_logprobs"].to(device) if "teacher_logprobs" in micro else None
            loss, metrics = actor_objective(
                logprobs, entropy, old_logprobs=old, advantages=micro["advantages"].to(device),
                response_mask=mask, ref_logprobs=ref, algo=cfg.algo, global_tokens=global_tokens,
                global_seqs=global_seqs, rollout_logprobs=sampled, teacher_logprobs=teacher)
            tokens = mask.sum()
            if "old_logprobs" not in micro and self.logs_rollout_gap:  # no old-log-prob forward ran
                gap = (old - micro["rollout_logprobs"].to(device)).abs() * mask
                pending.append(("rollout/logprob_abs_diff", gap.sum() / tokens.clamp(min=1), tokens))
                if "staleness" in micro:  # tokens the current weights sampled
                    fresh = (micro["staleness"].to(device) == 0).float() * mask
                    pending.append(("async/logprob_abs_diff_fresh", (gap * fresh).sum() / fresh.sum().clamp(min=1),
                                    fresh.sum()))
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


__all__ = ["ActorUpdate", "global_counts"]
