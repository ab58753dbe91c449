"""Policy-gradient and value losses, KL penalties, loss aggregation and the rollout IS weights.

Shapes: ``B`` responses, ``T`` response tokens. Masks are 0/1 float or bool
``[B, T]``. Typical use inside a training micro-step::

    from spmd_rl.algo import losses
    logp = ...  # [B, T] log-probs of the responses (the engine's log-prob head)
    pg_loss, metrics = losses.ppo_clip(
        logp, old_logp, adv, mask, global_tokens=n_tokens_in_dp_minibatch)
    kl = losses.aggregate(losses.kl_penalty(logp, ref_logp, "k3"), mask,
                          "token-mean", global_tokens=n_tokens_in_dp_minibatch)

Global normalisation: when ``global_tokens`` / ``global_seqs`` are the counts
over the whole data-parallel mini-batch (all micro-batches on all ranks), each
micro-batch loss is that micro-batch's share of the mini-batch loss, so
summing (i.e. accumulating gradients of) the micro-batch results over all
micro-batches and DP ranks gives exactly the full-batch value, regardless of
how tokens are distributed. Without them every call normalises locally.

Everything is pure tensor code; no process groups or engines.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = [
    "KL_KINDS",
    "AGG_MODES",
    "kl_penalty",
    "aggregate",
    "ppo_clip",
    "gspo",
    "cispo",
    "value_loss",
    "truncated_is_weights",
]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
_KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

Count = Union[int, float, torch.Tensor]


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} shape {tuple(a.shape)} != {name_b} shape {tuple(b.shape)}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Local token mean for metrics (never the training loss)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, ``[B, T]``.

    kinds: ``k1`` = logp - ref; ``k2`` = 0.5 (logp - ref)^2; ``k3`` (low-var
    KL, Schulman's estimator, clamped for stability); ``abs`` = |logp - ref|.
    Aliases: ``kl`` -> k1, ``mse`` -> k2, ``low_var_kl`` -> k3.
    Not masked: pass the result through :func:`aggregate`.
    """
    _check_same_shape("logprobs", logprobs, "ref_logprobs", ref_logprobs)
    k = _KL_ALIASES.get(kind, kind)
    if k == "k1":
        return logprobs - ref_logprobs
    if k == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if k == "k3":
        # The clamps keep exp() finite for tokens the reference finds near impossible.
        kl = (ref_logprobs - logprobs).clamp(min=-20.0, max=20.0)
        return (torch.exp(kl) - kl - 1.0).clamp(min=-10.0, max=10.0)
    if k == "abs":
        return (logprobs - ref_logprobs).abs()
    valid = list(KL_KINDS) + sorted(_KL_ALIASES)
    raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {valid}")


def _denominator(given: Optional[Count], local: torch.Tensor) -> torch.Tensor:
    if given is None:
        return local.clamp(min=1)
    if isinstance(given, torch.Tensor):
        return given.to(device=local.device, dtype=local.dtype).clamp(min=1)
    if given <= 0:
        raise ValueError(f"global count must be > 0, got {given}")
    return torch.tensor(float(given), device=local.device, dtype=local.dtype)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    norm_length: Optional[Union[int, float]] = None,
) -> torch.Tensor:
    """Reduce a token loss ``[B, T]`` to a scalar.

    modes:
      * ``token-mean``: sum(loss * mask) / (global_tokens or mask.sum()).
      * ``seq-mean-token-sum``: sum over seqs of per-seq token sums,
        / (global_seqs or B).
      * ``seq-mean-token-mean``: sum over seqs of per-seq token means
        (0 for a row with no valid token), / (global_seqs or B).
      * ``seq-mean-token-sum-norm``: sum over seqs of per-seq token sums
        / norm_length (default T), / (global_seqs or B).

    The seq modes count every row, including fully masked ones (which add 0
    to the numerator), so ``global_seqs`` should be the number of rows in the
    DP mini-batch. For ``seq-mean-token-sum-norm`` across micro-batches padded
    to different T, pass a fixed ``norm_length`` (e.g. the max response
    length) or the micro-batch sums won't add up to the full-batch value.
    See the module docstring for how global counts make micro-batch sums exact.
    """
    _check_same_shape("loss_mat", loss_mat, "mask", mask)
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    if mode == "token-mean":
        return masked.sum() / _denominator(global_tokens, m.sum())
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {list(AGG_MODES)}")
    n_rows = torch.tensor(float(loss_mat.shape[0]), device=loss_mat.device, dtype=loss_mat.dtype)
    seq_den = _denominator(global_seqs, n_rows)
    row_sum = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = row_sum
    elif mode == "seq-mean-token-mean":
        per_seq = row_sum / m.sum(dim=-1).clamp(min=1)
    else:
        length = float(loss_mat.shape[-1]) if norm_length is None else float(norm_length)
        if length <= 0:
            raise ValueError(f"norm_length must be > 0, got {norm_length}")
        per_seq = row_sum / length
    return per_seq.sum() / seq_den


