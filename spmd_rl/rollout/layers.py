"""The pieces of the fast decoder (:mod:`spmd_rl.rollout.fast`) that are about the model, not the loop.

* :func:`unsupported_reason`: whether a Hugging Face causal LM is of a family the fast path computes
  (:data:`spmd_rl.models.families.FAMILIES`: Llama 3.x, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3 text),
  and why not;
* :class:`Fused`: ``nn.Linear`` modules of one input as one GEMM, the modules' parameters becoming
  views of the fused tensor (hot-swap by HF name keeps working); :class:`Fp8Fused`: the same GEMM on
  FP8 weights (``--rollout.dtype fp8``, :mod:`spmd_rl.rollout.fp8`), re-quantised row by row at each load;
* :func:`project`: ``F.linear`` on a model-dtype weight, the FP8 GEMM on a ``(q, scale)`` pair;
* :func:`layer_functions`: a decoder layer's two halves around attention as pure functions of
  tensors, which the decoder runs eagerly (prefill, CPU) or compiled (the CUDA decode step);
  :func:`storing`: the first half writing its K/V into the cache as well (the decode step);
* :func:`moe_mlp`: routed experts (Qwen3-MoE) as grouped GEMMs over the tokens sorted by expert
  (``F.grouped_mm``), or, where that kernel cannot run, a loop over the experts that got tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..models.families import FAMILIES
from .fp8 import fp8_linear, quantize_rows

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# RoPE types whose cos/sin depend on the position only (dynamic / longrope rescale with the length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# hidden_act -> a plain function equal to what HF's ACT2FN gives for that name (others use the layer's act_fn)
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def norm_eps(norm: torch.nn.Module) -> float | None:
    """An RMSNorm module's epsilon (``variance_epsilon`` in Llama-like models, ``eps`` in Gemma), or None."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and hasattr(norm, "weight") else None


def rope_types(model: torch.nn.Module) -> list[str | None]:
    """The RoPE table each layer reads: its ``layer_type`` where the rotary module keeps one table per layer
    type (Gemma 3: local and global bases), else None (one table)."""
    inner = model.model
    per_type = isinstance(getattr(inner.rotary_emb, "rope_type", None), dict)
    types = getattr(model.config, "layer_types", None)
    return [types[i] if per_type else None for i in range(len(inner.layers))]


def _rope_reason(rotary: torch.nn.Module) -> str | None:
    rope_type = getattr(rotary, "rope_type", None)
    for name in (rope_type.values() if isinstance(rope_type, dict) else [rope_type]):
        if name not in STATIC_ROPE_TYPES:
            return f"RoPE type {name!r} is not one of {STATIC_ROPE_TYPES}"
    return None


def _mlp_reason(i: int, mlp: torch.nn.Module, moe: bool) -> str | None:
    experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    if moe and experts is not None:
        for name in ("gate_up_proj", "down_proj", "num_experts", "act_fn"):
            if not hasattr(experts, name):
                return f"layer {i} experts have no {name}"
        if getattr(experts, "gate_up_proj_bias", None) is not None or getattr(experts, "is_transposed", False):
            return f"layer {i} experts have biases or a transposed layout"
        for name in ("weight", "top_k", "norm_topk_prob"):
            if not hasattr(gate, name):
                return f"layer {i} router has no {name} (not a Qwen3-MoE softmax top-k router)"
        return None
    for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
        if not hasattr(mlp, name):
            return f"layer {i} MLP has no {name} (not a gated Llama / Qwen / Mistral / Gemma MLP)"
    if mlp.gate_proj.out_features != mlp.up_proj.out_features:
        return f"layer {i} MLP has gate and up projections of different widths"
    if not all(isinstance(m, torch.nn.Linear) for m in (mlp.gate_proj, mlp.up_proj)):
        return f"layer {i} has projections that are not nn.Linear"
    if (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
        return f"layer {i} has projections of one input with and without bias"
    return None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run ``model`` (a HF causal LM), or ``None`` when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "the model has no lm_head Linear"
    if getattr(config, "use_bidirectional_attention", False):
        return "the model's attention is bidirectional (use_bidirectional_attention)"
    reason = _rope_reason(inner.rotary_emb)
    if reason is not None:
        return reason
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if family.sandwich_norms else []
    widths = set()
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
            if not hasattr(attn, name):
                return f"layer {i} attention has no {name}"
        qk = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        if any(n is not None for n in qk) and not all(  # Qwen3, Gemma 3: an RMSNorm over each head of q and of k
                norm_eps(n) is not None and tuple(n.weight.shape) == (attn.head_dim,) for n in qk):
            return f"layer {i} attention's q_norm / k_norm are not both RMSNorms over head_dim"
        group = (attn.q_proj, attn.k_proj, attn.v_proj)
        if not all(isinstance(m, torch.nn.Linear) for m in group):
            return f"layer {i} has projections that are not nn.Linear"
        if len({m.bias is None for m in group}) > 1:
            return f"layer {i} has projections of one input with and without bias"
        reason = _mlp_reason(i, mlp, family.moe)
        if reason is not None:
            return reason
        if hasattr(mlp, "up_proj"):
            widths.add(mlp.up_proj.out_features)
        for name in norms:
            if norm_eps(getattr(layer, name, None)) is None:
                return f"layer {i} {name} is not an RMSNorm"
    if len(widths) > 1:
        return f"the dense MLPs have different widths {sorted(widths)}"
    if norm_eps(inner.norm) is None:
        return "model.norm is not an RMSNorm"
    return None


def project(x: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], b: torch.Tensor | None,
            ) -> torch.Tensor:
    """``x @ W.T + b``: ``w`` a weight (``F.linear``) or an FP8 ``(q, scale)`` pair
    (:func:`~spmd_rl.rollout.fp8.fp8_linear`), as :meth:`Fused.operand` gives it."""
    if isinstance(w, tuple):
        return fp8_linear(x, w[0], w[1], b)
    return F.linear(x, w, b)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = roll(x) * [-1, 1]`` (the sign is in
    ``signed_sin``): three kernels eager, one compiled."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim: Llama's ``x * rsqrt(mean x^2 + eps) * w`` in one fused kernel; with
    ``offset`` (Gemma) statistics and scale ``offset + w`` in float32, rounded once, as HF's Gemma norm."""
    if not offset:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float() + offset, eps=eps).to(x.dtype)


