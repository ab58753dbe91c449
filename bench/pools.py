"""Weights from the actor pool to a rollout pool: seconds and GB/s per transfer, next to the colocated
hot-swap of the same model in one process.

    torchrun --nproc-per-node 2 bench/pools.py --colocate 2     # one GPU: actor + rollout process, CUDA IPC
    torchrun --nproc-per-node 2 bench/pools.py                  # two GPUs: one per pool, NCCL broadcast
    torchrun --nproc-per-node 2 bench/pools.py --device cpu --shapes tiny   # CPU smoke run (gloo)

Rank 0 holds the actor (an FSDP engine on a one-rank mesh, as the global pool of one), rank 1 the
rollout engine (the built-in one), as ``--pools.rollout-ranks 1`` lays them out. One transfer is
``WeightBridge.send(actor.named_full_tensors(bf16))`` on rank 0 and ``rollout.load_weights(
bridge.receive())`` on rank 1, what the trainer's ``weight_sync`` stage runs after every update;
the median of ``--repeats`` after a warm-up. "colocated" is ``rollout.load_weights(
actor.named_full_tensors(bf16))`` with both engines in rank 0's process, the hot-swap of a
colocated rollout. The check column says whether the rollout's weights equal the actor's bit for
bit after the transfer. ``--out`` appends the rows as JSON lines.
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
from spmd_rl.distributed.bridge import WeightBridge  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.rollout import build_rollout  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def bench_shape(shape: str, args: argparse.Namespace, env: DistEnv, bridge: WeightBridge) -> dict | None:
    from spmd_rl.engine.fsdp import FSDPEngine

    folder = model_folder(shape, root=args.models)
    dev = env.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    mesh = FsdpLayout(1).build(dev.type, start=0)  # collective: every rank builds it, rank 0 is in it
    actor = rollout = local = None
    if env.rank == 0:
        actor = FSDPEngine(model_folder=folder, mesh=mesh, device=dev, fsdp=FsdpConfig(), actor=ActorConfig(lr=1e-6),
                           trainable=True, pad_token_id=0)
        with torch.no_grad():  # differ from the rollout's copy read from disk, so a transfer is visible
            for p in actor.model.parameters():
                p.mul_(1.5)
        local = build_rollout("native", model_folder=folder, device=dev, dtype=dtype, batch_size=64,
                              pad_token_id=0, eos_token_ids=[2])
    else:
        rollout = build_rollout("native", model_folder=folder, device=dev, dtype=dtype, batch_size=64,
                                pad_token_id=0, eos_token_ids=[2])
    seconds, colocated, sent = [], [], 0
    for i in range(args.repeats + 1):
        _sync(dev)
        start = time.perf_counter()
        if env.rank == 0:
            sent = bridge.send(actor.named_full_tensors(dtype=dtype)).bytes
        else:
            rollout.load_weights(bridge.receive())
        _sync(dev)
        if i:
            seconds.append(time.perf_counter() - start)
        if env.rank == 0:  # the colocated hot-swap of the same model, for comparison
            start = time.perf_counter()
            local.load_weights(actor.named_full_tensors(dtype=dtype))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i:
                colocated.append(time.perf_counter() - start)
    # bit for bit: the rollout's tensors against the actor's, sent over the same bridge once more
    if env.rank == 0:
        bridge.send(actor.named_full_tensors(dtype=dtype))
        same = None
    else:
        mine = dict(rollout.model.named_parameters())
        same = all(torch.equal(mine[name].data, t) for name, t in bridge.receive() if name in mine)
    checks: list = [None, None]
    dist.all_gather_object(checks, same)
    for engine in (local, rollout):
        if engine is not None:
            engine.close()
    del actor, rollout, local
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if env.rank != 0:
        return None
    s, c = statistics.median(seconds), statistics.median(colocated)
    return {"shape": shape, "mode": bridge.mode, "gib": sent / 2 ** 30, "seconds": s, "gb_per_s": sent / s / 1e9,
            "colocated_seconds": c, "ratio": s / c, "bit_for_bit": bool(checks[1])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2-0.5b", "qwen2-1.5b"], help="see bench/shapes.py")
    p.add_argument("--colocate", type=int, default=1, help="processes per GPU (2: both on one GPU, CUDA IPC)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mib", type=int, default=512)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--models", default=default_root())
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    env = DistEnv.from_environ().init(device=args.device, colocate=args.colocate)
    if env.world_size != 2:
        raise SystemExit("bench/pools.py runs on 2 processes: torchrun --nproc-per-node 2 bench/pools.py")
    ipc = args.colocate > 1 and env.device.type == "cuda"
    group = dist.new_group([0, 1], backend="gloo" if ipc else None)
    bridge = WeightBridge(group=group, sender=0, device=env.device, mode="ipc" if ipc else "broadcast",
                          bucket_bytes=args.bucket_mib << 20)
    if env.is_main:
        name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
        print(f"pool weight transfer: 2 processes, {args.colocate} per device, {name}; median of {args.repeats}")
        print(f"{'shape':11s} {'mode':>9s} {'GiB':>6s} {'seconds':>8s} {'GB/s':>7s} {'colocated s':>11s} "
              f"{'ratio':>6s} bit-for-bit", flush=True)
    for shape in args.shapes:
        r = bench_shape(shape, args, env, bridge)
        if r is not None:
            print(f"{shape:11s} {r['mode']:>9s} {r['gib']:6.2f} {r['seconds']:8.3f} {r['gb_per_s']:7.1f} "
                  f"{r['colocated_seconds']:11.3f} {r['ratio']:6.2f} {r['bit_for_bit']}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    env.shutdown()


if __name__ == "__main__":
    main()
