"""Advantage estimators: outcome-reward ones for group-sampled responses, and GAE.

Each outcome-reward function (``grpo``, ``rloo``, ``reinforce_pp_baseline``) takes one scalar score per response (``scores[B]``), the id of
the prompt group the response belongs to (``group_index[B]``, any integer ids,
groups need not be contiguous) and the response mask (``response_mask[B, T]``),
and returns token-level advantages ``[B, T]`` that are zero on masked tokens::

    from spmd_rl.algo import advantages
    adv = advantages.grpo(scores, group_index, response_mask)

:func:`gae` instead takes token-level rewards and a critic's values (both ``[B, T]``) and
returns ``(advantages, returns)``.

All functions are pure tensor code and run on whatever device the inputs are
on. Statistics are computed in at least float32 (float64 inputs stay float64);
the result has that dtype.
"""

from __future__ import annotations

import torch

__all__ = ["grpo", "rloo", "reinforce_pp_baseline", "gae"]


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


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens.

    Follows verl's ``compute_gae_advantage_return`` (``verl/trainer/ppo/core_algos.py``, the
    version that skips masked tokens). Walking each row backwards from the last token::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where ``V_next`` / ``A_next`` are the value and advantage of the next *valid* token (0 past
    the last one): a masked token (padding, or a hole such as a tool's observation tokens in a
    multi-turn response) does not update them, so the recursion runs straight across it and its
    reward and value are ignored. ``returns = A + V``, taken before whitening; the advantages
    are then whitened over the valid tokens of the whole batch like verl's ``masked_whiten``:
    ``(A - mean) / sqrt(var + 1e-8)`` with the masked mean and the masked unbiased (n - 1)
    variance.

    Both results are ``[B, T]``, detached, in at least float32, and 0 on masked tokens (verl
    leaves arbitrary values there; only valid tokens are meant to be used). Where verl raises
    (fewer than two valid tokens in the batch) the variance is taken as 0: one valid token gets
    advantage 0, and with none everything is 0. The statistics are over this call's batch, so
    call it on the whole batch, not per micro-batch.
    """
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be [B, T], got shape {tuple(token_rewards.shape)}")
    for name, t in (("values", values), ("mask", mask)):
        if t.shape != token_rewards.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != token_rewards shape {tuple(token_rewards.shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    dtype = torch.promote_types(_compute_dtype(token_rewards), _compute_dtype(values))
    with torch.no_grad():
        r = token_rewards.detach().to(dtype)
        v = values.detach().to(dtype)
        valid = mask.detach().bool()
        B, T = r.shape
        adv = torch.zeros(B, T, dtype=dtype, device=r.device)
        next_value = torch.zeros(B, dtype=dtype, device=r.device)
        next_adv = torch.zeros(B, dtype=dtype, device=r.device)
        for t in range(T - 1, -1, -1):
            a_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
            next_value = torch.where(valid[:, t], v[:, t], next_value)
            next_adv = torch.where(valid[:, t], a_t, next_adv)
            adv[:, t] = next_adv
        # where, not a product: a NaN reward or value on a masked token must not leak out.
        zero = torch.zeros((), dtype=dtype, device=r.device)
        adv = torch.where(valid, adv, zero)
        returns = torch.where(valid, adv + v, zero)

        n = valid.sum().to(dtype)
        mean = adv.sum() / n.clamp(min=1)
        var = torch.where(valid, adv - mean, zero).square().sum() / (n - 1).clamp(min=1)
        whitened = torch.where(valid, (adv - mean) * torch.rsqrt(var + 1e-8), zero)
    return whitened, returns
