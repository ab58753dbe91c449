"""Weight hot-swap timing: FSDP actor shards -> the rollout engine, as the trainer does it each step.

    python bench/hotswap.py                                  # one GPU, Qwen2-0.5B shape (goal < 0.5 s)
    torchrun --nproc-per-node 2 bench/hotswap.py             # shards over 2 GPUs: a gather per tensor
    python bench/hotswap.py --shapes tiny --device cpu       # CPU smoke run

Times ``rollout.load_weights(actor.named_full_tensors(dtype=bf16))`` (the trainer's
``sync_weights``) after a warm-up swap, median of ``--repeats``: each parameter is gathered from its
FSDP shards (one all-gather per tensor), cast to the rollout dtype and copied into the rollout
engine's own weights, one tensor at a time. "extra peak" is how far device memory rose above what
the two engines already hold during the swap: one full tensor (plus its cast) when the swap
streams, the whole model if it copied everything first. The rollout engine is whatever
``build_rollout("native", ...)`` builds by default. ``--out`` appends the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import default_root, model_folder  # noqa: E402

from spmd_rl.config import ActorConfig, FsdpConfig  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402
from spmd_rl.rollout import build_rollout  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def bench_shape(shape: str, args: argparse.Namespace, env: DistEnv) -> dict[str, object]:
    folder = model_folder(shape, root=args.models)
    dev = env.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    actor = FSDPEngine(model_folder=folder, mesh=FsdpLayout(env.world_size).build(dev.type), device=dev,
                       fsdp=FsdpConfig(), actor=ActorConfig(lr=1e-6), trainable=True, pad_token_id=0)
    rollout = build_rollout("native", model_folder=folder, device=dev, dtype=dtype, batch_size=64, pad_token_id=0,
                            eos_token_ids=[2])
    with torch.no_grad():  # make the actor differ from the rollout's copy, so a swap is visible
        for p in actor.model.parameters():
            p.mul_(1.5)
    nbytes = sum(t.numel() * t.element_size() for _, t in actor.named_full_tensors(dtype=dtype))
    largest = max(t.numel() * t.element_size() for _, t in actor.named_full_tensors(dtype=dtype))
    seconds, extra = [], 0
    for i in range(args.repeats + 1):
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
        start = time.perf_counter()
        rollout.load_weights(actor.named_full_tensors(dtype=dtype))
        _sync(dev)
        if i:
            seconds.append(time.perf_counter() - start)
        if dev.type == "cuda":
            extra = max(extra, torch.cuda.max_memory_allocated(dev) - before)
    # the swap really happened: the rollout's embedding is the actor's (scaled) one
    name, full = next(iter(actor.named_full_tensors(dtype=dtype)))
    target = dict(rollout.model.named_parameters())[name] if hasattr(rollout, "model") else None
    swapped = bool(torch.equal(target.to(full.device), full)) if target is not None else None
    s = statistics.median(seconds)
    row = {"shape": shape, "gpus": env.world_size, "seconds": s, "gib": nbytes / 2 ** 30, "gib_per_s": nbytes / 2 ** 30 / s,
           "largest_tensor_gib": largest / 2 ** 30, "extra_peak_gib": extra / 2 ** 30 if dev.type == "cuda" else None,
           "rollout": type(rollout).__name__, "swapped": swapped}
    rollout.close()
    del actor, rollout
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2-0.5b"], help="see bench/shapes.py")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--models", default=default_root())
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    env = DistEnv.from_environ().init(device=args.device)
    if env.is_main:
        name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
        print(f"hot-swap bench: {env.world_size} x {name}, median of {args.repeats}")
        print(f"{'shape':11s} {'gpus':>4s} {'rollout':>14s} {'GiB':>6s} {'seconds':>8s} {'GiB/s':>7s} "
              f"{'largest GiB':>11s} {'extra peak GiB':>14s} swapped", flush=True)
    for shape in args.shapes:
        r = bench_shape(shape, args, env)
        if env.is_main:
            extra = f"{r['extra_peak_gib']:14.3f}" if r["extra_peak_gib"] is not None else "             -"
            print(f"{shape:11s} {r['gpus']:4d} {r['rollout']:>14s} {r['gib']:6.2f} {r['seconds']:8.3f} "
                  f"{r['gib_per_s']:7.1f} {r['largest_tensor_gib']:11.3f} {extra} {r['swapped']}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    env.shutdown()


if __name__ == "__main__":
    main()
