"""A whole GRPO step: this trainer vs TRL's ``GRPOTrainer`` (``use_vllm`` off), same work, one table.

    python bench/grpo_step.py                     # one GPU: Qwen2-0.5B shape, 16 prompts x 8, 64 + 128 tokens
    python bench/grpo_step.py --shape tiny --prompts 2 --n 4 --prompt-len 16 --new-tokens 16 --steps 2 \
        --micro-batch-size 4 --device cpu         # CPU smoke run (TRL needs `pip install trl`; not a dependency)
    python bench/grpo_step.py --only ours         # without TRL
    python bench/grpo_step.py --only ours --ours-compile --profile --ours-extra='--rollout.sleep-level 0'
                                                  # compiled layers, cache kept, per-stage profile of the last step

Both sides run in this process, one after the other, on the same random-weight model folder
(``bench/shapes.py``: fp32 master weights, bf16 compute on GPU), the same prompts (``--prompts``
chats of exactly ``--prompt-len`` tokens after the chat template), ``--n`` samples per prompt at
temperature 1 (top-k 0, top-p 1) of exactly ``--new-tokens`` tokens (EOS ignored: ours with
``--rollout.ignore-eos``, TRL ``min_new_tokens``), a random reward, KL to a reference model
(``beta`` = ``algo.kl_coef`` = 0.001, so both run the reference forward), one optimizer step per
GRPO step over all ``prompts x n`` responses in micro-batches of ``--micro-batch-size``, no
gradient checkpointing, no old-log-prob pass (one update per batch). Step time is the median over
steps 2..``--steps`` (step 1 warms up): ours from ``timing_s/step`` of the trainer's metrics, TRL's
as the wall time between consecutive optimizer steps (``on_step_end``), which holds its generation,
reward, reference pass and update. The ratio is TRL's step time over ours.

Ours runs with the trainer's defaults for the rollout backend (``native``) and the actor (FSDP2,
packing on as ``--packing``), so re-running this after an engine change measures that change.
TRL runs on one process; ours under ``torchrun --nproc-per-node K`` spreads the same global batch
over K GPUs (``--only ours``): compare with the 1-GPU row for the 2-GPU scaling.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import default_root, model_folder  # noqa: E402

KL_COEF = 0.001


def bench_reward(prompts, completions, **_: object) -> list[float]:
    """A random score per completion (both trainers): advantages are non-zero, the work is the same."""
    return [random.random() for _ in completions]


def write_prompts(path: str, count: int, content_len: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(content_len))
            f.write(json.dumps({"prompt": text, "answer": "0"}) + "\n")


def run_ours(args: argparse.Namespace, folder: str, data: str, out_dir: str) -> dict[str, object]:
    from spmd_rl.config import load_config
    from spmd_rl.distributed.env import DistEnv

    rows = args.prompts * args.n
    flags = [
        "--model.path", folder, "--data.task", "file", "--data.path", data, "--data.val-path", data,
        "--data.train-batch-size", str(args.prompts), "--data.max-prompt-length", str(args.prompt_len),
        "--rollout.n", str(args.n), "--rollout.max-new-tokens", str(args.new_tokens), "--rollout.temperature", "1.0",
        "--rollout.top-k", "0", "--rollout.top-p", "1.0", "--rollout.batch-size", str(rows), "--rollout.ignore-eos",
        "--actor.ppo-mini-batch-size", str(args.prompts), "--actor.micro-batch-size", str(args.micro_batch_size),
        "--ref.micro-batch-size", str(args.micro_batch_size), "--actor.lr", "1e-6",
        "--algo.use-kl-loss", "--algo.kl-coef", str(KL_COEF), "--reward.fn", "grpo_step:bench_reward",
        "--trainer.total-steps", str(args.steps), "--trainer.val-every", "0", "--trainer.output-dir", out_dir,
        "--trainer.device", args.device, "--logging.wandb", "off", "--logging.no-console",
        "--checkpoint.no-save-final", "--checkpoint.resume", "never",
    ]
    if args.packing:  # default budget: the tokens of one TRL micro-batch, so both run the same micro-batches
        budget = args.ours_max_tokens or args.micro_batch_size * (args.prompt_len + args.new_tokens)
        flags += ["--actor.use-packing", "--actor.max-tokens-per-gpu", str(budget)]
    if args.ours_compile:
        flags += ["--actor.fsdp.compile-layers"]
    flags += shlex.split(args.ours_extra)
    cfg = load_config(flags)
    env = DistEnv.from_environ().init(device=cfg.trainer.device)
    from spmd_rl.trainer import Trainer

    trainer = Trainer(cfg, env)
    try:
        if args.profile:  # every step profiled (slower); the table reads the last one
            from spmd_rl.profiling import format_stage_times, profiled, stage_times

            with profiled(env.device, None) as prof:
                trainer.fit()
            if env.is_main:
                print("stage profile, last step:\n" + format_stage_times(stage_times(prof, top=args.profile_top)), flush=True)
        else:
            trainer.fit()
    finally:
        trainer.close()
        del trainer
        gc.collect()  # engines hold reference cycles; free their device memory before TRL loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    steps = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = [r for r in steps if "timing_s/step" in r]
    timed = steps[1:] or steps
    keys = ["timing_s/gen", "timing_s/weight_sync", "timing_s/ref", "timing_s/update", "timing_s/reward",
            "response_length/mean", "perf/mfu", "perf/mfu/gen", "perf/mfu/update", "perf/mfu/ref"]
    row = {"side": "spmd_rl", "gpus": env.world_size, "step_s": statistics.median(r["timing_s/step"] for r in timed),
           "is_main": env.is_main,
           **{k: statistics.median(r[k] for r in timed) for k in keys if all(k in r for r in timed)}}
    env.shutdown()  # TRL (one process) runs next in this process, without our process group
    return row


def run_trl(args: argparse.Namespace, folder: str, data: str, out_dir: str) -> dict[str, object]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = args.prompts * args.n
    texts = [json.loads(line)["prompt"] for line in open(data)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in texts])
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=rows // args.micro_batch_size, num_generations=args.n,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": args.new_tokens}, learning_rate=1e-6, beta=KL_COEF,
        num_iterations=1, max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no",
        gradient_checkpointing=False, bf16=on_gpu, use_cpu=not on_gpu, model_init_kwargs={"dtype": "float32"},
        shuffle_dataset=False, disable_tqdm=True, seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    trainer = GRPOTrainer(model=folder, reward_funcs=[bench_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])
    start = time.perf_counter()
    trainer.train()
    marks = [start] + ends
    intervals = [b - a for a, b in zip(marks[:-1], marks[1:])]
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    out = {"side": "trl", "gpus": 1, "step_s": statistics.median(intervals[1:] or intervals)}
    if logs:
        out["response_length/mean"] = logs[-1]["completions/mean_length"]
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2-0.5b", help="see bench/shapes.py")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens after the chat template")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per response")
    p.add_argument("--micro-batch-size", type=int, default=32, help="responses per forward/backward")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True, help="ours: packed micro-batches")
    p.add_argument("--ours-max-tokens", type=int, default=None,
                   help="ours: tokens per packed micro-batch (default: those of one --micro-batch-size micro-batch)")
    p.add_argument("--ours-compile", action="store_true", help="ours: torch.compile the decoder layers "
                   "(actor.fsdp.compile_layers)")
    p.add_argument("--ours-extra", default="", help="ours: more trainer flags, e.g. --ours-extra='--rollout.sleep-level 0'")
    p.add_argument("--only", choices=["both", "ours", "trl"], default="both")
    p.add_argument("--profile", action="store_true", help="ours under torch.profiler; per stage of the last "
                   "step, wall time against kernel time, and the top kernels of ref and update (slows ours down; "
                   "a training run gets the same from --trainer.profile-steps)")
    p.add_argument("--profile-top", type=int, default=12, help="how many kernels --profile lists per stage")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--models", default=default_root())
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if (args.prompts * args.n) % args.micro_batch_size:
        raise SystemExit(f"--micro-batch-size ({args.micro_batch_size}) must divide --prompts x --n "
                         f"({args.prompts * args.n})")
    folder = model_folder(args.shape, root=args.models)
    chrome = 3  # <|user|> ... </s> <|assistant|> around the content (the character tokenizer's template)
    rows: list[dict[str, object]] = []
    main_rank = int(os.environ.get("RANK", "0")) == 0
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "prompts.jsonl")
        write_prompts(data, args.prompts * (args.steps + 1), args.prompt_len - chrome, seed=0)
        sides = {"both": ["ours", "trl"], "ours": ["ours"], "trl": ["trl"]}[args.only]
        for side in sides:
            try:
                if side == "ours":
                    row = run_ours(args, folder, data, os.path.join(tmp, "ours"))
                    main_rank = bool(row.pop("is_main"))
                elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
                    if main_rank:
                        print("trl: skipped under torchrun (TRL runs as one process here; use --only trl alone)")
                    continue
                else:
                    row = run_trl(args, folder, data, os.path.join(tmp, "trl"))
                rows.append(row)
            except Exception as e:  # report the other side even when one fails (e.g. trl not installed)
                print(f"{side}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    if not main_rank:
        return
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    print(f"\nGRPO step, {args.shape}, {gpu}: {args.prompts} prompts x {args.n} samples, prompt {args.prompt_len} + "
          f"{args.new_tokens} new tokens, micro-batch {args.micro_batch_size}, median of steps 2..{args.steps}")
    print(f"{'side':8s} {'gpus':>4s} {'step s':>8s} {'gen s':>7s} {'ref s':>6s} {'update s':>8s} {'resp len':>8s} "
          f"{'MFU':>6s} {'vs TRL':>7s}")
    trl = next((r for r in rows if r["side"] == "trl"), None)
    for r in rows:
        ratio = f"{trl['step_s'] / r['step_s']:6.2f}x" if trl else "      -"
        mfu = f"{100 * r['perf/mfu']:5.1f}%" if "perf/mfu" in r else "     -"
        print(f"{r['side']:8s} {r['gpus']:4d} {r['step_s']:8.2f} {r.get('timing_s/gen', float('nan')):7.2f} "
              f"{r.get('timing_s/ref', float('nan')):6.2f} {r.get('timing_s/update', float('nan')):8.2f} "
              f"{r.get('response_length/mean', float('nan')):8.1f} {mfu} {ratio}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "shape": args.shape, "gpu": gpu, "prompts": args.prompts, "n": args.n,
                                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}) + "\n")


if __name__ == "__main__":
    main()