def layer_functions(*, qk_heads: int, head_dim: int, q_heads: int, mlp: Callable, norm_offset: float = 0.0,
                    ) -> tuple[Callable, Callable]:
    """The two halves of a decoder layer around attention, for one model's constants, as pure functions
    (compiled as they are, or run eagerly):

    * ``attn_in(x, norm, eps, w, b, cos, signed_sin, q_norm, k_norm, qk_eps) -> (qk, v)``: RMSNorm, the fused
      q/k/v GEMM, the per-head RMSNorm of q and k (Qwen3, Gemma 3: ``q_norm`` / ``k_norm`` weights, None
      elsewhere) and RoPE on q and k together: ``x [..., h]`` -> ``qk [..., H + Hkv, D]`` (rotated) and
      ``v [..., Hkv, D]``;
    * ``attn_out(x, o, o_w, o_b, eps, post_attn, pre_mlp, post_mlp, weights) -> x``: o_proj, the attention
      output's norm (``post_attn``, Gemma; None elsewhere), the residual, the MLP's input norm, ``mlp(h,
      *weights)`` (:func:`dense_mlp` or :func:`moe_mlp`), its output norm (``post_mlp``, Gemma) and the residual.

    ``norm_offset``: every RMSNorm scales by ``offset + w`` (Gemma: 1).
    """
    split, off = qk_heads * head_dim, norm_offset

    def attn_in(x, norm, eps, w, b, cos, signed_sin, q_norm=None, k_norm=None, qk_eps=0.0):
        qkv = project(rms_norm(x, norm, eps, off), w, b)
        qk = qkv[..., :split].unflatten(-1, (qk_heads, head_dim))
        if q_norm is not None:  # Qwen3, Gemma 3: each head of q and of k normalised before RoPE
            qk = torch.cat([rms_norm(qk[..., :q_heads, :], q_norm, qk_eps, off),
                            rms_norm(qk[..., q_heads:, :], k_norm, qk_eps, off)], dim=-2)
        return rope(qk, cos, signed_sin), qkv[..., split:].unflatten(-1, (-1, head_dim))

    def attn_out(x, o, o_w, o_b, eps, post_attn, pre_mlp, post_mlp, weights):
        o = project(o, o_w, o_b)
        x = x + (o if post_attn is None else rms_norm(o, post_attn, eps, off))
        y = mlp(rms_norm(x, pre_mlp, eps, off), *weights)
        return x + (y if post_mlp is None else rms_norm(y, post_mlp, eps, off))

    return attn_in, attn_out


def storing(attn_in: Callable, q_heads: int) -> Callable:
    """``attn_in_store(cache, at, *args) -> q``: :func:`layer_functions`' ``attn_in(*args)`` that also writes
    each row's rotated K and its V into ``cache [2, entries, Hkv, D]`` (a layer's cache with rows and slots
    flattened) at entry ``at [rows]`` and returns the query heads. Compiled, the write is part of the RoPE
    kernel (inductor updates the cache in place) instead of two ``index_put`` kernels and their copies per
    layer and step."""
    def attn_in_store(cache, at, *args):
        qk, v = attn_in(*args)
        cache[:, at] = torch.stack([qk[..., q_heads:, :], v])
        return qk[..., :q_heads, :]

    return attn_in_store


