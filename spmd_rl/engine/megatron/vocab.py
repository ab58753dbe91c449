"""Log-probs and entropy from vocabulary-parallel logits (each tp rank holds a slice of the vocab).

    logp, ent = vocab_parallel_logprobs(logits_local, labels, group=tp_group, vocab_start=s, vocab=V)

``logits_local``: ``[N, V_local]`` (already divided by the temperature); ``vocab_start``: global
index of column 0; columns at or past ``vocab`` (the padding megatron needs for an even split) are
dropped before the softmax. Three all-reduces over the tp group: the max (no gradient), the sum of
exponentials and the target logit (sums; identity backward, since every tp rank back-propagates
the same loss). Equal to the log-softmax at the labels / the softmax's entropy on the full logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward; identity backward (each rank's loss already sees the total)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def _sum(x: torch.Tensor, group, parts: int) -> torch.Tensor:
    return _AllReduceSum.apply(x, group) if parts > 1 else x


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, group, vocab_start: int, vocab: int,
                            entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(label)`` ``[N]`` and (when ``entropy``) the entropy ``[N]`` of the full softmax."""
    parts = dist.get_world_size(group) if group is not None else 1
    width = max(min(logits.shape[-1], vocab - vocab_start), 0)
    logits = logits[..., :width].float()
    local_max = logits.detach().max(dim=-1).values if width else logits.new_full(logits.shape[:-1], -torch.inf)
    if parts > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _sum(exp.sum(-1), group, parts)
    local = labels - vocab_start
    inside = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, max(width - 1, 0)).unsqueeze(-1)).squeeze(-1) * inside
    target = _sum(picked, group, parts)
    log_z = sum_exp.log()
    logp = target - log_z
    if not entropy:
        return logp, None
    weighted = _sum((exp * shifted).sum(-1), group, parts)
    return logp, log_z - weighted / sum_exp
