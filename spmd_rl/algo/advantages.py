"""Outcome-reward advantage estimators for group-sampled responses.

Each function takes one scalar score per response (``scores[B]``), the id of
the prompt group the response belongs to (``group_index[B]``, any integer ids,
groups need not be contiguous) and the response mask (``response_mask[B, T]``),
and returns token-level advantages ``[B, T]`` that are zero on masked tokens::

    from spmd_rl.algo import advantages
    adv = advantages.grpo(scores, group_index, response_mask)

All functions are pure tensor code and run on whatever device the inputs are
on. Statistics are computed in at least float32 (float64 inputs stay float64);
the result has that dtype.
"""

from __future__ import annotations

import torch

__all__ = ["grpo", "rloo", "reinforce_pp_baseline"]


def _check_inputs(
    scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor
) -> None:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    if group_index.shape != scores.shape:
        raise ValueError(
            f"group_index shape {tuple(group_index.shape)} != scores shape {tuple(scores.shape)}"
        )
    if group_index.dtype.is_floating_point or group_index.dtype.is_complex or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must be an integer tensor, got dtype {group_index.dtype}")
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask must be [B, T] with B={scores.shape[0]}, got shape {tuple(response_mask.shape)}"
        )


def _compute_dtype(scores: torch.Tensor) -> torch.dtype:
    # bf16/fp16 rewards would lose the small differences that advantages are made of.
    return torch.promote_types(scores.dtype, torch.float32) if scores.dtype.is_floating_point else torch.float32


def _group_stats(
    scores: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response (group mean, group unbiased std, group size), each ``[B]``.

    Groups of one get mean 0 and std 1 so that their "advantage" is the raw
    score rather than a NaN (same convention as verl's GRPO).
    """
    # inverse[b] is a dense 0..G-1 id, which lets us scatter instead of looping in Python.
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    count.index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inverse, scores)
    mean = total / count
    sq_dev = (scores - mean[inverse]) ** 2
    ss = torch.zeros_like(count).index_add_(0, inverse, sq_dev)
    std = torch.sqrt(ss / (count - 1).clamp(min=1))

    n = count[inverse]
    singleton = n < 2
    mean_b = torch.where(singleton, torch.zeros_like(scores), mean[inverse])
    std_b = torch.where(singleton, torch.ones_like(scores), std[inverse])
    return mean_b, std_b, n


def _broadcast(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def grpo(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantage: ``(score - group mean) / (group std + eps)``, or without
    the division when ``norm_by_std=False`` (Dr. GRPO).

    The std is the unbiased (n-1) sample std. A group of one has mean 0 and
    std 1, so its advantage is ``score / (1 + eps)`` (resp. ``score``).
    Returns ``[B, T]``: the per-response value broadcast over tokens, masked.
    """
    _check_inputs(scores, group_index, response_mask)
    s = scores.to(_compute_dtype(scores))
    mean, std, _ = _group_stats(s, group_index)
    adv = s - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return _broadcast(adv, response_mask)


def rloo(
    scores: torch.Tensor, group_index: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """RLOO advantage: ``score_i - mean(score_j for j != i in the group)``.

    Equivalent to ``n / (n - 1) * (score_i - group mean)``. A group of one has
    no other members, so its baseline is 0 and the advantage is the score.
    Returns ``[B, T]``, masked.
    """
    _check_inputs(scores, group_index, response_mask)
    s = scores.to(_compute_dtype(scores))
    mean, _, n = _group_stats(s, group_index)
    # For singletons _group_stats already made mean 0; the factor must be 1 there, not n/0.
    factor = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    return _broadcast(factor * (s - mean), response_mask)


def reinforce_pp_baseline(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++-baseline advantage.

    Subtract the group mean (0 for a group of one), broadcast over tokens, then
    whiten over all valid tokens of the batch: ``(x - m) / (s + eps)`` with the
    masked token mean ``m`` and masked unbiased token std ``s``. The whitening
    is token-weighted, so long responses weigh more in ``m`` and ``s``. With
    fewer than two valid tokens ``s`` is 0; with none the result is all zeros.
    Returns ``[B, T]``, masked.

    The statistics are over this call's batch only; call it on the whole
    batch (not per micro-batch) to get the usual estimator.
    """
    _check_inputs(scores, group_index, response_mask)
    s = scores.to(_compute_dtype(scores))
    mean, _, _ = _group_stats(s, group_index)
    mask = response_mask.to(s.dtype)
    x = (s - mean).unsqueeze(-1) * mask
    n_tok = mask.sum()
    tok_mean = x.sum() / n_tok.clamp(min=1)
    tok_var = (((x - tok_mean) * mask) ** 2).sum() / (n_tok - 1).clamp(min=1)
    return (x - tok_mean) / (tok_var.sqrt() + eps) * mask
