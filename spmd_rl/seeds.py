"""Every seed a run derives from ``trainer.seed`` / ``data.seed``, in one place.

    engine_seed(seed, replica)             # a rollout engine's own seed (one per rollout dp replica)
    call_seed(seed, step, round_)          # the sampling seed of a step's round of prompts
    replica_seed(call, replica, stream=k)  # that seed on one replica (and the k-th stream of a pool)
    request_seed(call, i, modulus)         # one request of a call (engines that seed per request)
    epoch_seed(seed, epoch)                # the prompt sampler's permutation of an epoch

The parts are mixed by distinct primes, so neighbouring steps, rounds and replicas never share a
seed. A colocated rollout and a rollout pool with the same data-parallel size derive the same seeds,
and so sample the same responses.
"""

from __future__ import annotations

MIX = 1_000_003
"""Multiplies the run's seed, so that a run's seeds and the next run's do not overlap."""
STEP = 7919
ROUND = 104_729


def engine_seed(seed: int, replica: int) -> int:
    """A rollout engine's seed: one per replica (rollout dp rank), shared by its tp x pp ranks."""
    return seed * MIX + replica


def call_seed(seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of ``step``'s round ``round_`` (> 0 only under ``algo.filter_groups`` or
    for streamed rounds), before the replica's part."""
    return seed * MIX + step * STEP + round_ * ROUND


def replica_seed(call: int, replica: int, *, stream: int = 0) -> int:
    """A call's seed on one rollout replica; ``stream``: how many streams the replica ran before."""
    return call + replica + ROUND * stream


def request_seed(call: int, index: int, modulus: int) -> int:
    """The seed of request ``index`` of a call, below ``modulus`` (an engine's seed range)."""
    return (call * MIX + STEP * index) % modulus


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of the prompt sampler's permutation in ``epoch``."""
    return (seed * MIX + epoch) % (2**63)


__all__ = ["call_seed", "engine_seed", "epoch_seed", "replica_seed", "request_seed"]
