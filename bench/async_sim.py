"""A small model of asynchronous GRPO's schedule: the step time at max staleness S (with or without
partial rollouts) from a synchronous run's measured times and the response-length distribution.

    from async_sim import Costs, predict                   # bench/ on sys.path (bench/async.py does this)
    costs = Costs.calibrate(gen_s=2.0, actor_s=1.5, weight_sync_s=0.1, lengths=lengths_of_one_round, batch_size=64)
    predict(costs, staleness=[0, 1, 2], partial=False, draw=lambda k: lengths_of_round(k))   # {S: seconds per step}

    python bench/async_sim.py --gen-s 2.0 --actor-s 1.5 --sync-s 0.1 --length-dist lognormal --min-new-tokens 64 \\
        --max-new-tokens 2048 --prompts 64 --n 8                # prints the predicted speed-up at S = 0, 1, 2

What it models. Two servers that each do one thing at a time: the rollout pool and the actor pool.

* Round k's generation takes ``gen_per_step_s x sum over its pieces of the longest response`` (the
  built-in rollout decodes ``batch_size`` rows at a time, and a piece runs until its longest row ends:
  the long tail). The actor's work on it (reward, log-probs, update) takes ``actor_per_token_s x
  its response tokens``. Each weight transfer occupies both pools for ``weight_sync_s``.
* S = 0: transfer, generate, update, one after the other.
* S > 0: rounds 1..S + 1 are issued at once; after update t the actor sends weights t and then issues
  round t + S + 1. Without partial rollouts the rollout takes the weights after the rounds issued
  before them (first in, first out), so the actor waits for the round in progress; with
  ``partial`` the rollout pauses the round in progress to load them (the prefix prefill that
  follows is not modelled).

Calibration (:meth:`Costs.calibrate`): ``gen_per_step_s`` = measured generation seconds per round /
the expected sum of piece maxima of the length distribution; ``actor_per_token_s`` = the measured
actor seconds (step - gen - weight sync) / the expected tokens per round. Not modelled: the two
pools sharing one GPU (``pools.colocate 2``: the model is then an upper bound), a rollout slower per
token when it runs beside the update, and the decode speed changing with the live batch size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spmd_rl.rollout.lengths import draw_lengths  # noqa: E402 - the repository on the path first


def piece_steps(lengths: list[int], batch_size: int) -> int:
    """Decode steps of one round: the sum over pieces of ``batch_size`` rows of the longest row."""
    return sum(max(lengths[i:i + batch_size]) for i in range(0, len(lengths), batch_size))


@dataclass(frozen=True)
class Costs:
    gen_per_step_s: float
    """Seconds per decode step of a piece."""
    actor_per_token_s: float
    """Actor seconds (reward, log-probs, update) per response token."""
    weight_sync_s: float
    """Seconds of one weight transfer (both pools busy)."""
    batch_size: int
    """Rows the rollout decodes at once (``rollout.batch_size``)."""

    @classmethod
    def calibrate(cls, *, gen_s: float, actor_s: float, weight_sync_s: float, rounds: list[list[int]],
                  batch_size: int) -> Costs:
        """From a synchronous run's medians and sample rounds of response lengths (same distribution)."""
        steps = statistics.mean(piece_steps(r, batch_size) for r in rounds)
        tokens = statistics.mean(sum(r) for r in rounds)
        return cls(gen_per_step_s=gen_s / steps, actor_per_token_s=actor_s / tokens, weight_sync_s=weight_sync_s,
                   batch_size=batch_size)


def schedule(costs: Costs, rounds: list[list[int]], *, staleness: int, partial: bool) -> list[float]:
    """When each step ends on the actor's clock, for the rounds' response lengths (one list per step)."""
    total, s, w = len(rounds), staleness, costs.weight_sync_s
    gen = [costs.gen_per_step_s * piece_steps(r, costs.batch_size) for r in rounds]
    work = [costs.actor_per_token_s * sum(r) for r in rounds]
    issued = {k: 0.0 for k in range(min(s + 1, total))}  # rounds 0..S at the start
    done: list[float] = []  # when each round's generation ended
    loads: list[tuple[float, float]] = []  # the rollout's weight loads, in time order

    def generate_through(k: int) -> None:
        while len(done) <= k:
            j = len(done)
            t, left = max(done[-1] if done else 0.0, issued[j]), gen[j]
            for a, b in loads:  # a load that starts before the round ends pauses it
                if b <= t:
                    continue
                if a >= t + left:
                    break
                left -= max(a - t, 0.0)
                t = b
            done.append(t + left)

    ends, actor_free = [], 0.0
    for t in range(total):
        generate_through(t if partial else min(t + s, total - 1))
        updated = max(actor_free, done[t]) + work[t]
        load = updated if partial else max(updated, done[min(t + s, total - 1)])
        loads.append((load, load + w))
        actor_free = load + w
        if t + s + 1 < total:
            issued[t + s + 1] = actor_free
        ends.append(actor_free)
    return ends


def step_seconds(costs: Costs, rounds: list[list[int]], *, staleness: int, partial: bool) -> float:
    """Mean seconds per step once the pipeline is full (the first 2 (S + 1) steps left out)."""
    ends = schedule(costs, rounds, staleness=staleness, partial=partial)
    skip = min(2 * (staleness + 1), len(ends) // 2)
    return (ends[-1] - ends[skip - 1]) / (len(ends) - skip) if skip else ends[-1] / len(ends)


def predict(costs: Costs, *, staleness: list[int], partial: bool, draw: Callable[[int], list[int]],
            steps: int = 200) -> dict[int, float]:
    """Seconds per step at each max staleness, over ``steps`` rounds drawn by ``draw(step)``."""
    rounds = [draw(k) for k in range(steps)]
    return {s: step_seconds(costs, rounds, staleness=s, partial=partial and s > 0) for s in staleness}


def round_drawer(*, length_dist: str, low: int, high: int, rows: int, fixed: int | None = None) -> Callable[[int], list[int]]:
    """Rounds of ``rows`` response lengths: drawn (``length_dist``), or all ``fixed`` (``model`` with ignore-EOS)."""
    if length_dist == "model":
        return lambda k: [fixed or high] * rows
    return lambda k: draw_lengths(length_dist, count=rows, low=low, high=high, seed=1_000 + k)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gen-s", type=float, required=True, help="measured generation seconds per round (S = 0)")
    p.add_argument("--actor-s", type=float, required=True, help="measured actor seconds per step (S = 0)")
    p.add_argument("--sync-s", type=float, default=0.0, help="measured weight-sync seconds per step")
    p.add_argument("--length-dist", default="lognormal", choices=["model", "lognormal", "uniform"])
    p.add_argument("--min-new-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="rollout.batch_size")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    draw = round_drawer(length_dist=args.length_dist, low=args.min_new_tokens, high=args.max_new_tokens,
                        rows=args.prompts * args.n)
    costs = Costs.calibrate(gen_s=args.gen_s, actor_s=args.actor_s, weight_sync_s=args.sync_s,
                            rounds=[draw(k) for k in range(50)], batch_size=args.batch_size)
    whole = predict(costs, staleness=args.staleness, partial=False, draw=draw)
    part = predict(costs, staleness=args.staleness, partial=True, draw=draw)
    print(f"{'staleness':>9s} {'s/step':>7s} {'speed-up':>8s} {'partial s/step':>14s} {'speed-up':>8s}")
    base = whole[min(whole)]
    for s in args.staleness:
        print(f"{s:9d} {whole[s]:7.3f} {base / whole[s]:8.2f} {part[s]:14.3f} {base / part[s]:8.2f}")


if __name__ == "__main__":
    main()
