"""The actor's training objective for one micro-batch: policy loss + KL loss - entropy bonus.

    loss, metrics = actor_objective(logprobs, entropy, old_logprobs=..., advantages=...,
                                    response_mask=..., ref_logprobs=..., algo=cfg.algo,
                                    global_tokens=G, global_seqs=S)

Every term is aggregated with the GLOBAL token / sequence counts of the data-parallel mini-batch,
so summing the returned losses over all micro-batches on all ranks gives the mini-batch objective
exactly; engines must therefore sum (not average) gradients across ranks.

With ``algo.rollout_is`` (``token`` / ``sequence``) each token's policy loss is multiplied by its
importance weight of the rollout / trainer gap (:mod:`spmd_rl.algo.correction`): the step's weights
``is_weights`` when the caller computed them over the whole batch (:class:`spmd_rl.actor.ActorUpdate`
does, for ``algo.rollout_is_batch_normalize`` and whenever old log-probs exist before the update), else
this micro-batch's own, which are the same numbers (a token's or a row's weight depends on its row
only). Tokens rejected by ``algo.rollout_rs`` are left out by the caller: ``response_mask`` is then the
mask after rejection. Logged per micro-batch as ``rollout/is_weight_mean`` (mean applied weight),
``rollout/is_clip_frac`` (share of tokens whose weight the threshold changed) and ``rollout/rollout_kl``
(mean rollout - old).
"""

from __future__ import annotations

import torch

from spmd_rl.algo import CRITIC_ESTIMATOR_NAMES, losses
from spmd_rl.algo.correction import importance_weights
from spmd_rl.algo import advantages as adv_lib
from spmd_rl.config import AlgoConfig

ADVANTAGE_ESTIMATORS = {
    "grpo": adv_lib.grpo,
    "rloo": adv_lib.rloo,
    "reinforce_pp_baseline": adv_lib.reinforce_pp_baseline,
}

CRITIC_ESTIMATORS = {name: getattr(adv_lib, name) for name in CRITIC_ESTIMATOR_NAMES}
"""Estimators of token-level advantages from a value model's values (the run trains a critic: spmd_rl.critic)."""

POLICY_LOSSES = {
    "ppo_clip": losses.ppo_clip,
    "gspo": losses.gspo,
    "cispo": losses.cispo,
}


def _is_weights(old: torch.Tensor, rollout: torch.Tensor | None, mask: torch.Tensor, algo: AlgoConfig,
                given: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The importance weights that multiply the policy loss, and their ``rollout/*`` token means."""
    if rollout is None:
        raise ValueError(f"algo.rollout_is={algo.rollout_is} needs the rollout engine's log-probs")
    if given is None and algo.rollout_is_batch_normalize:
        raise ValueError("algo.rollout_is_batch_normalize needs the step's weights (is_weights), normalised over the "
                         "whole batch (spmd_rl.actor.ActorUpdate computes them)")
    level = algo.rollout_is_level
    own = importance_weights(old, rollout, mask, level=level, threshold=algo.rollout_is_threshold)
    raw = importance_weights(old, rollout, mask, level=level, threshold=float("inf"))
    weights = own if given is None else given.to(own.dtype)
    with torch.no_grad():
        m = mask.to(own.dtype)
        n = m.sum().clamp(min=1)
        metrics = {"is_weight_mean": (weights * m).sum() / n, "is_clip_frac": ((own != raw).to(m.dtype) * m).sum() / n,
                   "rollout_kl": ((rollout - old).clamp(-20.0, 20.0) * m).sum() / n}
    return weights, metrics


def compute_advantages(scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor, *,
                       algo: AlgoConfig) -> torch.Tensor:
    """Per-token advantages ``[B, T]`` from per-response scores with the configured group estimator."""
    if algo.adv_estimator in CRITIC_ESTIMATORS:
        raise ValueError(f"algo.adv_estimator={algo.adv_estimator} needs a critic's values: spmd_rl.critic computes it")
    fn = ADVANTAGE_ESTIMATORS[algo.adv_estimator]
    if algo.adv_estimator == "grpo":
        return fn(scores, group_index, response_mask, norm_by_std=algo.norm_adv_by_std)
    return fn(scores, group_index, response_mask)


def actor_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    algo: AlgoConfig,
    global_tokens: float,
    global_seqs: float,
    rollout_logprobs: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``rollout_logprobs``: the sampling engine's log-probs, needed when ``algo.rollout_is`` is on
    (the policy loss is then weighted per token by the importance weights of ``old_logprobs``, which
    must be the trainer's own log-probs of the sampling policy: ``is_weights`` when given, the step's
    weights, else this micro-batch's, see the module docstring).
    ``teacher_logprobs``: a teacher's log-probs of the sampled tokens; with ``algo.distill_coef`` > 0
    the loss adds that coefficient times the reverse KL(actor || teacher) per token, estimated on the
    actor's own samples with the low-variance k3 estimator (``actor/distill_kl``)."""
    counts = dict(global_tokens=global_tokens, global_seqs=global_seqs)
    policy = POLICY_LOSSES[algo.policy_loss]
    extra = {"clip_c": algo.clip_c} if algo.policy_loss == "ppo_clip" else {}
    is_metrics: dict[str, torch.Tensor] = {}
    if algo.rollout_is != "none":
        extra["token_weights"], is_metrics = _is_weights(old_logprobs, rollout_logprobs, response_mask, algo, is_weights)
    pg_loss, metrics = policy(
        logprobs, old_logprobs, advantages, response_mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, agg_mode=algo.loss_agg_mode, **extra, **counts,
    )
    loss = pg_loss
    metrics = {f"actor/{k}": v for k, v in metrics.items()}
    metrics.update({f"rollout/{k}": v for k, v in is_metrics.items()})
    metrics["actor/pg_loss"] = pg_loss.detach()
    if algo.use_kl_loss:
        if ref_logprobs is None:
            raise ValueError("algo.use_kl_loss is on but no reference log-probs were computed")
        kl = losses.kl_penalty(logprobs, ref_logprobs, algo.kl_kind)
        kl_loss = losses.aggregate(kl, response_mask, algo.loss_agg_mode, **counts)
        loss = loss + algo.kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    if teacher_logprobs is not None and algo.distill_coef > 0:
        distill = losses.aggregate(losses.kl_penalty(logprobs, teacher_logprobs, "k3"), response_mask,
                                   algo.loss_agg_mode, **counts)
        loss = loss + algo.distill_coef * distill
        metrics["actor/distill_kl"] = distill.detach()
    if entropy is not None:
        ent = losses.aggregate(entropy, response_mask, algo.loss_agg_mode, **counts)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * ent
        metrics["actor/entropy"] = ent.detach()
    return loss, metrics
