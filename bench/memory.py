"""The memory estimate at plan time (``spmd_rl/memory/``) against the peak a real run allocates.

    python bench/memory.py                              # one GPU: five configurations, each in its own process
    python bench/memory.py --only qwen3-1.7b qwen2.5-7b-lora
    python bench/memory.py --tiny                       # CPU smoke run: the tiny shape, estimate only

Each configuration runs in a process of its own (a world of one): a random-weight model folder of a real
shape (``bench/shapes.py``, built once under ``--models``), prompts of
exactly ``--prompt-len`` tokens, ``--new-tokens`` tokens per response (EOS ignored), a random reward, the
trainer's defaults otherwise (FSDP engine, built-in rollout, KL to a reference). The process plans the run
as ``spmd_rl.train`` does (``plan()`` with the GPU's memory: its ``Plan.memory`` is the estimate), builds
the ``Trainer`` and runs ``--steps`` steps. ``torch.cuda.max_memory_allocated`` is read over the steps
and, separately, over each phase (the rollout's rounds, the log-prob forwards, the update's mini-batches);
the table shows the estimate's peak and phase totals against them, and the ratio measured / estimate.
Loading the models is left out of the measured peak (it is reset after the trainer is built).

Configurations (``--only`` picks some): ``qwen3-1.7b`` (full fine-tuning), ``qwen3-1.7b-offload`` (the
actor's weights, gradients and optimizer state and the reference offloaded between phases),
``qwen3-1.7b-packed`` (token-budget packed micro-batches, gradient checkpointing), ``qwen3-moe-6l``
(6 layers of Qwen3-30B-A3B), ``qwen2.5-7b-lora`` (LoRA r = 16 on the seven projections; full
fine-tuning of 7B does not fit one H200, which the last line shows as the refusal ``plan()`` gives).
``--tiny`` runs the tiny shape on the CPU for one step (no peak there): a smoke run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402

GIB = 2**30
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "qwen3-1.7b": ("qwen3-1.7b", []),
    "qwen3-1.7b-offload": ("qwen3-1.7b", ["--actor.fsdp.param-offload", "--actor.fsdp.optimizer-offload",
                                          "--ref.param-offload"]),
    "qwen3-1.7b-packed": ("qwen3-1.7b", ["--actor.use-packing", "--actor.max-tokens-per-gpu", "16384",
                                         "--model.gradient-checkpointing", "True"]),
    "qwen3-moe-6l": ("qwen3-moe-6l", []),
    "qwen2.5-7b-lora": ("qwen2.5-7b", ["--actor.lora.rank", "16", "--actor.lora.alpha", "32"]),
    "tiny": ("tiny", []),  # --tiny's: a CPU smoke run
}
REFUSED = ("qwen2.5-7b", [])  # full fine-tuning of 7B on one H200: planned only, to show the refusal
PHASES = ("generate", "log-probs", "update")


def bench_reward(prompts, completions, **_: object) -> list[float]:
    """A random score per completion: advantages are not zero, so the update is a real one."""
    return [random.random() for _ in completions]


def flags_for(args: argparse.Namespace, folder: str, data: str, out_dir: str, extra: list[str]) -> list[str]:
    return ["--model.path", folder, "--data.task", "file", "--data.path", data,
            "--data.train-batch-size", str(args.prompts), "--data.max-prompt-length", str(args.prompt_len),
            "--rollout.n", str(args.n), "--rollout.max-new-tokens", str(args.new_tokens), "--rollout.ignore-eos",
            "--rollout.temperature", "1.0", "--rollout.no-compile-decode",
            "--actor.ppo-mini-batch-size", str(args.prompts), "--actor.micro-batch-size", str(args.micro_batch_size),
            "--actor.lr", "1e-6", "--reward.fn", "memory:bench_reward", "--trainer.total-steps", str(args.steps),
            "--trainer.val-every", "0", "--trainer.output-dir", out_dir, "--trainer.device", args.device,
            "--logging.wandb", "off", "--logging.no-console", "--checkpoint.no-save-final",
            "--checkpoint.resume", "never", *extra]


def write_prompts(path: str, count: int, content_len: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "".join(rng.choice("abcdefghij") for _ in range(content_len)),
                                "answer": "0"}) + "\n")


class PhasePeaks:
    """``torch.cuda.max_memory_allocated`` over each call of the wrapped methods, by phase, and over all."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.peaks, self.overall, self.reserved = cuda, {}, 0, 0

    def read(self, phase: str | None = None) -> None:
        """Fold the peaks since the last reset into ``phase``'s and the overall ones, and reset them."""
        import torch

        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        if phase is not None:
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        self.overall, self.reserved = max(self.overall, peak), max(self.reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def wrap(self, cls: type, name: str, phase: str) -> None:
        inner = getattr(cls, name)

        def measured(obj, *a, **k):
            if not self.cuda:
                return inner(obj, *a, **k)
            self.read()
            try:
                return inner(obj, *a, **k)
            finally:
                self.read(phase)

        setattr(cls, name, measured)


def run_one(args: argparse.Namespace) -> dict[str, object]:
    """One configuration in this process: the plan's estimate, then the trainer's steps and their peaks."""
    import torch

    from spmd_rl.config import load_config
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.memory import device_memory
    from spmd_rl.models.shape import read_model_shape
    from spmd_rl.plan import plan
    from spmd_rl.source.rollout import LocalRollout

    shape_name, extra = REFUSED if args.run == "refused" else CONFIGS[args.run]
    folder = shapes.model_folder(shape_name, root=args.models)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "prompts.jsonl")
        write_prompts(data, args.prompts * (args.steps + 1) + 64, args.prompt_len - 3)  # 3: the chat template's
        cfg = load_config(flags_for(args, folder, data, os.path.join(tmp, "run"), extra))
        device = device_memory(cfg.trainer.device, 0, 1, 1)
        shape = read_model_shape(folder)
        row: dict[str, object] = {"config": args.run, "shape": shape_name, "device_bytes": device}
        estimate = plan(cfg, 1, 1, model_shape=shape, device_bytes=None).memory.ranks[0]
        row.update(estimate=estimate.peak, estimate_phase=estimate.peak_phase,
                   estimate_phases={ph: estimate.total(ph) for ph in PHASES})
        try:
            p = plan(cfg, 1, 1, model_shape=shape, device_bytes=device)  # as spmd_rl.train plans it
        except ValueError as e:
            return {**row, "refused": str(e)}
        if args.run == "refused":  # not refused (no GPU, or a larger one): never trained here
            return {**row, "skipped": "not refused on this device, not run", "table": p.memory.render()}
        row["table"] = p.memory.render()
        cuda = device is not None
        peaks = PhasePeaks(cuda)
        peaks.wrap(LocalRollout, "generate", "generate")
        peaks.wrap(FSDPEngine, "compute_logprobs", "log-probs")
        peaks.wrap(FSDPEngine, "train_mini_batch", "update")
        env = DistEnv.from_environ().init(device=cfg.trainer.device)
        from spmd_rl.trainer import Trainer

        trainer = Trainer(cfg, env)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            trainer.fit()
        finally:
            trainer.close()
        if cuda:
            peaks.read()
            row.update(measured=peaks.overall, measured_phases=peaks.peaks, reserved=peaks.reserved)
        row["seconds"] = time.perf_counter() - start
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            row["steps"] = sum("timing_s/step" in json.loads(line) for line in f)
        env.shutdown()
    return row


