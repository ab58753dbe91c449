"""Context parallelism for the megatron engine's own attention (no TransformerEngine needed).

    cols = chunk_columns(width, cp, cp_rank)      # the global columns this cp rank holds
    out = context_parallel_attention(q, k, v, group=cp_group, scale=d ** -0.5)
    full = sum_shares(local_values, index, size, group=cp_group)   # every rank: the whole tensor

Layout: a row of ``width`` tokens (a multiple of ``2 * cp``) is cut into ``2 * cp`` equal chunks;
cp rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order (megatron-core's
load-balanced causal split, which its RoPE slices the same way: ``get_pos_emb_on_this_cp_rank``).
Each rank then has one early and one late chunk, so the causal attention work is even.

Attention: every rank all-gathers K and V over the cp group (one collective per layer, K and V
stacked; the backward reduce-scatters their gradients, summing what every rank's queries gave to
each rank's keys), puts the chunks in sequence order and attends each of its two query chunks to
the key prefix that ends with that chunk, with a causal mask aligned to the lower right
(``torch.nn.attention.bias.causal_lower_right``: flash attention on GPU, no mask tensor). With
``cp = 1`` the same path runs on the two halves of the sequence (``bench/megatron_cp.py`` measures
it on one GPU).

Loss: each rank computes log-probs at the response positions it holds; :func:`sum_shares` puts
them together (zeros elsewhere, summed over cp), so every cp rank gets the whole ``[B, T]`` in
sequence order and computes the same loss as without cp. Its backward is the identity: each rank
keeps the gradient of its own positions only, so megatron's DDP, which SUMS gradients over
data x context parallel ranks (``get_data_parallel_group(with_context_parallel=True)``), counts
every token once, and the trainer's global token count (cp rank 0 counts, see
``MegatronLayout.counts_in_sums``) stays the normaliser. Tests: ``tests/test_megatron_cp.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmd_rl.engine.megatron.sdpa import CausalSDPA
from spmd_rl.engine.megatron.vocab import _AllReduceSum


def chunk_columns(width: int, cp: int, rank: int) -> torch.Tensor:
    """The global columns of a ``width``-token row that cp rank ``rank`` holds, in its local order:
    chunk ``rank`` then chunk ``2 * cp - 1 - rank`` of ``2 * cp``."""
    if width % (2 * cp):
        raise ValueError(f"a context-parallel row of {width} tokens must be a multiple of 2 * cp = {2 * cp}")
    c = width // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


# torch 2.13 renames the tensor collectives; older releases have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank-major); backward: reduce-scatter (sum) the
    gradient back to the rank that owns each slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def sum_shares(values: torch.Tensor, index: torch.Tensor, size: int, *,
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """A ``[size]`` tensor with ``values`` at ``index`` and every other cp rank's values at theirs
    (the ranks' indices are disjoint and cover what the caller needs). Backward: the identity
    (every rank computes the same loss from the sum; see the module docstring)."""
    out = values.new_zeros(size).index_copy(0, index, values)
    return _AllReduceSum.apply(out, group) if _size(group) > 1 else out


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                               group: dist.ProcessGroup | None, scale: float) -> torch.Tensor:
    """Causal attention of this cp rank's two query chunks against the whole sequence.

    q ``[s, b, h, d]``, k / v ``[s, b, g, d]`` in the chunked layout (``s = 2 * chunk``: the early
    chunk then the late one) -> ``[s, b, h * d]``. ``group`` None or of size 1: the two halves of
    one sequence."""
    cp = _size(group)
    rank = dist.get_rank(group) if cp > 1 else 0
    s, b, h, d = query.shape
    if s % 2:
        raise ValueError(f"context-parallel attention needs an even local length (two chunks), got {s}")
    c = s // 2
    kv = torch.stack((key, value), dim=1)  # [s, 2, b, g, d]: one collective for both
    if cp > 1:
        kv = _GatherSequence.apply(kv, group)  # [cp * s, ...]: rank r's chunks r and 2cp-1-r, rank by rank
        # sequence chunk j sits at slot 2j (j < cp, an early chunk) or 2(2cp-1-j)+1 (a late one)
        slots = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]
        kv = kv.view(2 * cp, c, *kv.shape[1:])[slots].reshape(2 * cp * c, *kv.shape[1:])
    k, v = (kv[:, i].permute(1, 2, 0, 3) for i in (0, 1))  # [b, g, S, d]
    gqa = k.shape[1] != h
    outs = []
    for local, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        q = query[local * c:(local + 1) * c].permute(1, 2, 0, 3)  # [b, h, c, d]
        end = (chunk + 1) * c  # keys 0..end-1; query i of the chunk sees keys up to chunk * c + i
        if end == c:
            out = F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            from torch.nn.attention.bias import causal_lower_right

            out = F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], attn_mask=causal_lower_right(c, end),
                                                 scale=scale, enable_gqa=gqa)
        outs.append(out)
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(s, b, h * d)


class ContextParallelSDPA(CausalSDPA):
    """:class:`CausalSDPA` in the chunked layout over megatron's cp group (the ``pg_collection``
    megatron's attention passes, else ``parallel_state``'s): the core attention of the local spec
    when ``actor.megatron.cp`` > 1, and of ``bench/megatron_cp.py`` with cp 1."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 softmax_scale: float | None = None, pg_collection=None, **kwargs: object) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, softmax_scale, **kwargs)
        group = getattr(pg_collection, "cp", None)
        if group is None:
            from megatron.core import parallel_state as ps

            group = ps.get_context_parallel_group(check_initialized=False)
        self.group = group if _size(group) > 1 else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None, **_: object) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("context-parallel attention takes no attention mask, bias or packed sequences (the "
                             "engine's rows are right-padded and causal)")
        return context_parallel_attention(query, key, value, group=self.group, scale=self.scale)


__all__ = ["ContextParallelSDPA", "chunk_columns", "context_parallel_attention", "sum_shares"]
