"""The decode step's attention alone, at a long-tail shape: masked SDPA over the span vs each row's own entries.

    python3 bench/decode_attention_check.py                 # GPU: Qwen3-0.6B / 1.7B's attention, 256 and 16 rows
    python3 bench/decode_attention_check.py --rows 256 --layers 28 --max-len 8192
    TRITON_INTERPRET=1 python3 bench/decode_attention_check.py --rows 4 --heads 4 --kv-heads 2 --head-dim 16 \\
        --prompt-len 8 --min-len 4 --max-len 64 --iters 1    # CPU smoke run (needs triton importable)

One full-length layer's decode attention, as :class:`spmd_rl.rollout.fast.FastDecoder` calls it, on a
random cache of the decoder's layout ``[rows, slots, kv_heads, head_dim]`` (slots = prompt + longest
length, rounded up to 64). A snapshot of a long-tail step: row ``i`` has a response of length ``L_i``
drawn log-uniform in ``[--min-len, --max-len]`` and stands at a uniform point of it, so its context is
``prompt + u_i L_i`` slots after 0-15 slots of left padding; the ``fixed`` snapshot has every row at
``prompt + --fixed-len / 2``. Paths: ``sdpa`` (the decoder's masked SDPA over the step's span, a power
of two above every row's last slot; the additive mask, built once per step, is not timed), ``triton``
(:func:`spmd_rl.rollout.decode_attention.decode_attention`, each row's own entries) and ``varlen``
(torch's flash varlen, where its ``varlen_attn`` takes ``seqused_k`` / ``enable_gqa``). Each prints the
max abs difference to a float32 per-row SDPA reference, the time of one call (CUDA events, mean of
``--iters`` after a warm-up), that times ``--layers`` (the step's attention) and the K/V bytes of the
rows' own entries per second (the bytes a decode must read; SDPA reads the whole span).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spmd_rl.rollout import decode_attention as da  # noqa: E402
from spmd_rl.rollout import fast  # noqa: E402


def snapshot(rows: int, args: argparse.Namespace, *, mix: str, device: torch.device):
    """``(start, end, span, slots)``: each row's first and past-last slot of one step."""
    gen = torch.Generator().manual_seed(rows)
    pad = torch.randint(0, 16, (rows,), generator=gen)
    if mix == "fixed":
        context = torch.full((rows,), args.prompt_len + args.fixed_len // 2)
        longest = args.fixed_len
    else:
        lo, hi = math.log(args.min_len), math.log(args.max_len)
        lengths = (torch.rand(rows, generator=gen) * (hi - lo) + lo).exp()
        context = args.prompt_len + (torch.rand(rows, generator=gen) * lengths).long() + 1
        longest = args.max_len
    slots = -(-(16 + args.prompt_len + longest) // 64) * 64
    end = pad + context
    span = min(max(128, 1 << int(end.max() - 1).bit_length()), slots)
    return pad.to(device, torch.int32), end.to(device, torch.int32), span, slots


def timed(fn, iters: int, device: torch.device) -> float:
    """Seconds per call (CUDA events on GPU), after one warm-up call."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    done.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(done) / 1e3 / iters


def measure(rows: int, mix: str, args: argparse.Namespace, *, device: torch.device, dtype: torch.dtype,
            paths: list[str]) -> list[tuple]:
    """One snapshot's rows of the table: ``(rows, mix, span, mean context, path, max |diff|, seconds)``."""
    start, end, span, slots = snapshot(rows, args, mix=mix, device=device)
    group, scale = args.heads // args.kv_heads, args.head_dim ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    qk = torch.randn(rows, args.heads + args.kv_heads, args.head_dim, generator=gen, device=device).to(dtype)
    q = qk[:, :args.heads]  # a strided view, as the decoder passes it
    k = torch.randn(rows, slots, args.kv_heads, args.head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(rows, slots, args.kv_heads, args.head_dim, generator=gen, device=device).to(dtype)
    ref = da.reference(q, k, v, start, end, scale=scale)
    slot_ids = torch.arange(span, device=device)
    valid = (slot_ids[None] >= start[:, None].long()) & (slot_ids[None] < end[:, None].long())
    bias = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))[:, None, None]
    cu_k = (torch.arange(rows + 1, device=device) * slots + torch.cat([start, start[:1] * 0])).int()
    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            q.unflatten(1, (args.kv_heads, group)), k[:, :span].transpose(1, 2), v[:, :span].transpose(1, 2),
            attn_mask=bias, scale=scale).flatten(1, 2),
        "triton": lambda: da.decode_attention(q, k, v, start, end, scale=scale, span=span),
        "varlen": lambda: da.varlen_attn(
            q.contiguous(), k.flatten(0, 1), v.flatten(0, 1), torch.arange(rows + 1, device=device).int(), cu_k, 1,
            span, scale=scale, enable_gqa=True, seqused_k=(end - start).int()),
    }
    out = []
    for path in paths:
        with sdpa_kernel(fast.ATTENTION_BACKENDS):
            diff = (calls[path]().float() - ref).abs().max().item()
            seconds = timed(calls[path], args.iters, device)
        out.append((rows, mix, span, int((end - start).float().mean()), path, diff, seconds))
        print(f"rows {rows} {mix}: {path} max abs diff {diff:.2e}, {1e3 * seconds:.3f} ms / layer", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 16], help="decoding rows (batch bucket)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28, help="full-length layers per step (the step's attention)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--fixed-len", type=int, default=256, help="new tokens of the fixed snapshot")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and da.triton is not None
    shape = {"dtype": dtype, "device": device, "heads": args.heads, "kv_heads": args.kv_heads,
             "head_dim": args.head_dim}
    paths = ["sdpa"] + [p for p, ok in (("triton", da.decode_attention_works(**shape) or interpreted),
                                         ("varlen", da.varlen_works(**shape))) if ok]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, triton {getattr(da.triton, '__version__', 'absent')}, "
          f"{dtype}; {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, {args.layers} layers, "
          f"{args.prompt_len}-token prompts, long tail {args.min_len}-{args.max_len}; paths {', '.join(paths)}",
          flush=True)
    table = []
    for rows in args.rows:
        for mix in ("longtail", "fixed"):
            table += measure(rows, mix, args, device=device, dtype=dtype, paths=paths)
    print(f"\n{'rows':>5} {'mix':>8} {'span':>5} {'mean ctx':>8} {'path':>6} {'max |diff|':>10} {'ms / layer':>10} "
          f"{'ms / step':>9} {'own K/V TB/s':>12} {'vs sdpa':>7}")
    for rows, mix, span, ctx, path, diff, seconds in table:
        sdpa = next(s for r, m, *_, p, _, s in table if (r, m, p) == (rows, mix, "sdpa"))
        own = rows * ctx * args.kv_heads * args.head_dim * 2 * (2 if dtype != torch.float32 else 4)
        print(f"{rows:5d} {mix:>8} {span:5d} {ctx:8d} {path:>6} {diff:10.2e} {1e3 * seconds:10.3f} "
              f"{1e3 * seconds * args.layers:9.2f} {own / seconds / 1e12:12.2f} {sdpa / seconds:6.1f}x")


if __name__ == "__main__":
    main()
