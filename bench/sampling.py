"""The fast decoder's sampling step alone: one running total over the vocabulary against the two-level
inverse CDF (:func:`spmd_rl.rollout.sampling.inverse_cdf`: block sums, then one block), both replayed
as CUDA graphs the way the decode step runs them (eagerly on a CPU).

    python3 bench/sampling.py                              # 64 x 152,064 (Qwen2.5-7B's vocabulary, batch 64)
    python3 bench/sampling.py --rows 256 --vocab 151936 49152
    python3 bench/sampling.py --device cpu --rows 8 --vocab 1000 --repeats 3

Prints ms per call for each and how many of the rows' tokens differ (only where a uniform falls within
float32 rounding of an interval's edge; the two sum in different orders).
"""

from __future__ import annotations

import argparse
import time

import torch

from spmd_rl.rollout.sampling import inverse_cdf


def one_scan(logits: torch.Tensor, lse: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The decoder's earlier sampler: one cumulative sum over the whole vocabulary."""
    cdf = torch.exp(logits - lse[:, None]).cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    tokens = torch.searchsorted(cdf, u[:, None] * total, right=True)
    return torch.minimum(tokens, torch.searchsorted(cdf, total)).squeeze(-1)


def timed(fn, device: torch.device, repeats: int) -> float:
    """ms per call: replays of a CUDA graph of ``fn`` on CUDA, plain calls elsewhere."""
    call = fn
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # workspaces outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        call = graph.replay
    for _ in range(3):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, nargs="+", default=[152064])
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    print(f"sampling bench: {device}, torch {torch.__version__}, float32 logits, {args.rows} rows")
    print(f"{'vocab':>8} {'one scan ms':>12} {'two-level ms':>13} {'speed-up':>9} {'tokens differ':>14}")
    for vocab in args.vocab:
        logits = torch.randn(args.rows, vocab, device=device, generator=g) * 3
        lse = torch.logsumexp(logits, -1)
        u = torch.rand(args.rows, device=device, generator=g)
        differ = int((one_scan(logits, lse, u) != inverse_cdf(logits, lse, u)).sum())
        scan = timed(lambda: one_scan(logits, lse, u), device, args.repeats)
        two = timed(lambda: inverse_cdf(logits, lse, u), device, args.repeats)
        print(f"{vocab:>8} {scan:>12.3f} {two:>13.3f} {scan / two:>8.2f}x {differ:>7} / {args.rows}")


if __name__ == "__main__":
    main()
