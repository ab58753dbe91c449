"""On-device sampling of the rollout: top-k / top-p filtering (both loops), the exponential race (HF loop),
the two-level inverse CDF (fast decoder: one uniform per row, no RNG inside its CUDA graphs), and the
fast decoder's uniforms: each row's own, drawn when it is fed (:func:`row_uniforms`).

A row's uniforms come from its own generator, seeded by the call's seed, the row's key and its
prompt's length (:func:`row_seed`), so what a row samples does not depend on which slot it took, which
rows shared its steps, or when it came: a stream fed by threads (multi-turn episodes, agents) samples
the same tokens on a busy machine as on an idle one, given the same seed.

Log-probs are ``log_softmax(logits / T)`` at the chosen token (``T = 1`` when greedy), taken BEFORE
top-k / top-p filtering, in float32 (see :mod:`spmd_rl.rollout.base`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Hashable

import torch
import torch.nn.functional as F


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


def inverse_cdf(logits: torch.Tensor, lse: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits [b, V]`` (float32, ``-inf`` = filtered out) with ``lse [b]`` their logsumexp and
    ``u [b]`` in [0, 1): the first token whose running probability exceeds ``u`` of the row's total, i.e.
    a draw from ``softmax(logits)``. Never a token of zero probability.

    In two levels instead of one scan over the vocabulary: the probabilities in blocks of about sqrt(V)
    tokens (a power of two; the last block padded with zeros), a running total over the block sums
    picks the block, and a running total inside that block picks the token. A scan over 152k logits is
    one long serial kernel per row; here the probabilities are read once more, in parallel.
    """
    rows, vocab = logits.shape
    block = 1 << math.ceil(math.log2(vocab) / 2)
    blocks = -(-vocab // block)
    probs = torch.empty(rows, blocks * block, dtype=torch.float32, device=logits.device)
    probs[:, vocab:] = float("-inf")
    torch.sub(logits, lse[:, None], out=probs[:, :vocab])
    probs = probs.exp_().view(rows, blocks, block)
    running = F.pad(probs.sum(-1), (1, 0)).cumsum_(-1)  # [b, blocks + 1]: the mass of the blocks before each
    total = running[:, -1:].contiguous()
    target = u[:, None] * total
    # the block whose running total first exceeds the target; u * total can round up to the total: then the
    # last block with mass, the first to reach the total
    at = torch.minimum(torch.searchsorted(running, target, right=True), torch.searchsorted(running, total)) - 1
    inner = probs.gather(1, at[:, :, None].expand(rows, 1, block)).squeeze(1).cumsum_(-1).add_(running.gather(1, at))
    # inside it the same, against its own running total (summed in another order than the block's)
    tok = torch.minimum(torch.searchsorted(inner, target, right=True),
                        torch.searchsorted(inner, inner[:, -1:].contiguous()))
    return (at * block + tok).squeeze(-1)


def row_seed(seed: int, key: Hashable, length: int) -> int:
    """The seed of one row's random stream: a hash of the call's ``seed``, the row's ``key`` (its
    ``repr``: ints, strings and tuples of them hash the same in every process) and its prompt's
    ``length`` (a multi-turn episode's key comes back with a longer prompt on each turn)."""
    digest = hashlib.blake2b(f"{int(seed)}|{key!r}|{int(length)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds take 63 bits


def row_uniforms(seeds: list[int], counts: list[int]) -> torch.Tensor:
    """``[len(seeds), max(counts)]`` float32 uniforms in [0, 1) on the host: row ``i``'s first
    ``counts[i]`` from a generator seeded with ``seeds[i]`` (zeros after them)."""
    out = torch.zeros(len(seeds), max(counts, default=0), dtype=torch.float32)
    for i, (seed, count) in enumerate(zip(seeds, counts)):
        out[i, :count] = torch.rand(count, generator=torch.Generator().manual_seed(seed))
    return out


__all__ = ["filter_logits", "inverse_cdf", "row_seed", "row_uniforms", "sample_next"]
