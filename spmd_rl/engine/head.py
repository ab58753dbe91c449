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
hidden states and of the head weight chunk by chunk. With a single chunk it saves the logits
instead (no recomputation; same memory as the plain path). The numbers are those of the plain path
``log_softmax(linear(h, W).float() / T)`` (the engine's former code), up to the order of float
sums: logits are computed in the weight's dtype (bf16 under FSDP mixed precision), softmax in at least fp32.

Gradients (``z = logits / T``, ``p = softmax(z)``, ``lse = logsumexp(z)``, ``H = lse - sum p z``):
``d logp_y / dz = onehot(y) - p`` and ``dH / dz = p * (lse - H - z)``; then ``dh = dz W / T``
and ``dW = dz^T h / T``, the latter accumulated in fp32 over chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

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


class ChunkedLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], labels [N]) -> (logprobs [N], entropy [N])``, chunked; fp32
    (float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.zeros(n, dtype=dtype, device=hidden.device)
        lse_all = torch.empty(n, dtype=dtype, device=hidden.device)
        saved_z = None
        for s in range(0, n, chunk):
            z = _scaled_logits(hidden[s:s + chunk], weight, temperature)
            lse = torch.logsumexp(z, dim=-1)
            lse_all[s:s + chunk] = lse
            logp[s:s + chunk] = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse
            if with_entropy:
                ent[s:s + chunk] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
            if n <= chunk:
                saved_z = z  # one chunk: keep the logits rather than recompute them
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.save_for_backward(hidden, weight, labels, lse_all, ent)
        ctx.saved_z = saved_z
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, labels, lse_all, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, t = hidden.shape[0], ctx.temperature
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = None
        single = n <= ctx.chunk
        for s in range(0, n if g_logp is not None or g_ent is not None else 0, ctx.chunk):
            # In place on the [chunk, V] fp32 tensors (the bandwidth of this loop is its cost): the
            # recomputed logits become p, then dz; saved logits are left intact. The arithmetic, and so
            # every rounding, is that of -p*g + onehot*g + g_ent*p*(lse - H - z), then / T.
            h = hidden[s:s + ctx.chunk]
            z = ctx.saved_z if ctx.saved_z is not None else _scaled_logits(h, weight, t)
            lse = lse_all[s:s + ctx.chunk, None]
            # dH/dz = p * (lse - H - z) needs z: taken before z becomes p
            c_minus_z = (lse - ent[s:s + ctx.chunk, None]) - z if g_ent is not None else None
            p = (z - lse).exp_() if ctx.saved_z is not None else z.sub_(lse).exp_()
            ent_term = (g_ent[s:s + ctx.chunk, None] * p).mul_(c_minus_z) if g_ent is not None else None
            if g_logp is not None:
                g = g_logp[s:s + ctx.chunk, None].to(z.dtype)
                dz = p.mul_(-g)
                dz.scatter_add_(-1, labels[s:s + ctx.chunk, None], g)
                if ent_term is not None:
                    dz.add_(ent_term)
            else:
                dz = ent_term
            if t != 1.0:
                dz.div_(t)
            dz = dz.to(weight.dtype)  # what autograd of .float() hands the bf16 linear
            if need_h:
                grad_h[s:s + ctx.chunk] = dz @ weight
            if need_w:
                part = dz.t() @ h
                if single:
                    grad_w = part
                else:
                    grad_w = part.to(lse_all.dtype) if grad_w is None else grad_w.add_(part)
        ctx.saved_z = None
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        elif need_w:  # no position on this rank (an sp slice without response tokens): a zero gradient,
            grad_w = torch.zeros_like(weight)  # so every rank hands FSDP the same set of gradients
        return grad_h, grad_w, None, None, None, None


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = F.linear(hidden, weight)
    z = z if z.dtype in (torch.float32, torch.float64) else z.float()
    return z.div_(temperature) if temperature != 1.0 else z  # a fresh tensor, outside autograd


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                     entropy: Literal["none", "detached", "grad"] = "none",
                     chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N]`` of ``labels`` under ``softmax(hidden @ weight.T / T)`` and the entropy
    (``None`` when ``entropy == "none"``; no gradient when "detached")."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logp, ent = ChunkedLogprobs.apply(hidden, weight, labels.long(), float(temperature), int(chunk_tokens),
                                      entropy != "none")
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
        head = cls(old.weight)
        model.set_output_embeddings(head)
        return head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            return F.linear(hidden, self.weight)
        h = hidden[req.positions]  # [N, H]
        logp, ent = chunked_logprobs(h, self.weight, req.labels, temperature=req.temperature, entropy=req.entropy,
                                     chunk_tokens=req.chunk_tokens)
        ent = ent if ent is not None else torch.zeros_like(logp)
        return torch.stack([logp[None], ent[None]], dim=-1)  # [1, N, 2], not a view (FSDP hooks outputs)


__all__ = ["ChunkedLogprobs", "HeadRequest", "LogprobHead", "chunked_logprobs", "default_chunk_tokens"]
