"""Asynchronous GRPO: the same GRPO work at max staleness 0, 1, 2 on a rollout pool, with samples/s,
each pool's idle fraction, and the speed-up a simple model predicts from the synchronous run.

    python bench/async.py                                         # one GPU: actor + rollout process (colocate 2)
    python bench/async.py --nproc 2 --colocate 1                  # two GPUs: one per pool
    python bench/async.py --device cpu --model tiny-random --max-new-tokens 48 --prompts 8   # CPU smoke run

Each staleness is one ``torchrun -m spmd_rl.train`` with ``--pools.rollout-ranks`` = half the
processes, the same seed and work (``--prompts`` x ``--n`` responses of ``--max-new-tokens``,
``--rollout.ignore-eos`` so every response has that length), truncated IS on. Per run: the median
over steps 3.. of the step time, samples/s, ``async/actor_idle_frac`` (the actor waiting for rows
or for the rollout to take its weights) and ``async/rollout_idle_frac``, and the mean score of the
last steps. "model" is the step time the one-step-off schedule would reach if generation and the
update shared nothing: ``max(gen, step - gen - weight_sync) + weight_sync`` from the synchronous
run's own stage times; on one GPU the two processes share its compute and memory bandwidth, so
the measured step stays above it. ``--out`` appends the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(staleness: int, args: argparse.Namespace, out_dir: str) -> list[dict]:
    flags = ["--model.path", args.model, "--data.train-batch-size", str(args.prompts), "--rollout.n", str(args.n),
             "--rollout.max-new-tokens", str(args.max_new_tokens), "--rollout.ignore-eos",
             "--actor.ppo-mini-batch-size", str(args.prompts), "--actor.micro-batch-size", str(args.micro_batch),
             "--pools.rollout-ranks", str(args.nproc // 2), "--pools.colocate", str(args.colocate),
             "--trainer.max-staleness", str(staleness), "--algo.rollout-is", "token_truncated",
             "--trainer.total-steps", str(args.steps), "--trainer.val-every", "0", "--trainer.device", args.device,
             "--logging.wandb", "off", "--logging.no-console", "--checkpoint.no-save-final",
             "--trainer.output-dir", out_dir]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           "-m", "spmd_rl.train", *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"staleness {staleness} failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "timing_s/step" in line]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="--model.path")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--nproc", type=int, default=2, help="processes: half actor, half rollout")
    p.add_argument("--colocate", type=int, default=2, help="processes per device (2: both pools on one GPU)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(f"async GRPO: {args.model}, {args.prompts} prompts x {args.n} x {args.max_new_tokens} tokens, "
          f"{args.nproc} processes ({args.colocate} per device), median of steps 3..{args.steps}")
    print(f"{'staleness':>9s} {'s/step':>7s} {'samples/s':>9s} {'speed-up':>8s} {'model':>6s} {'actor idle':>10s} "
          f"{'rollout idle':>12s} {'score':>6s}", flush=True)
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.staleness:
            rows = [r for r in run(s, args, os.path.join(tmp, f"s{s}")) if r["step"] >= 3]
            med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
            step = med("timing_s/step")
            if s == 0:
                gen, sync = med("timing_s/gen"), med("timing_s/weight_sync")
                base, model = step, max(gen, step - gen - sync) + sync
            speed = base / step if base else float("nan")
            if s == 0:  # synchronous: the actor waits while the rollout generates, and the other way round
                idle = ((gen + sync) / step, 1.0 - gen / step)
            else:
                idle = (med("async/actor_idle_frac"), med("async/rollout_idle_frac"))
            row = {"staleness": s, "s_per_step": step, "samples_per_s": args.prompts * args.n / step, "speedup": speed,
                   "model_speedup": base / model if base and s else None, "actor_idle_frac": idle[0],
                   "rollout_idle_frac": idle[1], "score_last": statistics.mean(r["critic/score/mean"] for r in rows[-3:])}
            predicted = f"{row['model_speedup']:6.2f}" if row["model_speedup"] else "     -"
            print(f"{s:9d} {step:7.3f} {row['samples_per_s']:9.1f} {speed:8.2f} {predicted} {idle[0]:10.2f} "
                  f"{idle[1]:12.2f} {row['score_last']:6.3f}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
