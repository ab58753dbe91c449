"""Ulysses sequence parallelism and varlen attention for the FSDP engine, through transformers'
attention interface (no model code is patched).

    register_attention()                                   # once; adds ATTENTION_NAME to transformers
    model = load_causal_lm(folder, ..., attn_implementation=ATTENTION_NAME)
    check_heads(model.config, sp)                          # ValueError naming the numbers
    spec = AttnSpec(mask=block_causal_mask(segment_ids), sp_group=group)   # per forward (CPU)
    cu, longest = varlen_runs(segment_ids)                                 # GPU: flash varlen kernel
    spec = AttnSpec(cu_seqlens=cu.cuda(), max_seqlen=longest, sp_group=group)
    out = model(input_ids=local_ids, position_ids=local_pos, spmd_attn=spec, ...)
    logprobs = gather_sequence(local_logprobs, group, dim=1)

The sp ranks of one group hold the same rows; each feeds the model its contiguous slice of the
sequence dimension (``[R, W/k]``). Everything but attention is per token, so it runs on the slice
as is; RoPE uses the sliced ``position_ids``. Inside attention, :func:`varlen_sdpa` all-to-alls
q/k/v from sequence-sharded ``[R, H, W/k, D]`` to head-sharded ``[R, H/k, W, D]``, runs SDPA over
whole sequences with the block-diagonal causal mask of the full rows, and all-to-alls back. On
GPU the engine passes ``cu_seqlens`` instead of a mask and attention runs torch's flash varlen
kernel on the rows flattened to ``[R * W]`` tokens (no ``W x W`` mask, no masked-out work), with
grouped-query attention native in the kernel (no k/v repeat): ``enable_gqa`` where ``varlen_attn``
has it, else :class:`_GroupedFlashVarlen` (aten's flash forward / backward ops, torch 2.11). The
FSDP engine uses :func:`varlen_sdpa` for every layout, with or without sp.

Gradients. Each sp rank ends its forward with an all-gather of its slice's per-position
log-probs (:func:`gather_sequence`), so every sp rank computes the same loss value from the same
full tensor. The gather's backward keeps only the rank's own slice of the gradient (no sum):
rank r back-propagates dL/d(slice r) through its graph, and the all-to-all's backward carries
the parts that depend on other ranks' keys and values to those ranks. Summed over the sp group
(FSDP sums gradients over every pool rank) that is dL/dθ exactly once; a sum in the gather's
backward would count it k times. Token counts for the loss are therefore taken once per sp group.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmd_rl.models.families import layer_windows

ATTENTION_NAME = "spmd_rl_varlen_sdpa"
"""The ``attn_implementation`` name the engine loads models with when it needs sp or packing."""


def check_heads(config: object, sp: int) -> None:
    """Ulysses splits attention heads over the sp ranks: both head counts must divide by ``sp``."""
    heads = int(getattr(config, "num_attention_heads"))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % sp or kv_heads % sp:
        raise ValueError(
            f"actor.fsdp.ulysses_size ({sp}) must divide num_attention_heads ({heads}) and "
            f"num_key_value_heads ({kv_heads}) of the model; choose a ulysses size that divides both"
        )


# --------------------------------------------------------------------------- collectives with autograd


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk j of ``x`` along ``scatter_dim`` goes to sp rank j; the chunks received from ranks
    0..k-1 are concatenated along ``gather_dim`` (so rank order = sequence / head order)."""
    k = dist.get_world_size(group)
    send = torch.stack(x.chunk(k, dim=scatter_dim)).contiguous()  # [k, ...chunk]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the transpose of an exchange is the exchange with the roles of the dims swapped
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[R, H, W/k, D]`` (my sequence slice, all heads) -> ``[R, H/k, W, D]`` (my heads, whole rows)."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`."""
    return _AllToAll.apply(x, group, 2, 1)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.rank, ctx.k, ctx.dim = dist.get_rank(group), dist.get_world_size(group), dim
        parts = [torch.empty_like(x) for _ in range(ctx.k)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # own slice only: every sp rank computes the same loss, see the module docstring
        return grad.chunk(ctx.k, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """All-gather the sp slices of ``x`` along ``dim``; the backward keeps the local slice's gradient."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


# --------------------------------------------------------------------------- the attention function


@dataclass
class AttnSpec:
    """What :func:`varlen_sdpa` needs besides q/k/v, passed through the model as ``spmd_attn=``.

    Exactly one of ``mask`` (SDPA with a dense block-diagonal mask: CPU, fp32) and ``cu_seqlens``
    (flash varlen kernel: CUDA, bf16/fp16) is set."""

    mask: torch.Tensor | None = None
    """``[R, 1, W, W]`` bool, True = may attend; over the FULL rows (not the sp slice)."""
    sp_group: dist.ProcessGroup | None = None
    """The Ulysses group; None without sequence parallelism."""
    cu_seqlens: torch.Tensor | None = None
    """``[S + 1]`` int32 offsets of the causal runs of the flattened ``[R * W]`` full rows."""
    max_seqlen: int = 0
    """Longest run (a host int, so the kernel launch needs no device sync)."""


def varlen_runs(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[R, W]`` segment ids -> ``cu_seqlens [S + 1]`` int32 and the longest run, over the rows
    flattened to ``[R * W]``. A run is a maximal stretch of one id inside one row, so packed
    sequences, a row's trailing padding and the left/right padding of the padded layout are each
    a run; causal attention inside runs is the block-diagonal mask of :func:`block_causal_mask`."""
    r, w = segment_ids.shape
    starts = torch.ones(r, w, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    offsets = starts.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([offsets, offsets.new_tensor([r * w])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def flash_varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (a flash kernel, CUDA only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names of this torch's ``varlen_attn`` (read once: ``inspect.signature`` costs ~30 us, and
    this runs in every layer of every forward)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                  scale: float | None, window: int | None = None) -> torch.Tensor:
    """Causal varlen attention, ``[T, H, D]`` x ``[T, Hkv, D]`` -> ``[T, H, D]`` (torch's flash kernel);
    ``window``: each query sees its ``window - 1`` predecessors and itself (a sliding-window layer).

    The keyword for causality changed between torch releases (``is_causal`` in 2.10,
    ``window_size=(-1, 0)`` later). Grouped-query attention is native in the kernel: through
    ``enable_gqa`` where it exists, else through :class:`_GroupedFlashVarlen`."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    if window is not None and "window_size" not in params:
        raise ValueError(f"a sliding-window layer (window {window}) needs torch's varlen_attn with window_size "
                         f"(torch >= 2.11); this torch {torch.__version__} has none: upgrade torch")
    left = -1 if window is None else window - 1
    extra: dict[str, object] = {"window_size": (left, 0)} if "window_size" in params else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" not in params:  # torch <= 2.11: the same kernel, called without the head check
            if window is not None:
                raise ValueError(f"a sliding-window layer (window {window}) with grouped-query attention needs "
                                 f"torch's varlen_attn with enable_gqa; this torch {torch.__version__} has none")
            return _GroupedFlashVarlen.apply(q, k, v, cu, max_len, scale)
        extra["enable_gqa"] = True
    if scale is not None and "scale" in params:
        extra["scale"] = scale
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)


class _GroupedFlashVarlen(torch.autograd.Function):
    """Causal flash varlen attention with fewer k/v heads than q heads, through aten's flash ops.

    The flash kernel reads k/v head ``h // (H / Hkv)`` for query head ``h`` and its backward sums
    the group's k/v gradients itself, so k and v are never repeated (a copy of each and a
    reduction in the backward). Newer ``varlen_attn`` exposes this as ``enable_gqa`` (torch 2.13
    has it, 2.11 not); this is the same two ops, for the releases without it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                scale: float | None) -> torch.Tensor:
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, seed, offset,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[R, W]`` segment ids -> ``[R, 1, W, W]`` causal mask inside each segment.

    A token attends to earlier-or-same tokens of its own segment. Padding (id -1) is a segment of
    its own, so padded query rows still see themselves and SDPA never meets an all-masked row.
    """
    w = segment_ids.shape[-1]
    causal = torch.ones(w, w, dtype=torch.bool, device=segment_ids.device).tril()
    return ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal)[:, None]


def annotate_windows(model: torch.nn.Module) -> None:
    """Store each attention module's sliding window (or None) as its ``spmd_window`` attribute, before any
    layer is compiled. Looked up inside a compiled layer as ``layer_windows(config)[layer_idx]``, the
    window made torch.compile guard on ``layer_idx``: one recompile per layer, and past the recompile
    limit (8) the later layers ran eager (Qwen3-1.7B's update). A stored value is guarded by value, so
    every full-attention layer shares one compiled graph (two for Gemma 3's sliding/global layers)."""
    for module in model.modules():
        config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
        if config is not None and isinstance(idx, int):
            module.spmd_window = layer_windows(config)[idx]


def layer_window(module: torch.nn.Module) -> int | None:
    """The sliding window of the attention ``module``'s layer (:func:`spmd_rl.models.families.layer_windows`
    of its config at its ``layer_idx``; stored by :func:`annotate_windows`), None for a full causal layer."""
    if hasattr(module, "spmd_window"):
        return module.spmd_window
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is None or idx is None:
        return None
    return layer_windows(config)[idx]


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                spmd_attn: AttnSpec | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers attention function: q ``[R, H, S, D]``, k/v ``[R, Hkv, S, D]`` -> ``[R, S, H, D]``.

    ``S`` is the local sequence slice under Ulysses (``W / k``), else the whole row ``W``.
    """
    if spmd_attn is None:
        raise RuntimeError(
            f"attn_implementation={ATTENTION_NAME!r} needs `spmd_attn=AttnSpec(...)` in the model call; "
            "only the FSDP engine's forward provides it"
        )
    group = spmd_attn.sp_group
    window = layer_window(module)
    if group is not None:
        query, key, value = seq_to_heads(query, group), seq_to_heads(key, group), seq_to_heads(value, group)
    if spmd_attn.cu_seqlens is not None:  # flash varlen over the flattened full rows
        if dropout > 0:
            raise ValueError(f"attention dropout {dropout} with the flash varlen path: set the model's "
                             "attention_dropout to 0 for RL training")
        r, h, w, d = query.shape
        flat = _flash_varlen(query.transpose(1, 2).reshape(r * w, h, d),
                             key.transpose(1, 2).reshape(r * w, key.shape[1], d),
                             value.transpose(1, 2).reshape(r * w, value.shape[1], d),
                             spmd_attn.cu_seqlens, spmd_attn.max_seqlen, scaling, window=window)
        out = flat.view(r, w, h, d)
        if group is None:
            return out, None
        return heads_to_seq(out.transpose(1, 2), group).transpose(1, 2).contiguous(), None
    rep = query.shape[1] // key.shape[1]
    if rep > 1:  # GQA: query head h reads kv head h // rep (also after the head split, see check_heads)
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    mask = spmd_attn.mask
    if window is not None:  # inside a run, index distance = position distance: keep keys < window back
        idx = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & ((idx[:, None] - idx[None, :]) < window)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    if group is not None:
        out = heads_to_seq(out, group)
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_attention() -> None:
    """Add :func:`varlen_sdpa` to transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`.

    The name has no mask function in ``AttentionMaskInterface``, so the model builds no mask of
    its own (its ``create_causal_mask`` returns None) and :class:`AttnSpec` carries ours.
    """
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, varlen_sdpa)
        _registered = True


__all__ = ["ATTENTION_NAME", "AttnSpec", "block_causal_mask", "check_heads", "flash_varlen_available",
           "annotate_windows", "gather_sequence", "heads_to_seq", "layer_window", "register_attention", "seq_to_heads", "varlen_runs",
           "varlen_sdpa"]
