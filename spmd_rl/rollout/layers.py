"""The pieces of the fast decoder (:mod:`spmd_rl.rollout.fast`) that are about the model, not the loop.

* :func:`unsupported_reason`: whether a Hugging Face causal LM has the Llama / Qwen2 / Qwen3 / Mistral
  shape the fast path computes (and why not);
* :class:`Fused`: ``nn.Linear`` modules of one input as one GEMM, the modules' parameters becoming
  views of the fused tensor (hot-swap by HF name keeps working);
* :func:`layer_functions`: a decoder layer's two halves around attention as pure functions of
  tensors, which the decoder runs eagerly (prefill, CPU) or compiled (the CUDA decode step).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE types whose cos/sin depend on the position only (dynamic / longrope rescale with the length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# hidden_act -> a plain function equal to what HF's ACT2FN gives for that name (others use the layer's act_fn)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run ``model`` (a HF causal LM), or ``None`` when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "the model has no lm_head Linear"
    rope_type = getattr(inner.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} is not one of {STATIC_ROPE_TYPES}"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
            if not hasattr(attn, name):
                return f"layer {i} attention has no {name}"
        norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        if any(n is not None for n in norms) and not all(  # Qwen3: an RMSNorm over each head of q and of k
                hasattr(n, "variance_epsilon") and tuple(n.weight.shape) == (attn.head_dim,) for n in norms):
            return f"layer {i} attention's q_norm / k_norm are not both RMSNorms over head_dim"
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, name):
                return f"layer {i} MLP has no {name} (not a gated Llama / Qwen2 / Qwen3 / Mistral MLP)"
        if mlp.gate_proj.out_features != mlp.up_proj.out_features:
            return f"layer {i} MLP has gate and up projections of different widths"
        if mlp.up_proj.out_features != inner.layers[0].mlp.up_proj.out_features:
            return f"layer {i} MLP is {mlp.up_proj.out_features} wide, layer 0's {inner.layers[0].mlp.up_proj.out_features}"
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if not all(isinstance(m, torch.nn.Linear) for m in group):
                return f"layer {i} has projections that are not nn.Linear"
            if len({m.bias is None for m in group}) > 1:
                return f"layer {i} has projections of one input with and without bias"
        for name in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(getattr(layer, name, None), "variance_epsilon"):
                return f"layer {i} {name} is not an RMSNorm with variance_epsilon"
    if not hasattr(inner.norm, "variance_epsilon"):
        return "model.norm is not an RMSNorm with variance_epsilon"
    return None


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = roll(x) * [-1, 1]`` (the sign is in
    ``signed_sin``): three kernels eager, one compiled."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def layer_functions(*, qk_heads: int, head_dim: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor],
                    q_heads: int | None = None) -> tuple[Callable, Callable]:
    """The two halves of a decoder layer around attention, for one model's constants, as pure functions
    (compiled as they are, or run eagerly):

    * ``attn_in(x, norm, eps, w, b, cos, signed_sin, q_norm, k_norm, qk_eps) -> (qk, v)``: RMSNorm, the fused
      q/k/v GEMM, Qwen3's per-head RMSNorm of q and k (``q_norm`` / ``k_norm`` weights, None elsewhere) and
      RoPE on q and k together: ``x [..., h]`` -> ``qk [..., H + Hkv, D]`` (rotated) and ``v [..., Hkv, D]``;
    * ``attn_out(x, o, o_w, o_b, norm, eps, gate_up_w, gate_up_b, down_w, down_b) -> x``: o_proj and the
      residual, RMSNorm, the fused gate/up GEMM, the activation times up, down_proj and the residual.
    """
    split, activation = qk_heads * head_dim, act

    def attn_in(x, norm, eps, w, b, cos, signed_sin, q_norm=None, k_norm=None, qk_eps=0.0):
        qkv = F.linear(F.rms_norm(x, (x.shape[-1],), norm, eps=eps), w, b)
        qk = qkv[..., :split].unflatten(-1, (qk_heads, head_dim))
        if q_norm is not None:  # Qwen3: each head of q and of k normalised before RoPE
            qk = torch.cat([F.rms_norm(qk[..., :q_heads, :], (head_dim,), q_norm, eps=qk_eps),
                            F.rms_norm(qk[..., q_heads:, :], (head_dim,), k_norm, eps=qk_eps)], dim=-2)
        return rope(qk, cos, signed_sin), qkv[..., split:].unflatten(-1, (-1, head_dim))

    def attn_out(x, o, o_w, o_b, norm, eps, gate_up_w, gate_up_b, down_w, down_b):
        x = x + F.linear(o, o_w, o_b)
        gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), norm, eps=eps), gate_up_w, gate_up_b).split(intermediate, -1)
        return x + F.linear(activation(gate) * up, down_w, down_b)

    return attn_in, attn_out


class Fused:
    """``nn.Linear`` modules that read the same input, as one GEMM. Their weights (and biases) become
    row ranges of one tensor and the modules' parameters views of those ranges, so an in-place copy into
    a module's parameter (hot-swap) lands in the fused tensor. :meth:`replace` moves the storage (sleep)."""

    def __init__(self, modules: tuple[torch.nn.Linear, ...]) -> None:
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        self.weight = torch.cat([m.weight.data for m in modules])
        self.bias = torch.cat([m.bias.data for m in modules]) if modules[0].bias is not None else None
        self._bind()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules for p in (m.weight, m.bias) if p is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def replace(self, tensors: list[torch.Tensor]) -> None:
        """Use ``tensors`` (as :meth:`tensors` lists them, e.g. their host copies) as the storage."""
        self.weight = tensors[0]
        self.bias = tensors[1] if self.bias is not None else None
        self._bind()

    def _bind(self) -> None:
        start = 0
        for m, n in zip(self.modules, self.sizes):
            m.weight.data = self.weight[start:start + n]
            if self.bias is not None:
                m.bias.data = self.bias[start:start + n]
            start += n


__all__ = ["ACTIVATIONS", "STATIC_ROPE_TYPES", "SUPPORTED_MODEL_TYPES", "Fused", "layer_functions", "rope", "unsupported_reason"]
