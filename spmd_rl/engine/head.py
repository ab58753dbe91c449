"""The actor's LM head as a log-prob head: logits only where needed, and never all at once.

    head = LogprobHead.replace(model)            # swaps model.lm_head, same Parameter (ties kept)
    head.request = HeadRequest(positions=(rows, cols), labels=labels, temperature=0.8,
                               entropy="grad", chunk_tokens=4096)
    out = model(...)                              # out.logits is [1, N, 2]: (log-prob, entropy)
    head.request = None                           # a plain Linear again (generation, HF callers)

For a large vocabulary the logits are the largest activation of the update: ``N`` response tokens
x ``V`` x 4 bytes (16k tokens x 152k vocab = 10 GB in fp32). :class:`ChunkedLogprobs` computes the
log-prob of each label and (optionally) the entropy ``chunk_tokens`` positions at a time, keeping
only ``[N]`` results; its backward recomputes each chunk's logits and writes the gradients of the
hidden states and of the head weight chunk by chunk. When the logits of all chunks fit in
``keep_bytes`` (``actor.fsdp.keep_logits_gib``, default 1/16 of the GPU's memory) or there is a
single chunk, and a backward will run, the forward keeps them for the backward instead: no
recomputed GEMM (2 N V H FLOPs), at the memory of the raw logits. The numbers are those of the
plain path ``log_softmax(linear(h, W).float() / T)``, up to the order of float sums: logits are
computed in the weight's dtype (bf16 under FSDP mixed precision), softmax in at least fp32.

Gradients (``z = logits / T``, ``p = softmax(z)``, ``lse = logsumexp(z)``, ``H = lse - sum p z``):
``d logp_y / dz = onehot(y) - p`` and ``dH / dz = p * (lse - H - z)``; then ``dh = dz W / T``
and ``dW = dz^T h / T``, the latter accumulated in fp32 over chunks.

Two ways to run the per-chunk vocabulary work, the same formulas:

* eager (CPU, and GPU without triton): the chunk's logits become an fp32 tensor that is worked on
  in place, ~10 passes over ``[chunk, V]`` fp32 per forward + backward;
* fused (``fused=True``, the FSDP engine's choice on CUDA): :func:`chunk_stats` and
  :func:`chunk_grad` go through ``torch.compile``, so each is one or two kernels that read the
  bf16 logits straight from the GEMM and write only ``[chunk]`` statistics or the bf16 ``dz``; no
  fp32 ``[chunk, V]`` tensor exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from spmd_rl.compiled import CompileGroup, triton_available


DEFAULT_CHUNK_ELEMENTS = 2 ** 28
"""Logit elements per chunk when the engine is not told a chunk size (1 GiB of fp32 logits)."""


def default_chunk_tokens(vocab: int) -> int:
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))


@dataclass
class HeadRequest:
    positions: tuple[torch.Tensor, torch.Tensor]
    """``(rows, cols)`` of the hidden states ``[R, W, H]`` to score (device tensors)."""
    labels: torch.Tensor
    """``[N]`` the token each position predicts."""
    temperature: float = 1.0
    entropy: Literal["none", "detached", "grad"] = "none"
    chunk_tokens: int = 4096
    keep_bytes: int = 0
    """Keep every chunk's raw logits for the backward when they take at most this many bytes (module docstring)."""
    fused: bool = False
    """Compiled per-chunk kernels (module docstring); the engine sets it on CUDA."""


class ChunkedLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], labels [N]) -> (logprobs [N], entropy [N])``, chunked; fp32
    (float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool, fused: bool = False, keep_bytes: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        n, dtype = hidden.shape[0], _work_dtype(hidden.dtype)
        logp, lse, ent = (torch.zeros(n, dtype=dtype, device=hidden.device) for _ in range(3))
        stats = _stats if fused else chunk_stats
        # one chunk, or all of them within the budget: keep the logits rather than recompute them
        kept = [] if n <= chunk or n * weight.shape[0] * weight.element_size() <= keep_bytes else None
        for s in range(0, n, chunk):
            logits = F.linear(hidden[s:s + chunk], weight)  # raw, in the weight's dtype
            logp[s:s + chunk], lse[s:s + chunk], ent[s:s + chunk] = stats(logits, labels[s:s + chunk],
                                                                          temperature, with_entropy)
            if kept is not None:
                kept.append(logits)
        ctx.temperature, ctx.chunk, ctx.fused, ctx.kept = temperature, chunk, fused, kept
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, t, c = hidden.shape[0], ctx.temperature, ctx.chunk
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = None
        grad = _grad if ctx.fused else _chunk_grad_in_place
        for i, s in enumerate(range(0, n, c)) if g_logp is not None or g_ent is not None else ():
            h = hidden[s:s + c]
            if ctx.kept is not None:
                logits, ctx.kept[i] = ctx.kept[i], None  # freed as soon as used
            else:
                logits = F.linear(h, weight)
            dz = grad(logits, labels[s:s + c], lse[s:s + c], ent[s:s + c],
                      None if g_logp is None else g_logp[s:s + c], None if g_ent is None else g_ent[s:s + c], t)
            if need_h:
                grad_h[s:s + c] = dz @ weight
            if need_w:
                part = dz.t() @ h
                if n <= c:
                    grad_w = part
                else:  # summed over chunks in fp32
                    grad_w = part.to(lse.dtype) if grad_w is None else grad_w.add_(part)
        ctx.kept = None
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        elif need_w:  # no position on this rank (an sp slice without response tokens): a zero gradient,
            grad_w = torch.zeros_like(weight)  # so every rank hands FSDP the same set of gradients
        return grad_h, grad_w, None, None, None, None, None, None


def _chunk_grad_in_place(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                         g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """:func:`chunk_grad` in eager mode with the fewest ``[chunk, V]`` tensors: the fp32 logits become
    ``p``, then ``dz``, in place (the bandwidth of this loop is its cost). Same arithmetic and rounding order:
    ``-p*g + onehot*g + g_ent*p*(lse - H - z)``, then ``/ T``."""
    z = _scaled_logits(logits, temperature)
    lse, ent = lse[:, None], ent[:, None]
    c_minus_z = (lse - ent) - z if g_ent is not None else None  # dH/dz = p * (lse - H - z) needs z: before z becomes p
    p = z.sub_(lse).exp_()
    ent_term = (g_ent[:, None] * p).mul_(c_minus_z) if g_ent is not None else None
    if g_logp is not None:
        g = g_logp[:, None].to(z.dtype)
        dz = p.mul_(-g)
        dz.scatter_add_(-1, labels[:, None], g)
        if ent_term is not None:
            dz.add_(ent_term)
    else:
        dz = ent_term
    if temperature != 1.0:
        dz.div_(temperature)
    return dz.to(logits.dtype)  # what autograd of .float() hands the bf16 linear


def chunk_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw ``logits [c, V]`` -> ``(log-prob of labels, logsumexp, entropy or 0)`` of ``logits / T``, each
    ``[c]`` in fp32 (float64 for float64 logits). Pure, so ``torch.compile`` fuses it (module docstring)."""
    z = logits.to(_work_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else torch.zeros_like(lse)
    return logp, lse, ent


def chunk_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
               g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``d(sum g_logp logp + g_ent H) / d logits`` for raw ``logits [c, V]``, in the logits' dtype: the
    eager backward's formulas and rounding order (``-p g + onehot g + g_ent p (lse - H - z)``, then ``/ T``)."""
    z = logits.to(_work_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    p = torch.exp(z - lse[:, None])
    dz = None
    if g_logp is not None:
        g = g_logp[:, None].to(z.dtype)
        hit = torch.arange(z.shape[-1], device=z.device)[None, :] == labels[:, None]
        dz = torch.where(hit, g, 0.0) + p * -g
    if g_ent is not None:
        term = (g_ent[:, None] * p) * ((lse - ent)[:, None] - z)
        dz = term if dz is None else dz + term
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(logits.dtype)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_HEAD = CompileGroup("the fused log-prob head")  # on CUDA; eager chunk code if compiling fails
_stats = _HEAD.wrap(chunk_stats)
_grad = _HEAD.wrap(chunk_grad, eager=_chunk_grad_in_place)  # the in-place eager code, same numbers


def fused_available(device: torch.device) -> bool:
    """Whether the fused head can run on ``device``: CUDA with triton (what inductor generates there)."""
    return triton_available(device)


def keep_logits_bytes(gib: float | None, device: torch.device) -> int:
    """The logits budget kept for the backward (``FsdpConfig.keep_logits_gib``): ``None`` = 1/16 of the
    GPU's memory (8.7 GiB on an H200, 5 on an 80 GB card), none on CPU."""
    if gib is None:
        return torch.cuda.get_device_properties(device).total_memory // 16 if device.type == "cuda" else 0
    return int(gib * 2 ** 30)


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` in fp32 (float64 stays) as a fresh tensor the caller may overwrite."""
    z = logits.to(_work_dtype(logits.dtype), copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                     entropy: Literal["none", "detached", "grad"] = "none", chunk_tokens: int = 4096,
                     fused: bool = False, keep_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N]`` of ``labels`` under ``softmax(hidden @ weight.T / T)`` and the entropy
    (``None`` when ``entropy == "none"``; no gradient when "detached"). ``fused``: compiled chunk kernels.
    ``keep_bytes``: the logits budget kept for the backward (module docstring); only used when a
    backward will run."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logp, ent = ChunkedLogprobs.apply(hidden, weight, labels.long(), float(temperature), int(chunk_tokens),
                                      entropy != "none", bool(fused), int(keep_bytes) if backward else 0)
    if entropy == "none":
        return logp, None
    return logp, (ent.detach() if entropy == "detached" else ent)


class LogprobHead(torch.nn.Module):
    """Drop-in for a bias-free ``nn.Linear`` LM head: a Linear while ``request`` is None, else it
    returns ``[1, N, 2]`` (log-prob, entropy or 0) for the requested positions (module docstring)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight  # the same Parameter: tied embeddings stay tied, the name stays lm_head.weight
        self.request: HeadRequest | None = None

    @classmethod
    def replace(cls, model: torch.nn.Module) -> "LogprobHead":
        old = model.get_output_embeddings()
        if not isinstance(old, torch.nn.Linear) or old.bias is not None:
            raise ValueError(f"{type(model).__name__}'s output head is {type(old).__name__} (bias: "
                             f"{getattr(old, 'bias', None) is not None}); the FSDP engine needs a bias-free "
                             "nn.Linear LM head (Llama / Qwen / Mistral shape)")
        softcap = getattr(model.config, "final_logit_softcapping", None)
        if softcap:  # the model's forward would soft-cap the head's (log-prob, entropy) output
            raise ValueError(f"the model's config sets final_logit_softcapping={softcap}, which the FSDP engine's "
                             "log-prob head does not implement; set it to null in the model's config.json")
        head = cls(old.weight)
        model.set_output_embeddings(head)
        return head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            return F.linear(hidden, self.weight)
        h = hidden[req.positions]  # [N, H]
        logp, ent = chunked_logprobs(h, self.weight, req.labels, temperature=req.temperature, entropy=req.entropy,
                                     chunk_tokens=req.chunk_tokens, fused=req.fused, keep_bytes=req.keep_bytes)
        ent = ent if ent is not None else torch.zeros_like(logp)
        return torch.stack([logp[None], ent[None]], dim=-1)  # [1, N, 2], not a view (FSDP hooks outputs)


__all__ = ["ChunkedLogprobs", "HeadRequest", "LogprobHead", "chunk_grad", "chunk_stats", "chunked_logprobs",
           "default_chunk_tokens", "fused_available", "keep_logits_bytes"]