def dense_mlp(*, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """``mlp(h, gate_up_w, gate_up_b, down_w, down_b)``: the fused gate/up GEMM, ``act(gate) * up``, down_proj
    (each weight a tensor or an FP8 pair, :func:`project`)."""
    def mlp(h, gate_up_w, gate_up_b, down_w, down_b):
        gate, up = project(h, gate_up_w, gate_up_b).split(intermediate, -1)
        return project(act(gate) * up, down_w, down_b)

    return mlp


def grouped_mm_works(weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` (``torch._grouped_mm`` on older torch) runs on experts stacked like
    ``weight [E, out, in]`` (its dtype, device, strides): a probe, since kernels differ by device and release."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    try:
        x = torch.zeros(2, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        offs = torch.tensor([1] * (weight.shape[0] - 1) + [2], dtype=torch.int32, device=weight.device)
        fn(x, weight.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def moe_mlp(*, experts: int, top_k: int, normalise: bool, act: Callable[[torch.Tensor], torch.Tensor],
            grouped: bool) -> Callable:
    """``mlp(h, router_w, gate_up [E, 2I, h], down [E, h, I])``: Qwen3-MoE's sparse block on ``h [..., h]``.

    Router: ``softmax(h @ router_w.T)`` in float32, the top-k experts, their weights renormalised to sum
    1 when ``normalise``. Experts: the ``tokens x k`` (token, expert) pairs sorted by expert, so each
    expert's tokens are one contiguous run; ``grouped``: two grouped GEMMs over the runs (``offs`` = each
    run's end), no host sync (graph-capturable); else a loop over the experts that got tokens (one host
    sync for the run ends). Each pair's output times its weight is added into its token's row.
    ``routes [tokens, k]``, when given, receives each token's chosen experts (router replay: the decode
    step records what the trainer replays; written in place, so a compiled or captured step keeps it)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

    def mlp(h, router_w, gate_up, down, routes=None):
        flat = h.reshape(-1, h.shape[-1])
        logits = F.linear(flat, router_w)
        top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
        if routes is not None:
            routes.copy_(top_i)
        if normalise:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(flat.dtype)
        ids, order = torch.sort(top_i.reshape(-1), stable=True)
        token = order // top_k
        xs = flat[token]
        ends = torch.searchsorted(ids, torch.arange(experts, device=ids.device), right=True)
        if grouped:
            offs = ends.to(torch.int32)
            gate, up = fn(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            ys = fn(act(gate) * up, down.transpose(-2, -1), offs=offs)
        else:
            ys = torch.empty_like(xs)
            bounds = [0] + ends.tolist()
            for e in torch.nonzero(ends.diff(prepend=ends.new_zeros(1))).flatten().tolist():
                run = slice(bounds[e], bounds[e + 1])
                gate, up = F.linear(xs[run], gate_up[e]).chunk(2, dim=-1)
                ys[run] = F.linear(act(gate) * up, down[e])
        ys = ys * top_w.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add_(0, token, ys).view_as(h)

    return mlp


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
        return project(x, self.operand(), self.bias)

    def operand(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The weight as :func:`project` takes it."""
        return self.weight

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


class Fp8Fused(Fused):
    """:class:`Fused` on FP8 weights: the fused tensor is ``q [out, in]`` (e4m3) with ``scale [out]``, one per
    row (:func:`~spmd_rl.rollout.fp8.quantize_rows`); biases stay in the model dtype. The modules' weights
    no longer hold memory (one-element placeholders of their shapes and dtype: their names still check
    a load's shape); :meth:`load` quantises a module's new weight into its rows."""

    def __init__(self, modules: tuple[torch.nn.Linear, ...]) -> None:
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        self.dtype = modules[0].weight.dtype
        self.weight, self.scale = quantize_rows(torch.cat([m.weight.data for m in modules]))
        self.bias = torch.cat([m.bias.data for m in modules]) if modules[0].bias is not None else None
        self._bind()

    def operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight, self.scale

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale] + ([self.bias] if self.bias is not None else [])

    def replace(self, tensors: list[torch.Tensor]) -> None:
        self.weight, self.scale = tensors[0], tensors[1]
        self.bias = tensors[2] if self.bias is not None else None
        self._bind()

    def load(self, module: torch.nn.Linear, weight: torch.Tensor) -> None:
        """Quantise ``weight`` (``module``'s new weight, any dtype or device) into the module's rows."""
        k = next(j for j, m in enumerate(self.modules) if m is module)
        start = sum(self.sizes[:k])
        q, scale = quantize_rows(weight.to(self.weight.device))
        self.weight[start:start + self.sizes[k]].copy_(q)
        self.scale[start:start + self.sizes[k]].copy_(scale)

    def _bind(self) -> None:
        start = 0
        for m, n in zip(self.modules, self.sizes):
            m.weight.data = self.weight.new_empty((1, 1), dtype=self.dtype).expand(n, self.weight.shape[1])
            if self.bias is not None:
                m.bias.data = self.bias[start:start + n]
            start += n


__all__ = ["ACTIVATIONS", "STATIC_ROPE_TYPES", "SUPPORTED_MODEL_TYPES", "Fp8Fused", "Fused", "dense_mlp", "grouped_mm_works",
           "layer_functions", "moe_mlp", "norm_eps", "project", "rms_norm", "rope", "rope_types", "storing",
           "unsupported_reason"]