def _check_pg_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> None:
    _check_same_shape("logprobs", logprobs, "old_logprobs", old_logprobs)
    _check_same_shape("logprobs", logprobs, "advantages", advantages)
    _check_same_shape("logprobs", logprobs, "response_mask", response_mask)
    if not 0.0 <= clip_low <= 1.0:  # 1: lower bound 0, only the upper clip acts (MiniMax's CISPO)
        raise ValueError(f"clip_low must be in [0, 1] (the ratio's lower bound 1 - clip_low >= 0), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg_mode: str = "token-mean",
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate with dual clip (Ye et al. 2020).

    ratio = exp(clamp(logp - old_logp, -20, 20)); per token
    ``max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``, and for A < 0 further
    capped at ``-A clip_c`` so a huge ratio on a bad token can't blow up the
    loss. Asymmetric ``clip_low``/``clip_high`` gives DAPO's clip-higher.

    Returns ``(loss, metrics)``; metrics are detached local token means:
    ``pg_clipfrac`` (clip active), ``ppo_kl`` (mean old_logp - logp) and
    ``pg_clipfrac_lower`` (dual clip active).
    """
    _check_pg_inputs(logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high)
    if not clip_c > 1.0:
        raise ValueError(f"clip_c must be > 1.0 for dual-clip PPO, got {clip_c}")

    neg_approx_kl = (logprobs - old_logprobs).clamp(min=-20.0, max=20.0)
    ratio = torch.exp(neg_approx_kl)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -advantages * clip_c
    final = torch.where(advantages < 0, torch.minimum(clipped, pg3), clipped)
    final = _apply_token_weights(final, token_weights)

    loss = aggregate(
        final, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _masked_mean((pg2 > pg1).to(final.dtype), response_mask),
            "ppo_kl": _masked_mean(-neg_approx_kl, response_mask),
            "pg_clipfrac_lower": _masked_mean(
                ((clipped > pg3) & (advantages < 0)).to(final.dtype), response_mask
            ),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def _apply_token_weights(per_token: torch.Tensor, token_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``per_token * token_weights`` (e.g. truncated IS weights of the rollout mismatch), no gradient
    through the weights; unchanged when there are none."""
    if token_weights is None:
        return per_token
    _check_same_shape("policy loss", per_token, "token_weights", token_weights)
    return per_token * token_weights.detach()


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg_mode: str = "seq-mean-token-mean",
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: PPO clipping on the sequence-level, length-normalised ratio
    ``s_i = exp(mean_t (logp - old_logp))`` (Zheng et al. 2025).

    Token form: ``log r_t = sg(log s_i) + logp_t - sg(logp_t)`` (clamped at
    10), so every token of a sequence shares the value s_i while the gradient
    flows through each token's own logp. No dual clip; ``pg_clipfrac_lower``
    is reported as 0 to keep the same metric keys as :func:`ppo_clip`.
    """
    _check_pg_inputs(logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high)
    m = response_mask.to(logprobs.dtype)
    neg_approx_kl = logprobs - old_logprobs
    # Rows without valid tokens get log s_i = 0 (ratio 1); they are masked out anyway.
    seq_log_ratio = (neg_approx_kl * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    final = torch.maximum(pg1, pg2)
    final = _apply_token_weights(final, token_weights)

    loss = aggregate(
        final, response_mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs
    )
    return loss, _clip_metrics(pg2 > pg1, neg_approx_kl, response_mask, final.dtype)


def _clip_metrics(clipped: torch.Tensor, neg_approx_kl: torch.Tensor, mask: torch.Tensor,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The detached local token means a single-clip policy loss reports: ``pg_clipfrac`` (share of
    tokens clipped), ``ppo_kl`` (mean old - new log-prob) and ``pg_clipfrac_lower`` (0: no dual clip)."""
    with torch.no_grad():
        return {"pg_clipfrac": _masked_mean(clipped.to(dtype), mask).detach(),
                "ppo_kl": _masked_mean(-neg_approx_kl, mask).detach(),
                "pg_clipfrac_lower": torch.zeros((), dtype=dtype, device=clipped.device)}


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg_mode: str,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): REINFORCE with a clipped, detached IS weight.

    ratio = exp(clamp(logp - old_logp, -20, 20)); per token
    ``-sg(clip(ratio, 1-clip_low, 1+clip_high)) * A * logp``. Unlike PPO's clip no token is
    dropped: a clipped token still gets the gradient ``-w A`` with its weight capped. Same as
    verl's ``compute_policy_loss_cispo``. ``clip_low=1.0`` (lower bound 0) is the paper's setting:
    only the upper bound acts.

    Metrics (detached local token means, as verl): ``pg_clipfrac`` = share of tokens whose
    ratio was clipped on either side, ``ppo_kl`` = mean old_logp - logp, and
    ``pg_clipfrac_lower`` reported as 0 (no dual clip) to keep :func:`ppo_clip`'s keys.
    """
    _check_pg_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    neg_approx_kl = (logprobs - old_logprobs).clamp(min=-20.0, max=20.0)
    ratio = torch.exp(neg_approx_kl)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -clipped_ratio.detach() * advantages * logprobs
    per_token = _apply_token_weights(per_token, token_weights)

    loss = aggregate(per_token, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, _clip_metrics(ratio != clipped_ratio, neg_approx_kl, mask, per_token.dtype)


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float,
    agg_mode: str,
    global_tokens: Optional[Count] = None,
    global_seqs: Optional[Count] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, as verl's ``compute_value_loss``.

    ``vpreds`` are the critic's current predictions, ``values`` its predictions when the batch
    was collected, ``returns`` the targets (e.g. from :func:`spmd_rl.algo.advantages.gae`).
    ``vclipped = clamp(vpreds, values - clip, values + clip)``; the loss is
    ``0.5 * aggregate(max((vpreds - returns)^2, (vclipped - returns)^2))`` with ``agg_mode``
    (see :func:`aggregate`, whose seq modes differ from verl's ``agg_loss`` in counting fully
    masked rows). Returns ``(loss, clipfrac)``, clipfrac = detached local token mean of
    "the clipped error is the larger one".
    """
    _check_same_shape("vpreds", vpreds, "returns", returns)
    _check_same_shape("vpreds", vpreds, "values", values)
    _check_same_shape("vpreds", vpreds, "mask", mask)
    if clip < 0:
        raise ValueError(f"value clip must be >= 0, got {clip}")
    # clamp with tensor bounds rather than values + clamp(vpreds - values): an unclipped
    # prediction stays bit-identical, so rounding can't count it as clipped.
    vclipped = torch.clamp(vpreds, min=values - clip, max=values + clip)
    err = (vpreds - returns).square()
    err_clipped = (vclipped - returns).square()
    per_token = torch.maximum(err, err_clipped)
    loss = 0.5 * aggregate(per_token, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        clipfrac = _masked_mean((err_clipped > err).to(per_token.dtype), mask)
    return loss, clipfrac.detach()


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level truncated importance weights ``min(exp(old - rollout), cap)``, ``[B, T]``.

    ``rollout_logprobs`` are the sampling engine's log-probs (what the tokens were drawn from),
    ``old_logprobs`` the trainer's own log-probs of the same policy; they differ by numerics
    (kernels, dtypes, a vLLM vs FSDP forward). Weighting the policy loss by this ratio corrects
    the gradient towards the trainer's policy; truncation at ``cap`` bounds its variance (TIS).
    The weights are detached and 0 where masked. Metrics (local token means): ``is_weight_mean``,
    ``is_clip_frac`` (share of tokens at the cap) and ``rollout_kl`` (mean rollout - old, a k1
    estimate of KL(rollout || trainer)).
    """
    _check_same_shape("old_logprobs", old_logprobs, "rollout_logprobs", rollout_logprobs)
    _check_same_shape("old_logprobs", old_logprobs, "response_mask", response_mask)
    if cap < 1.0:
        raise ValueError(f"rollout_is_cap must be >= 1, got {cap}")
    with torch.no_grad():
        log_ratio = (old_logprobs - rollout_logprobs).clamp(min=-20.0, max=20.0)
        raw = torch.exp(log_ratio)
        weights = raw.clamp(max=cap) * response_mask.to(raw.dtype)
        metrics = {
            "is_weight_mean": _masked_mean(weights, response_mask),
            "is_clip_frac": _masked_mean((raw > cap).to(raw.dtype), response_mask),
            "rollout_kl": _masked_mean(-log_ratio, response_mask),
        }
    return weights, metrics
