"""Asynchronous GRPO: the same GRPO work at max staleness 0, 1, 2 on a rollout pool, with samples/s,
each pool's idle fraction, and the speed-up the schedule's model (``bench/async_sim.py``) predicts
from the synchronous run's measured times and the response-length distribution.

    python bench/async.py                                         # one GPU: actor + rollout process (colocate 2)
    python bench/async.py --nproc 2 --colocate 1                  # two GPUs: one per pool
    python bench/async.py --length-dist lognormal --min-new-tokens 64 --max-new-tokens 2048   # long tail
    python bench/async.py --length-dist lognormal --partial       # S > 0 with partial rollouts
    python bench/async.py --length-dist lognormal --stream both   # S > 0 by rounds and with streamed groups
    python bench/async.py --length-dist lognormal --stream on --stage-weights both   # streamed, weights staged or not
    python bench/async.py --device cpu --model tiny-random --max-new-tokens 48 --prompts 8   # CPU smoke run

Each staleness is one ``torchrun -m spmd_rl.train`` with ``--pools.rollout-ranks`` = half the
processes, the same seed and work (``--prompts`` x ``--n`` responses, ``--rollout.ignore-eos``;
every response ``--max-new-tokens`` long, or with ``--length-dist lognormal|uniform`` a length drawn
per response between ``--min-new-tokens`` and ``--max-new-tokens``, ``rollout.length_dist``),
truncated IS on. Per run: the median over steps 3.. of the step time, samples/s,
``async/actor_idle_frac`` (the actor waiting for rows or for the rollout to take its weights) and
``async/rollout_idle_frac``, the share of rows continued under newer weights (``--partial``) and the
mean score of the last steps. ``--stream on`` runs S > 0 with ``rollout.stream`` (groups taken as
they complete), ``--stream both`` each S > 0 both ways (rows marked ``s``); ``--stage-weights``
likewise with ``rollout.stage_weights`` (rows marked ``w``: the actor's weight sync does not wait
for the round in progress or the stream's drain). "model" is the speed-up ``bench/async_sim.py`` predicts from the
synchronous run's generation, actor and weight-sync times and the length distribution, for two pools
that share nothing; on one GPU the two processes share its compute and memory bandwidth, so the
measured speed-up stays below it. "tok/s/GPU" is the end-to-end figure peers publish: the step's
prompt and response tokens (what the update trains on, each response generated once) per second of
the step, over the run's GPUs (``perf/tokens_per_s_per_gpu``); "gen / logp / update / sync" the
medians of the synchronous stages (``timing_s/gen``, ``old_logprob`` + ``ref``, ``update``,
``weight_sync``; at S > 0 the actor's waits instead of gen). ``--model`` takes a bench/shapes.py
name too (random weights of that shape, built under ``--root``). ``--out`` appends the rows as JSON lines.

    python bench/async.py --model qwen3-1.7b --prompts 32 --n 8 --length-dist lognormal --min-new-tokens 64 \
        --max-new-tokens 2048 --batch-size 256 --micro-batch 16 --staleness 0 1 --steps 6   # e2e tok/s per GPU
    python bench/async.py --model qwen2.5-7b --prompts 32 --n 8 --length-dist lognormal --min-new-tokens 64 \
        --max-new-tokens 2048 --batch-size 256 --micro-batch 8 --staleness 0 1 --steps 4 \
        --actor.lora.rank 16 --actor.lora.alpha 32 --actor.use-packing --actor.max-tokens-per-gpu 6144   # 7B, one GPU

Flags this script does not know (``--actor.*``, ``--rollout.*``, ...) go to every ``spmd_rl.train`` run
as they are, after the script's own.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_sim import Costs, predict, round_drawer  # noqa: E402 - bench/ on the path first
from shapes import SHAPES, model_folder  # noqa: E402


def run(staleness: int, args: argparse.Namespace, out_dir: str, *, stream: bool = False,
        staged: bool = False, train_flags: tuple[str, ...] = ()) -> list[dict]:
    flags = ["--model.path", args.model, "--data.train-batch-size", str(args.prompts), "--rollout.n", str(args.n),
             "--rollout.max-new-tokens", str(args.max_new_tokens), "--rollout.ignore-eos",
             "--actor.ppo-mini-batch-size", str(args.prompts), "--actor.micro-batch-size", str(args.micro_batch),
             "--pools.rollout-ranks", str(args.nproc // 2), "--pools.colocate", str(args.colocate),
             "--trainer.max-staleness", str(staleness), "--algo.rollout-is", "token_truncated",
             "--rollout.batch-size", str(args.batch_size), "--rollout.length-dist", args.length_dist,
             "--rollout.min-new-tokens", str(min(args.min_new_tokens, args.max_new_tokens)),
             *(["--rollout.partial"] if args.partial and staleness else []),
             *(["--rollout.stream"] if stream and staleness else []),
             *(["--rollout.stage-weights"] if staged and staleness else []),
             "--trainer.total-steps", str(args.steps), "--trainer.val-every", "0", "--trainer.device", args.device,
             "--logging.wandb", "off", "--logging.no-console", "--checkpoint.no-save-final",
             "--trainer.output-dir", out_dir, *train_flags]
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
    p.add_argument("--model", default="smollm2-135m-instruct", help="--model.path, or a bench/shapes.py shape")
    p.add_argument("--root", default=os.path.expanduser("~/.cache/spmd_rl/bench_models"),
                   help="where a --model shape's random-weight folder is built")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--nproc", type=int, default=2, help="processes: half actor, half rollout")
    p.add_argument("--colocate", type=int, default=2, help="processes per device (2: both pools on one GPU)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--length-dist", default="model", choices=["model", "lognormal", "uniform"],
                   help="response lengths: all --max-new-tokens (model, with ignore-EOS) or drawn per response")
    p.add_argument("--min-new-tokens", type=int, default=64, help="shortest drawn response")
    p.add_argument("--partial", action="store_true", help="S > 0 with rollout.partial")
    p.add_argument("--stream", default="off", choices=["off", "on", "both"],
                   help="S > 0 with rollout.stream (on), or both ways (both)")
    p.add_argument("--stage-weights", default="off", choices=["off", "on", "both"],
                   help="S > 0 with rollout.stage_weights (on), or both ways (both)")
    p.add_argument("--batch-size", type=int, default=64, help="rollout.batch_size")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=None)
    args, train_flags = p.parse_known_args(argv)
    if train_flags and not train_flags[0].startswith("--"):
        p.error(f"unrecognized arguments: {' '.join(train_flags)}")
    if args.model in SHAPES:
        args.model = model_folder(args.model, root=args.root)
    if args.partial and args.stage_weights != "off":
        p.error("--partial loads weights mid-round and --stage-weights after it: choose one")
    lengths = (f"{args.max_new_tokens}" if args.length_dist == "model"
               else f"{args.length_dist} {args.min_new_tokens}..{args.max_new_tokens}")
    print(f"async GRPO: {args.model}, {args.prompts} prompts x {args.n} x {lengths} tokens, "
          f"{args.nproc} processes ({args.colocate} per device){', partial rollouts' if args.partial else ''}, "
          f"median of steps 3..{args.steps}{(', ' + ' '.join(train_flags)) if train_flags else ''}")
    print(f"{'staleness':>9s} {'s/step':>7s} {'samples/s':>9s} {'tok/s/GPU':>9s} {'speed-up':>8s} {'model':>6s} "
          f"{'actor idle':>10s} {'rollout idle':>12s} {'partial':>7s} {'score':>6s} {'gen / logp / update / sync s':>28s}",
          flush=True)
    base, predicted_steps = None, {}
    # one rollout replica's rows per round (each of the nproc / 2 replicas generates its share)
    draw = round_drawer(length_dist=args.length_dist, low=min(args.min_new_tokens, args.max_new_tokens),
                        high=args.max_new_tokens, rows=args.prompts * args.n // max(args.nproc // 2, 1))
    with tempfile.TemporaryDirectory() as tmp:
        ways = {"off": [False], "on": [True], "both": [False, True]}
        variants = [(stream, staged) for stream in ways[args.stream] for staged in ways[args.stage_weights]]
        for s, (stream, staged) in [(s, v) for s in args.staleness for v in (variants if s else [(False, False)])]:
            mark = "s" * stream + "w" * staged
            rows = [r for r in run(s, args, os.path.join(tmp, f"s{s}{mark}"), stream=stream, staged=staged,
                                      train_flags=tuple(train_flags))
                    if r["step"] >= 3]
            med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
            step = med("timing_s/step")
            if s == 0:
                gen, sync = med("timing_s/gen"), med("timing_s/weight_sync")
                costs = Costs.calibrate(gen_s=gen, actor_s=step - gen - sync, weight_sync_s=sync,
                                        rounds=[draw(k) for k in range(50)], batch_size=args.batch_size)
                predicted_steps = predict(costs, staleness=args.staleness, partial=args.partial, draw=draw)
                base = step
            speed = base / step if base else float("nan")
            if s == 0:  # synchronous: the actor waits while the rollout generates, and the other way round
                idle = ((gen + sync) / step, 1.0 - gen / step)
            else:
                idle = (med("async/actor_idle_frac"), med("async/rollout_idle_frac"))
            row = {"staleness": s, "stream": stream, "stage_weights": staged, "s_per_step": step,
                   "samples_per_s": args.prompts * args.n / step, "speedup": speed,
                   "model_speedup": predicted_steps[0] / predicted_steps[s] if predicted_steps else None,
                   "actor_idle_frac": idle[0], "rollout_idle_frac": idle[1], "partial_frac": med("async/partial_frac"),
                   "score_last": statistics.mean(r["critic/score/mean"] for r in rows[-3:]),
                   "tokens_per_s": med("perf/tokens_per_s"), "tokens_per_s_per_gpu": med("perf/tokens_per_s_per_gpu"),
                   "stages_s": {"gen": med("timing_s/gen"), "wait": med("timing_s/wait_rollout") + med("timing_s/wait_weights"),
                                "logprobs": med("timing_s/old_logprob") + med("timing_s/ref"),
                                "update": med("timing_s/update"), "weight_sync": med("timing_s/weight_sync")}}
            st = row["stages_s"]
            split = " / ".join(f"{st[k]:.2f}" for k in ("gen" if s == 0 else "wait", "logprobs", "update", "weight_sync"))
            per_gpu = f"{row['tokens_per_s_per_gpu']:9.0f}" if row["tokens_per_s_per_gpu"] else "        -"
            predicted = f"{row['model_speedup']:6.2f}" if row["model_speedup"] else "     -"
            print(f"{f'{s} {mark}'.strip():>9s} {step:7.3f} {row['samples_per_s']:9.1f} {per_gpu} {speed:8.2f} {predicted} "
                  f"{idle[0]:10.2f} {idle[1]:12.2f} {row['partial_frac']:7.2f} {row['score_last']:6.3f} {split:>28s}",
                  flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