def table(rows: list[dict[str, object]], gpu: str) -> str:
    """The markdown table of docs/PERF.md: each configuration's estimate against its measured peaks."""
    out = [f"estimate vs measured peak (torch.cuda.max_memory_allocated), {gpu}, GiB per rank",
           "| config | estimate (phase) | measured | measured / estimate | "
           + " | ".join(f"{ph}: estimate / measured" for ph in PHASES) + " |", "|---|---|---|---|" + "---|" * len(PHASES)]
    for r in rows:
        if "estimate" not in r:
            out.append(f"| {r['config']} | {'FAILED: ' + str(r.get('error')) if 'error' in r else 'not estimated'} |")
            continue
        meas, est = r.get("measured"), r["estimate"]
        if "refused" in r or "skipped" in r:
            cells = [f"refused by plan(): {str(r['refused'])[:160]}..." if "refused" in r else str(r["skipped"])]
        else:
            cells = ["-" if meas is None else f"{meas / GIB:.2f}", "-" if meas is None else f"{meas / est:.2f}"]
            cells += [f"{r['estimate_phases'][ph] / GIB:.2f} / "
                      + ("-" if meas is None else f"{r['measured_phases'].get(ph, 0) / GIB:.2f}") for ph in PHASES]
        out.append(f"| {r['config']} | {est / GIB:.2f} ({r['estimate_phase']}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS) + ["refused"], default=None)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, one step (a smoke run)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens after the chat template")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--models", default=shapes.default_root())
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--out", default=None, help="append each configuration's row here as a JSON line")
    parser.add_argument("--logs", default=None, help="write each configuration's process output to DIR/NAME.log")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one configuration, in this process
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.micro_batch_size, args.steps, args.device = (
            2, 2, 16, 8, 2, 1, "cpu")
    if args.run is not None:
        Path(args.result).write_text(json.dumps(run_one(args)))
        return 0
    names = args.only or (["tiny"] if args.tiny else [*(c for c in CONFIGS if c != "tiny"), "refused"])
    common = ["--prompts", str(args.prompts), "--n", str(args.n), "--prompt-len", str(args.prompt_len),
              "--new-tokens", str(args.new_tokens), "--micro-batch-size", str(args.micro_batch_size),
              "--steps", str(args.steps), "--device", args.device, "--models", args.models] + ["--tiny"] * args.tiny
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            result = os.path.join(tmp, f"{name}.json")
            command = [sys.executable, __file__, *common, "--run", name, "--result", result]
            try:
                done = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True)
                if args.logs:
                    Path(args.logs).mkdir(parents=True, exist_ok=True)
                    Path(args.logs, f"{name}.log").write_text(done.stdout + done.stderr)
                row = json.loads(Path(result).read_text()) if done.returncode == 0 else {
                    "config": name, "error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
            except subprocess.TimeoutExpired:
                row = {"config": name, "error": f"over --timeout {args.timeout:g} s"}
            rows.append(row)
            if "table" in row:
                print(f"{name}:\n{row['table']}\n({row.get('seconds', 0):.0f} s)\n", flush=True)
            elif "error" in row:
                print(f"{name}: FAILED: {row['error']}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps({k: v for k, v in row.items() if k != "table"}) + "\n")
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu (no peak)"
    print(table(rows, gpu))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
