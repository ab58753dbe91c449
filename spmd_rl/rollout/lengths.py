"""Response lengths drawn from a distribution, for benchmarks and tests of a long-tailed workload.

    lengths = draw_lengths("lognormal", count=512, low=64, high=2048, seed=7)   # list of ints in [64, 2048]

With ``rollout.length_dist`` other than ``model`` the built-in rollout stops each response at the
length drawn for it (:class:`~spmd_rl.rollout.native.NativeRollout`; run with ``rollout.ignore_eos`` so
that no EOS ends one earlier), and ``bench/async.py``'s simulator draws from the same function.

* ``lognormal``: the median is ``sqrt(low * high)`` and ``sigma = ln(high / low) / 4``, so both bounds
  are two sigmas from the median (about 2 % of the draws land on each bound); for 64..2048 tokens the
  mean is about 1.45x the median and the longest of 512 draws about 4x the mean: a long tail.
* ``uniform``: every length in ``[low, high]`` equally likely.

Pure Python (``random.Random(seed)``): the same seed gives the same lengths everywhere.
"""

from __future__ import annotations

import math
import random
from typing import Literal

LengthDist = Literal["model", "lognormal", "uniform"]


def draw_lengths(dist: LengthDist, *, count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` lengths in ``[low, high]`` from ``dist`` (``model`` has none: ValueError)."""
    if not 1 <= low <= high:
        raise ValueError(f"response lengths need 1 <= rollout.min_new_tokens ({low}) <= rollout.max_new_tokens ({high})")
    rng = random.Random(seed)
    if dist == "lognormal":
        median, sigma = math.sqrt(low * high), max(math.log(high / low) / 4, 1e-9)
        return [min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high) for _ in range(count)]
    if dist == "uniform":
        return [rng.randint(low, high) for _ in range(count)]
    raise ValueError(f"rollout.length_dist={dist!r} draws no lengths (the model decides them)")


__all__ = ["LengthDist", "draw_lengths"]
