"""The FSDP engine's attention forward for the families of :data:`spmd_rl.models.families.FAMILIES` (Llama,
Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3 text): HF's math, the kernels' layout.

    install(model)                               # every self_attn.forward -> natural_layout_forward

Hugging Face's attention transposes q, k, v to ``[b, heads, s, d]`` right after the projections and
applies RoPE there; the engine's attention (:func:`~spmd_rl.engine.ulysses.varlen_sdpa`) then wants
``[tokens, heads, d]`` for torch's flash varlen kernel, so every layer would pay for a transposed RoPE
(strided memory access, slow even when compiled) and a copy back, forward and backward.
:func:`natural_layout_forward` applies the same RoPE (``x * cos + rotate_half(x) * sin``, in three kernels
each way instead of HF's five and nine: :class:`Rope`) on the projections' own ``[b, s, heads, d]``
layout and hands the attention function transposed *views*; its flash path then flattens them without
a copy.
The module, its parameters and their names are untouched (checkpoints, hot-swap, export, FSDP).
Other model types keep HF's forward (:func:`install` returns False) and still run the engine's
attention function. Sliding-window layers (Gemma 3's local layers, Mistral, Qwen2 with
``use_sliding_window``) are windowed by that function (:func:`spmd_rl.engine.ulysses.varlen_sdpa`) at
any length; the megatron engine refuses sequences longer than the window instead.
"""

from __future__ import annotations

import types

import torch

from ..models.families import FAMILIES
from . import ulysses

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def install(model: torch.nn.Module) -> bool:
    """Give every decoder layer's attention :func:`natural_layout_forward`; False (nothing changed) when
    the model is not of a supported family with plain q/k/v/o projections."""
    if getattr(model.config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    if not attns or not all(all(hasattr(a, n) for n in needed) and hasattr(a, "q_norm") == hasattr(a, "k_norm")
                            for a in attns):
        return False
    for attn in attns:
        attn.forward = types.MethodType(natural_layout_forward, attn)
    return True


class Rope(torch.autograd.Function):
    """HF's RoPE ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) = [-x2, x1]``) in three kernels each way:
    ``y = x * cos``, then ``y1 -= x2 * sin1`` and ``y2 += x1 * sin2`` in place on its halves (HF: negation,
    concatenation, two products and a sum, and in the backward slices scattered into zeros). The gradient
    is the transposed rotation: ``g * cos``, plus ``g2 * sin2`` on the first half and minus ``g1 * sin1`` on
    the second. Each ``addcmul_`` rounds once where HF rounds the product and the sum: in bf16 a result can
    differ from HF's by a rounding step; in float32 it is HF's formula. ``cos`` / ``sin`` (from positions,
    no parameters) get no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        half = x.shape[-1] // 2
        y = x * cos
        y[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        y[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        dx = grad * cos
        dx[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        dx[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return dx, None, None


def natural_layout_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor],
                           attention_mask: torch.Tensor | None, past_key_values=None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention forward of the supported families with RoPE on ``[b, s, heads, d]`` (module docstring)."""
    b, s = hidden_states.shape[:2]
    q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
    if hasattr(self, "q_norm"):  # Qwen3, Gemma 3: an RMSNorm over each head of q and of k, before RoPE
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = (t.unsqueeze(2) for t in position_embeddings)  # [b, s, 1, d]
    q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views: [b, heads, s, d]
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    out, _ = ulysses.varlen_sdpa(self, q, k, v, attention_mask,
                                 dropout=getattr(self, "attention_dropout", 0.0) if self.training else 0.0,
                                 scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(b, s, -1)), None


__all__ = ["Rope", "install", "natural_layout_forward"]
