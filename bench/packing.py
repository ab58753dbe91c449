"""Actor-update throughput: padded vs packed micro-batches, fixed vs token-budget, one process.

    python bench/packing.py                                   # CPU: tiny-random 4 x 256, 64 responses
    python bench/packing.py --model smollm2-135m-instruct --rows 512 --prompt-len 64 256 \
        --max-response 1024 --micro-batch-size 16 --max-tokens-per-gpu 16384      # GPU (bf16 compute)

A synthetic GRPO mini-batch with a realistic response-length spread (log-normal around 30% of
``--max-response``, clipped at it, so a few responses hit the limit as truncated rollouts do;
``--n`` responses share each prompt) goes through ``FSDPEngine.train_mini_batch`` with the real
objective (PPO clip + KL + entropy), once per layout. Throughput counts real tokens (prompt +
valid response) per second of update, so padding shows up as lost throughput; the table also
gives the grid tokens the model actually ran (rows x width summed over micro-batches) and, on
GPU, the peak memory. Timings are the median of ``--repeats`` updates after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import random_grpo_batch, resolve_bench_model  # noqa: E402
from spmd_rl.algo.objective import actor_objective  # noqa: E402
from spmd_rl.config import ActorConfig, AlgoConfig, FsdpConfig  # noqa: E402
from spmd_rl.data.batch import RolloutBatch  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.engine import packing  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402


def make_batch(args: argparse.Namespace, vocab: int) -> RolloutBatch:
    return random_grpo_batch(rows=args.rows, n=args.n, vocab=vocab, prompt_len=tuple(args.prompt_len),
                             response_median=max(args.max_response * 0.3, 1.0), response_min=4,
                             response_max=args.max_response, sigma=0.7, logprob=-2.0, seed=args.seed)


def grid_tokens(engine: FSDPEngine, micros: list[RolloutBatch]) -> int:
    total = 0
    for m in micros:
        flat = packing.flatten(m, pad_token_id=0, packed=engine.use_packing)
        total += flat.input_ids.numel()
    return total


def run_mode(name: str, *, packed: bool, budget: int | None, args: argparse.Namespace, folder: str,
             env: DistEnv, batch: RolloutBatch) -> dict[str, object]:
    mesh = FsdpLayout(1).build(env.device.type)
    engine = FSDPEngine(model_folder=folder, mesh=mesh, device=env.device, fsdp=FsdpConfig(),
                        actor=ActorConfig(lr=1e-6, grad_clip=1.0), total_updates=10 ** 6, trainable=True,
                        gradient_checkpointing=args.gradient_checkpointing, pad_token_id=0,
                        use_packing=packed, max_tokens_per_gpu=budget)
    algo = AlgoConfig(use_kl_loss=True, kl_coef=0.01, entropy_coef=0.0)
    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))
    dev = env.device

    def loss_fn(logprobs, entropy, micro):
        return actor_objective(logprobs, entropy, old_logprobs=micro["old_logprobs"].to(dev),
                               advantages=micro["advantages"].to(dev), response_mask=micro["response_mask"].to(dev),
                               ref_logprobs=micro["ref_logprobs"].to(dev), algo=algo,
                               global_tokens=tokens, global_seqs=seqs)

    micros = engine.micro_batches(batch, micro_batch_size=args.micro_batch_size)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seconds = []
    for i in range(args.repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        engine.train_mini_batch(micros, loss_fn, temperature=1.0, need_entropy_grad=False)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:  # the first update warms up (allocator, kernels, lazy FSDP init)
            seconds.append(time.perf_counter() - start)
    real = packing.row_tokens(batch)
    s = statistics.median(seconds)
    row = {"mode": name, "micro_batches": len(micros), "real_tokens": sum(real), "grid_tokens": grid_tokens(engine, micros),
           "seconds": s, "tokens_per_s": sum(real) / s}
    if dev.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    del engine
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-random", help="tiny-random, smollm2-135m-instruct or a local HF folder")
    p.add_argument("--tiny", type=int, nargs=4, default=[4, 256, 4, 2], metavar=("LAYERS", "HIDDEN", "HEADS", "KV"),
                   help="tiny-random shape")
    p.add_argument("--rows", type=int, default=64, help="responses in the mini-batch")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    p.add_argument("--max-response", type=int, default=384, help="rollout.max_new_tokens")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="also time token-budget micro-batches (default: 8 x the longest sequence)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append the rows as JSON lines to this file")
    args = p.parse_args(argv)

    env = DistEnv.from_environ().init(device=args.device)
    folder = resolve_bench_model(args.model, args.tiny)
    from transformers import AutoConfig

    batch = make_batch(args, vocab=AutoConfig.from_pretrained(folder).vocab_size)
    real = packing.row_tokens(batch)
    budget = args.max_tokens_per_gpu or 8 * max(real)
    lengths = batch["response_mask"].sum(1)
    print(f"device {env.device}, model {args.model}, {args.rows} responses: response length median "
          f"{lengths.median().item():.0f}, max {lengths.max().item():.0f} ({(lengths == args.max_response).sum().item()} "
          f"clipped), prompt {args.prompt_len[0]}-{args.prompt_len[1]}; {sum(real)} real tokens; "
          f"micro-batch {args.micro_batch_size} rows or {budget} tokens", flush=True)
    rows = []
    for name, packed, b in (("padded", False, None), ("packed", True, None),
                            ("padded+dynamic", False, budget), ("packed+dynamic", True, budget)):
        rows.append(run_mode(name, packed=packed, budget=b, args=args, folder=folder, env=env, batch=batch))
        r = rows[-1]
        print(f"{name:16s} {r['micro_batches']:3d} micro-batches  grid tokens {r['grid_tokens']:7d} "
              f"({r['grid_tokens'] / r['real_tokens']:.2f}x real)  {r['seconds']:7.3f} s  {r['tokens_per_s']:9.0f} tokens/s"
              + (f"  peak {r['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in r else ""), flush=True)
    base = rows[0]["tokens_per_s"]
    print("throughput vs padded: " + ", ".join(f"{r['mode']} {r['tokens_per_s'] / base:.2f}x" for r in rows))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "device": str(env.device), "model": args.model, "rows": args.rows,
                                    "max_response": args.max_response, "ratio_vs_padded": r["tokens_per_s"] / base}) + "\n")
    env.shutdown()


if __name__ == "__main__":
    main()
