"""The FSDP engine's decoder-layer forwards for Llama / Qwen2 / Mistral: HF's math, the kernels' layout.

    install(model)                               # every self_attn.forward -> natural_layout_forward
    install(model, fuse=("gate_up", "qkv"))      # and the MLP's gate/up, the attention's q/k/v as one GEMM each

Hugging Face's attention transposes q, k, v to ``[b, heads, s, d]`` right after the projections and
applies RoPE there; the engine's attention (:func:`~spmd_rl.engine.ulysses.varlen_sdpa`) then wants
``[tokens, heads, d]`` for torch's flash varlen kernel, so every layer paid for a transposed RoPE
(strided, ~0.4 TB/s on the H200 even when compiled) and a copy back, forward and backward.
:func:`natural_layout_forward` applies the same RoPE (``x * cos + rotate_half(x) * sin``, the same
elementwise operations, so the same numbers) on the projections' own ``[b, s, heads, d]`` layout and
hands the attention function transposed *views*; its flash path then flattens them without a copy.
The module, its parameters and their names are untouched (checkpoints, hot-swap, export, FSDP).

Fused projections run one GEMM over concatenated weights (and biases) where HF runs two or three.
The parameters stay separate: the concatenation copies the layer's weights once per forward (tens
of MB, against activations of GBs), and autograd hands each parameter its slice of the fused weight
gradient. The same sums as separate projections up to the order of float additions.

* ``"gate_up"`` (:func:`fused_mlp_forward`): the gate and up weights are interleaved row by row, so
  the GEMM writes ``[tokens, I, 2]`` and gate and up of one column sit side by side. The fused GEMM
  saved 20-40 ms of a 1.5B step on the H200, but with torch 2.11 the compiled SwiGLU backward, which
  now writes the joined gradient, took 79 ms instead of 40 (77 ms with ``[gate | up]`` end to end:
  inductor computes a join as one masked kernel that reads each input twice), so the step got
  slower (docs/PERF.md).
* ``"qkv"`` (:func:`fused_linear`): one GEMM for the attention's input; it saves the small k/v GEMMs
  of a GQA model and two input-gradient GEMMs with their additions. Its backward joins the q/k/v
  gradients with an opaque op (``spmd_rl::cat_columns``, a plain ``torch.cat``), since compiling the
  ``split``'s own backward made one masked kernel that recomputed the RoPE backward per column
  (1.3 ms per layer against ~0.4). Even so it measured no faster on the 1.5B shape (1.360 s against
  1.332 s per step). Neither is on by default (``FsdpConfig.fuse_projections``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from . import ulysses

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


FUSIONS = ("gate_up", "qkv")


def install(model: torch.nn.Module, *, fuse: tuple[str, ...] | list[str] = ()) -> bool:
    """Give every decoder layer's attention :func:`natural_layout_forward` and fuse the projection groups
    named in ``fuse`` (:data:`FUSIONS`) where the layer allows it; False (nothing changed) when the
    model is not a Llama / Qwen2 / Mistral shape with plain q/k/v/o projections."""
    unknown = set(fuse) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown projection fusions {sorted(unknown)}; choose from {FUSIONS}")
    if getattr(model.config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    attns = [getattr(layer, "self_attn", None) for layer in layers]
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    if not attns or not all(all(hasattr(a, n) for n in needed) and not hasattr(a, "q_norm") for a in attns):
        return False
    for layer, attn in zip(layers, attns):
        attn.forward = types.MethodType(natural_layout_forward, attn)
        attn.fused_qkv = "qkv" in fuse and _plain_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp = getattr(layer, "mlp", None)
        if "gate_up" in fuse and _swiglu(mlp) and _plain_linears(mlp.gate_proj, mlp.up_proj):
            mlp.forward = types.MethodType(fused_mlp_forward, mlp)
        elif mlp is not None and "forward" in vars(mlp):  # installed before with other choices
            del mlp.forward
    return True


def _swiglu(mlp: torch.nn.Module | None) -> bool:
    """An HF gated MLP with SiLU: ``down(silu(gate(x)) * up(x))``."""
    return (all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def _plain_linears(*linears: torch.nn.Module) -> bool:
    """Linears on the same input that one GEMM over their concatenated weights can replace: plain
    ``nn.Linear`` (no adapters or hooks of their own) with equal input size, all with a bias or none."""
    return (all(type(m) is torch.nn.Linear and not m._forward_hooks and not m._forward_pre_hooks for m in linears)
            and len({m.in_features for m in linears}) == 1 and len({m.bias is None for m in linears}) == 1)


@torch.library.custom_op("spmd_rl::cat_columns", mutates_args=())
def cat_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, dim=-1)``, opaque to ``torch.compile`` (module docstring)."""
    return torch.cat(parts, dim=-1)


@cat_columns.register_fake
def _(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].new_empty((*parts[0].shape[:-1], sum(p.shape[-1] for p in parts)))


class _SplitColumns(torch.autograd.Function):
    """``x.split(sizes, -1)`` whose backward joins the gradients with :func:`cat_columns`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
        return x.split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return cat_columns(list(grads)), None  # an output without a gradient got zeros (materialize_grads)


def fused_linear(x: torch.Tensor, *linears: torch.nn.Linear) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)`` as one GEMM over the concatenated weights (module docstring);
    the outputs are column slices of one ``[..., sum(out_features)]`` tensor."""
    weight = torch.cat([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    return _SplitColumns.apply(F.linear(x, weight, bias), [m.out_features for m in linears])


def fused_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's ``down(silu(gate(x)) * up(x))`` with gate and up as one GEMM over their interleaved weights."""
    gate, up = self.gate_proj, self.up_proj
    weight = torch.stack([gate.weight, up.weight], dim=1).flatten(0, 1)  # rows g0, u0, g1, u1, ...
    bias = torch.stack([gate.bias, up.bias], dim=1).flatten() if gate.bias is not None else None
    g, u = F.linear(x, weight, bias).unflatten(-1, (-1, 2)).unbind(-1)
    return self.down_proj(F.silu(g) * u)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def natural_layout_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor],
                           attention_mask: torch.Tensor | None, past_key_values=None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """HF's Llama / Qwen2 / Mistral attention forward with RoPE on ``[b, s, heads, d]`` (module docstring)."""
    b, s = hidden_states.shape[:2]
    if getattr(self, "fused_qkv", False):
        q, k, v = fused_linear(hidden_states, self.q_proj, self.k_proj, self.v_proj)
        v = v.contiguous()  # a column slice; q and k become new tensors in RoPE (kernels want dense rows)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
    cos, sin = (t.unsqueeze(2) for t in position_embeddings)  # [b, s, 1, d]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views: [b, heads, s, d]
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    out, _ = ulysses.varlen_sdpa(self, q, k, v, attention_mask,
                                 dropout=getattr(self, "attention_dropout", 0.0) if self.training else 0.0,
                                 scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(b, s, -1)), None


__all__ = ["FUSIONS", "cat_columns", "fused_linear", "fused_mlp_forward", "install", "natural_layout_forward"]
