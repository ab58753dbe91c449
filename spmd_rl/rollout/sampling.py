"""On-device sampling of the rollout: top-k / top-p filtering (both loops), the exponential race (HF loop).

Log-probs are ``log_softmax(logits / T)`` at the chosen token (``T = 1`` when greedy), taken BEFORE
top-k / top-p filtering, in float32 (see :mod:`spmd_rl.rollout.base`).
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (``[b, V]`` float)."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from ``[b, V]`` logits; return ``(tokens [b], logprobs [b] float32)``.

    The log-prob is taken from ``log_softmax(logits / T)`` before filtering (module docstring).
    Sampling uses the exponential race (``argmax p / E``, ``E ~ Exp(1)``), which draws exactly from
    ``p`` and needs no host synchronisation.
    """
    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits
    logprobs = torch.log_softmax(scaled, dim=-1)
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
    else:
        probs = torch.softmax(filter_logits(scaled, top_k=top_k, top_p=top_p), dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator)
        race.clamp_(min=torch.finfo(race.dtype).tiny)  # an exact 0 would turn p=0 into NaN
        tokens = torch.argmax(probs / race, dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


__all__ = ["filter_logits", "sample_next"]
