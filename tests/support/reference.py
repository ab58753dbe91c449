"""Plain reference implementations the tests compare the library's optimised code against.

    logp = logprobs_from_logits(logits, labels)   # [B, T, V], [B, T] -> [B, T]: log softmax at labels
    ent = entropy_from_logits(logits)             # [..., V] -> [...]
    n = count_params(model)                       # parameters, tied weights once
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, ``[...]``.

    Uses ``logsumexp(z) - sum(softmax(z) z)``, which never takes log of a
    probability, so it is stable for large-magnitude logits. Computed in at
    least float32. Logits must be finite (mask vocab entries with a large
    negative number, not -inf: 0 * -inf is NaN).
    """
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] over the last dim: ``[B, T, V], [B, T] -> [B, T]``.

    For float32/64 logits this is ``gather - logsumexp`` with no full
    log-softmax tensor. For half/bf16 logits the log-softmax runs in float32
    one row at a time, so at most one ``[T, V]`` float32 copy exists at once.
    Returns float32 (float64 for float64 logits). Differentiable.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} != logits shape without vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    idx = labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, idx).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    if logits.dim() < 2:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, idx).squeeze(-1)
    rows = [
        torch.log_softmax(row.float(), dim=-1).gather(-1, row_idx).squeeze(-1)
        for row, row_idx in zip(logits, idx)
    ]
    return torch.stack(rows)


def count_params(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters; tied weights (shared tensors) count once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
