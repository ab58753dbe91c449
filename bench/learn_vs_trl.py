"""Learning per wall-clock second: this trainer (max staleness 0 and 1) against TRL's ``GRPOTrainer``
on the sums task of ``configs/gpu_learn.yaml``, greedy held-out accuracy against training seconds.

    python3 bench/learn_vs_trl.py --out learn_vs_trl.jsonl       # one GPU: ours S=0, ours S=1, TRL; 200 steps each
    python3 bench/learn_vs_trl.py --sides s0 s1 --out a.jsonl    # ours only; then TRL with a time budget,
    python3 bench/learn_vs_trl.py --sides trl --trl-max-train-s 480 --out a.jsonl
    python3 bench/learn_vs_trl.py --report a.jsonl               # and one table of both runs
    python3 bench/learn_vs_trl.py --device cpu --model tiny --steps 2 --val-every 1 --prompts 2 --n 4 \
        --max-new-tokens 8 --val-size 8                          # CPU smoke run (tests/test_learn_vs_trl.py)

TRL is not a dependency of this project: the TRL side needs ``pip install trl`` (TRL 1.16.0 with
``accelerate`` and ``datasets``; offline, ``pip download --no-deps -d wheelhouse trl==1.16.0
accelerate==1.15.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash pyarrow pandas
python-dateutil six`` and install them with ``--no-index --find-links wheelhouse --no-deps``).
Without it that side prints FAILED and the others still run.

**The work.** Every side trains SmolLM2-135M-Instruct (the built-in ``smollm2-135m-instruct``) on
``configs/gpu_learn.yaml``'s task: "What is a + b? Reply with only the final number." with a, b in
0..99, 32 prompts x 8 samples per step at temperature 0.7 (top-p 1, top-k 0), at most 32 new
tokens, the math scorer of ``spmd_rl.reward`` (1 for the right number), GRPO advantages normalised
by the group's std, the PPO clip 0.2 / 0.2, the k3 KL loss to the initial model with coefficient
0.001, token-mean loss over the whole batch, AdamW at a constant lr 2e-6 (betas 0.9 / 0.999, no
weight decay, no warm-up), gradient norm clipped at 1.0, one optimizer step per batch, fp32 master
weights with bf16 compute. Accuracy is greedy on the same 256 held-out prompts (the task's
validation split, never trained on), before the first step, every ``--val-every`` steps and after
the last, decoded by this project's rollout engine and scored by the same scorer on every side, so
only the training differs.

**The sides.** ``s0``: ``torchrun -m spmd_rl.train --config configs/gpu_learn.yaml`` in one process
(colocated rollout). ``s1``: the same with ``--trainer.max-staleness 1 --pools.rollout-ranks 1
--pools.colocate 2`` (actor and rollout processes sharing the GPU, the rollout generating batch t+1
while the actor trains on t) and ``--algo.rollout-is token_truncated`` (``plan()``'s advice for
stale samples; ``--s1-extra`` changes it). ``trl``: TRL's ``GRPOTrainer`` in this process with the
same model folder, prompts (the same chat, checked token for token against ours), reward function
(our scorer), and the settings above spelled in TRL's terms: ``num_generations=8``,
``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = 256 completions = 32 prompts
per optimizer step (``--trl-micro-batch``, default 256: one micro-batch, like our packed update),
``max_completion_length=32``, ``temperature=0.7``, ``beta=0.001``, ``epsilon=epsilon_high=0.2``,
``loss_type="dapo"`` (tokens of the whole batch), ``scale_rewards="group"``, ``num_iterations=1``,
``lr_scheduler_type="constant"``, ``use_bias_correction_kl=False`` (our KL loss has no
importance weight), the model loaded in fp32 with ``bf16=True`` (autocast), and its
``generation_config.eos_token_id`` set to our rollout's stop tokens (EOS and the chat's end of turn).

**The clock.** Training seconds exclude model loading and every evaluation. Ours: the sum of the
trainer's ``timing_s/step`` (generation, reward, reference, update, weight sync; checkpoints off).
With S=1 the rollout pool keeps generating the rounds already issued while the actor validates,
so the steps right after a validation find their batch ready: the generation seconds
(``async/rollout_busy_s``) of the S + 1 rounds in flight at each validation are added back, as if
none of it had overlapped anything (an upper bound, against ours). TRL: from ``on_train_begin``,
stopped at ``on_step_end`` (after a device sync) for each evaluation and restarted after it; TRL's
own per-step work (logging included) stays on the clock. Both clocks include the first steps'
warm-up (our first kernels and compiled head, TRL's first CUDA kernels).

**TRL configured for speed without vLLM.** Its docs put vLLM first (not on this GPU), then
transformers' continuous batching (``use_transformers_continuous_batching``) for N >= 32
generations per prompt (a tie with ``generate`` at N = 8, as here), and say gradient checkpointing
costs ~20 %. So: HF ``generate`` (``--trl-generation continuous`` for the other path),
``gradient_checkpointing=False`` (``GRPOConfig`` defaults it to True), bf16 autocast and TF32
matmuls, one generation per optimizer step (``steps_per_generation`` = the accumulation steps,
TRL's default), one micro-batch of 256 completions (fewest kernel launches; memory is ample), no
completion logging, ``logging_steps`` = ``--val-every``, no evaluation or saving of its own. What
TRL cannot do here is decode in bf16: ``generate`` runs on the fp32 weights outside
``accelerator.autocast()``, and the continuous-batching path casts the training model itself to
bf16 (``unwrapped_model.to(torch.bfloat16)``, never cast back, as read in TRL 1.16.0's source),
after which AdamW's 2e-6 steps fall below bf16's spacing (2^-8 of a weight) and the policy barely
moves; bf16 weights from the start (``dtype="auto"``) fail the same way.

**TRL's attention.** TRL trains on left-padded prompts through transformers' stock SDPA attention
with a padding mask, in which the padding of short prompts makes fully masked query rows. On an
H200 torch picks its cuDNN attention for that mask, whose backward returned NaN gradients from
finite inputs in this project's engine with stock SDPA (``docs/RESULTS.md``,
"Non-finite gradients"). transformers' Trainer applies such a step (its norm clip does not catch
NaN), and the next ``generate`` stops on NaN probabilities. So the TRL side
turns torch's cuDNN attention off (``--trl-attention sdpa-no-cudnn``, the default; SDPA then takes
its memory-efficient kernel), and counts the optimizer steps whose gradients were not finite
(``trl/nonfinite_grad_steps`` in the summary line; the runs: docs/results/HISTORY.md).
``--trl-attention sdpa`` keeps torch's choice, ``eager`` uses transformers' eager attention.

**Why 64 x 4 completed no optimizer step in 100 s** (``per_device_train_batch_size=64,
gradient_accumulation_steps=4, num_generations=8``, the other settings left at TRL 1.16's
defaults). That batch is right: ``steps_per_generation`` defaults to the accumulation steps, so
``generation_batch_size`` = 64 x 4 = 256 completions = 32 prompts, generated once per optimizer
step and split into 4 micro-batches (``_prepare_inputs``). What the defaults do to a step, most
likely the cause: ``max_completion_length`` is 512, not 32, and HF ``generate`` decodes the whole
batch of 256 until its last row ends: at temperature 1 (TRL's default) one of 256 SmolLM2 answers
is likely to run on, so a generation is up to 512 decode steps of a 30-layer model, launch-bound
eager kernels on fp32 weights (``model_init_kwargs`` default ``dtype="float32"``) with a dynamic
KV cache, an estimated 10-20 s per step instead of about one; then the 4 micro-batches, the
reference pass and the loss run on right-padded [64, prompt + 512] rows (GRPO has no padding-free
path) with gradient checkpointing on (a second forward in every backward). And ``logging_steps``
defaults to 10: the first line that shows an optimizer step is printed after step 10, so a step
every 10-20 s prints nothing for the first 100-200 s. (Derived from TRL 1.16.0's source, not yet
timed on the GPU: the ``trl`` summary line of ``--out`` holds TRL's generation and reward seconds
per step, its ``step_time``, mean completion length and the share of completions cut at the length
limit, to check it.)

Output: one table, a row per evaluation step with each side's training seconds and accuracy, and
a last row with the seconds each side needed to reach ``--target`` (0.8) accuracy, or "not
reached" with its best. ``--out`` appends JSON lines: one per side and evaluation (``side``,
``step``, ``train_s``, ``accuracy``) and one summary per side (``seconds_to_target``, ``best``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "gpu_learn.yaml"
SIDES = {"s0": "ours S=0", "s1": "ours S=1", "trl": "TRL"}
MODELS = {"tiny": "tiny-random", "smollm2": "smollm2-135m-instruct"}


def common_flags(args: argparse.Namespace) -> list[str]:
    """Trainer flags every side's config is read with: gpu_learn.yaml, resized by the bench's arguments."""
    flags = ["--config", str(CONFIG), "--model.path", MODELS.get(args.model, args.model),
             "--data.train-batch-size", str(args.prompts), "--data.val-size", str(args.val_size),
             "--rollout.n", str(args.n), "--rollout.max-new-tokens", str(args.max_new_tokens),
             "--rollout.batch-size", str(args.prompts * args.n), "--actor.ppo-mini-batch-size", str(args.prompts),
             "--trainer.total-steps", str(args.steps), "--trainer.val-every", str(args.val_every),
             "--trainer.device", args.device]
    if args.device == "cpu":  # compiled layers are a GPU speed-up; on the CPU they only cost compile time
        flags += ["--actor.fsdp.no-compile-layers", "--rollout.no-compile-decode"]
    return flags


# ====================================================================== ours
def run_ours(args: argparse.Namespace, staleness: int, out_dir: str) -> list[dict]:
    """One ``spmd_rl.train`` run under torchrun; its validation points with their training seconds."""
    flags = common_flags(args) + [
        "--trainer.output-dir", out_dir, "--logging.wandb", "off", "--logging.no-console",
        "--checkpoint.every", "0", "--checkpoint.no-save-final", "--checkpoint.resume", "never"]
    nproc = 1
    if staleness:
        nproc = 2
        flags += ["--trainer.max-staleness", str(staleness), "--pools.rollout-ranks", "1",
                  "--pools.colocate", str(args.s1_colocate), *shlex.split(args.s1_extra)]
    flags += shlex.split(args.ours_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "spmd_rl.train", *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd[-12:])}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return ours_curve([json.loads(line) for line in f], staleness)


def ours_curve(rows: list[dict], staleness: int) -> list[dict]:
    """Validation points ``{step, train_s, accuracy}`` from a run's metrics lines.

    ``train_s`` at step k is the sum of ``timing_s/step`` of steps 1..k, plus, with ``staleness``
    S > 0, the generation seconds of the S + 1 rounds that were in flight during each earlier
    validation (they were generated while the clock was stopped)."""
    step_s = {r["step"]: r["timing_s/step"] for r in rows if "timing_s/step" in r}
    busy = {r["step"]: r.get("async/rollout_busy_s", 0.0) for r in rows if "timing_s/step" in r}
    accuracy = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    last = max(step_s, default=0)
    charged: set[int] = set()
    if staleness:
        for v in accuracy:
            if 0 < v < last:
                charged.update(range(v + 1, min(v + staleness + 1, last) + 1))
    points, clock = [], 0.0
    for step in range(last + 1):
        clock += step_s.get(step, 0.0) + (busy.get(step, 0.0) if step in charged else 0.0)
        if step in accuracy:
            points.append({"step": step, "train_s": round(clock, 3), "accuracy": accuracy[step]})
    return points


# ====================================================================== TRL
class HeldOut:
    """Greedy accuracy on the held-out prompts with this project's rollout engine and scorer: the
    trainer's own validation, applied to another trainer's weights."""

    def __init__(self, cfg, folder: str, device: torch.device) -> None:
        from spmd_rl.data import build_prompts
        from spmd_rl.data.prompts import render_prompts
        from spmd_rl.models import eos_token_ids, load_tokenizer
        from spmd_rl.reward.registry import build_scorer
        from spmd_rl.rollout import build_rollout_from_config

        self.cfg = cfg
        self.tokenizer = load_tokenizer(folder, trust_remote_code=cfg.model.trust_remote_code)
        _, val = build_prompts(cfg.data)
        self.samples, self.prompt_ids, _ = render_prompts(val, self.tokenizer, system_prompt=cfg.data.system_prompt,
                                                          max_prompt_length=cfg.data.max_prompt_length)
        self.scorer = build_scorer(fn=cfg.reward.fn, task=cfg.data.task, format_weight=cfg.reward.format_weight,
                                   on_error=cfg.reward.on_error, timeout_s=cfg.reward.timeout_s)
        self.rollout = build_rollout_from_config(
            cfg.rollout, model_folder=folder, device=device, pad_token_id=int(self.tokenizer.pad_token_id),
            eos_token_ids=eos_token_ids(self.tokenizer), trust_remote_code=cfg.model.trust_remote_code,
            max_prompt_length=cfg.data.max_prompt_length, seed=cfg.trainer.seed)

    def accuracy(self, model: torch.nn.Module) -> float:
        from spmd_rl.data.tasks import columns_of

        self.rollout.load_weights((name, p.detach()) for name, p in model.named_parameters())
        out = self.rollout.generate(self.prompt_ids, n=1, temperature=self.cfg.trainer.val_temperature, top_p=1.0,
                                    top_k=0, max_new_tokens=self.cfg.rollout.max_new_tokens, seed=self.cfg.trainer.seed)
        responses = [ids[mask.bool()].tolist() for ids, mask in zip(out.response_ids, out.response_mask)]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        result = self.scorer([s.prompt for s in self.samples], texts, columns_of(self.samples))
        return sum(m >= 1.0 - 1e-6 for m in result.main_scores) / len(texts)

    def close(self) -> None:
        self.rollout.close()


def run_trl(args: argparse.Namespace, out_dir: str) -> tuple[list[dict], dict]:
    """TRL's ``GRPOTrainer`` on the same work; its validation points and TRL's mean phase times."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from spmd_rl.config import load_config
    from spmd_rl.data import build_prompts
    from spmd_rl.distributed.env import use_host_threads
    from spmd_rl.data.prompts import render_prompts, sample_messages
    from spmd_rl.models import eos_token_ids, resolve_model_path
    from spmd_rl.reward.registry import build_scorer

    cfg = load_config(common_flags(args))
    on_gpu = cfg.trainer.device == "cuda"
    device = torch.device("cuda" if on_gpu else "cpu")
    use_host_threads(device)  # the host threads spmd_rl.train's process runs with
    folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir)
    held_out = HeldOut(cfg, folder, device)
    tokenizer = held_out.tokenizer
    train, _ = build_prompts(cfg.data)
    chats = [sample_messages(s, cfg.data.system_prompt) for s in train]
    # TRL renders a conversational prompt with apply_chat_template(add_generation_prompt=True): check it is ours
    theirs = tokenizer.apply_chat_template(chats[:64], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    _, ours, _ = render_prompts(train[:64], tokenizer, system_prompt=cfg.data.system_prompt,
                                max_prompt_length=cfg.data.max_prompt_length)
    if [list(t) for t in theirs] != ours:
        raise RuntimeError("TRL's rendering of the prompts differs from ours; the comparison would not be fair")
    dataset = Dataset.from_list([{"prompt": c, "answer": s.answer} for c, s in zip(chats, train)])
    scorer = build_scorer(fn=cfg.reward.fn, task=cfg.data.task, format_weight=cfg.reward.format_weight,
                          on_error=cfg.reward.on_error, timeout_s=cfg.reward.timeout_s)

    def sums_reward(prompts, completions, answer, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        questions = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        return scorer(questions, texts, {"answer": list(answer)}).scores

    rows = args.prompts * args.n
    micro = min(args.trl_micro_batch, rows)
    if rows % micro or micro % args.n:
        raise ValueError(f"--trl-micro-batch ({micro}) must divide --prompts x --n ({rows}) and be a multiple of --n")
    a, algo = cfg.actor, cfg.algo
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
        num_generations=args.n, max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, learning_rate=a.lr, adam_beta1=a.betas[0],
        adam_beta2=a.betas[1], weight_decay=a.weight_decay, lr_scheduler_type="constant", warmup_steps=a.warmup_steps,
        max_grad_norm=a.grad_clip, beta=algo.kl_coef if algo.use_kl_loss else 0.0, epsilon=algo.clip_low,
        epsilon_high=algo.clip_high, loss_type="dapo", scale_rewards="group" if algo.norm_adv_by_std else "none",
        num_iterations=1, use_bias_correction_kl=False, mask_truncated_completions=False,
        use_transformers_continuous_batching=args.trl_generation == "continuous",
        gradient_checkpointing=False, bf16=on_gpu, tf32=True if on_gpu else None, use_cpu=not on_gpu,
        disable_dropout=True, max_steps=args.steps,
        logging_steps=args.val_every or args.steps, log_completions=False, report_to="none", save_strategy="no",
        eval_strategy="no", disable_tqdm=True, seed=cfg.trainer.seed, remove_unused_columns=False)
    points: list[dict] = []

    class Clock(TrainerCallback):
        """Training seconds from ``on_train_begin``, with the evaluations cut out."""

        def __init__(self) -> None:
            self.train_s, self.since = 0.0, 0.0

        def evaluate(self, step: int, model) -> None:
            points.append({"step": step, "train_s": round(self.train_s, 3), "accuracy": held_out.accuracy(model)})

        def on_train_begin(self, a, state, control, model=None, **_):
            self.evaluate(0, model)
            self.since = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **_):
            if on_gpu:
                torch.cuda.synchronize()
            self.train_s += time.perf_counter() - self.since
            step = state.global_step
            out_of_time = 0 < args.trl_max_train_s <= self.train_s
            if (args.val_every and step % args.val_every == 0) or step == args.steps or out_of_time:
                self.evaluate(step, model)
            control.should_training_stop = control.should_training_stop or out_of_time
            self.since = time.perf_counter()

    if args.trl_attention == "sdpa-no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    nonfinite: list[int] = []

    class GradWatch(TrainerCallback):
        """The optimizer steps whose gradients hold a NaN or inf (one fused norm per step)."""

        def on_pre_optimizer_step(self, a, state, control, model=None, **_):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads and not torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()):
                nonfinite.append(state.global_step + 1)

    # fp32 master weights as ours (bf16 weights would round AdamW's 2e-6 steps away); the same stop tokens
    # as our rollout (EOS and the chat's end-of-turn ids): TRL ends a completion at generation_config's ids
    attention = "eager" if args.trl_attention == "eager" else "sdpa"
    # no Hub kernels on either side (spmd_rl.models.load_causal_lm): a fresh transformers fetches them at .train()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention,
                                                 use_kernels=False)
    model.generation_config.eos_token_id = eos_token_ids(tokenizer)
    trainer = GRPOTrainer(model=model, reward_funcs=[sums_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock(), GradWatch()])
    # TRL's own phase timers (profiling/...) report only to wandb / mlflow / trackio: time its generation and
    # reward calls here instead (private methods of TRL 1.16; skipped when absent)
    phase_s = {"gen": 0.0, "reward": 0.0}
    for phase, name in (("gen", "_generate_single_turn"), ("reward", "_calculate_rewards")):
        if hasattr(trainer, name):
            setattr(trainer, name, timed(getattr(trainer, name), phase, phase_s, on_gpu))
    failed = None
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - a run that dies mid-way still reports its curve so far
        failed = f"{type(e).__name__} after step {trainer.state.global_step}: {str(e).splitlines()[0][:300]}"
        print(f"TRL: FAILED {failed}; its curve up to there is reported", flush=True)
    logs = [r for r in trainer.state.log_history if "step_time" in r]
    phases = {f"trl/{k}": round(sum(r[k] for r in logs) / len(logs), 4)
              for k in ("step_time", "completions/mean_length", "completions/clipped_ratio")
              if logs and all(k in r for r in logs)}
    steps_run = max(trainer.state.global_step, 1)
    phases.update({f"trl/{k}_s_per_step": round(v / steps_run, 4) for k, v in phase_s.items()})
    phases["trl/nonfinite_grad_steps"] = nonfinite[:20]
    if failed:
        phases["trl/failed"] = failed
    try:  # after a device-side assert the CUDA context is gone: nothing more to free
        held_out.close()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        if not failed:
            raise
    if not points:
        raise RuntimeError(failed or "TRL recorded no evaluation")
    return points, phases


def timed(fn, phase: str, totals: dict[str, float], sync: bool):
    """``fn`` with its seconds (after a device sync) added to ``totals[phase]``."""
    def wrapper(*a, **k):
        start = time.perf_counter()
        out = fn(*a, **k)
        if sync:
            torch.cuda.synchronize()
        totals[phase] += time.perf_counter() - start
        return out
    return wrapper


# ====================================================================== report
def reached(points: list[dict], target: float) -> dict:
    """The first evaluation at or above ``target``, and the best one."""
    hit = next((p for p in points if p["accuracy"] >= target), None)
    best = max(points, key=lambda p: (p["accuracy"], -p["train_s"]), default=None)
    return {"seconds_to_target": hit["train_s"] if hit else None, "step_at_target": hit["step"] if hit else None,
            "best": best["accuracy"] if best else None, "best_train_s": best["train_s"] if best else None}


def read_report(path: str) -> tuple[dict[str, list[dict]], dict]:
    """The curves of ``--out`` JSON lines (a side's points end with its summary line; the last run
    of each side wins) and the run settings of the last line."""
    curves: dict[str, list[dict]] = {}
    pending: dict[str, list[dict]] = {}
    meta: dict = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            meta = row
            if row.get("summary"):
                curves[row["side"]] = pending.pop(row["side"], [])
            else:
                pending.setdefault(row["side"], []).append(
                    {k: row[k] for k in ("step", "train_s", "accuracy")})
    if not curves:
        raise SystemExit(f"--report {path}: no completed side in it")
    return {s: curves[s] for s in SIDES if s in curves}, meta


def print_table(curves: dict[str, list[dict]], summary: dict[str, dict], args: argparse.Namespace) -> None:
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    print(f"\nsums task ({MODELS.get(args.model, args.model)}, {gpu}): {args.prompts} prompts x {args.n}, "
          f"<= {args.max_new_tokens} new tokens, {args.steps} steps; greedy accuracy on {args.val_size} held-out "
          f"prompts against training seconds (evaluation excluded)")
    sides = list(curves)
    print(f"{'step':>8s}" + "".join(f" | {SIDES[s]:>9s} s {'acc':>5s}" for s in sides))
    steps = sorted({p["step"] for c in curves.values() for p in c})
    for step in steps:
        cells = []
        for s in sides:
            p = next((p for p in curves[s] if p["step"] == step), None)
            cells.append(f" | {p['train_s']:11.1f} {p['accuracy']:5.3f}" if p else f" | {'':11s} {'':5s}")
        print(f"{step:8d}" + "".join(cells))
    cells = []
    for s in sides:
        r = summary[s]
        cells.append(f" | {r['seconds_to_target']:11.1f} {'':5s}" if r["seconds_to_target"] is not None
                     else f" | {'not reached':>11s} {r['best'] if r['best'] is not None else float('nan'):5.3f}")
    print(f"{'to ' + format(args.target, 'g'):>8s}" + "".join(cells))
    trl = summary.get("trl", {}).get("seconds_to_target")
    for s in sides:
        mine = summary[s]["seconds_to_target"]
        if s != "trl" and trl and mine:
            print(f"{SIDES[s]} reaches {args.target:g} in {trl / mine:.2f}x less time than TRL")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                   help="s0 / s1: this trainer at max staleness 0 / 1 (a rollout pool); trl: TRL's GRPOTrainer")
    p.add_argument("--model", default="smollm2", help="smollm2 (SmolLM2-135M-Instruct), tiny (a tiny random model), "
                   "or any --model.path")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-size", type=int, default=256, help="held-out prompts")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--target", type=float, default=0.8, help="accuracy whose training seconds are reported")
    p.add_argument("--s1-colocate", type=int, default=2,
                   help="s1: processes per GPU (2: actor and rollout on one GPU, as TRL)")
    p.add_argument("--s1-extra", default="--algo.rollout-is token_truncated", help="s1: more trainer flags")
    p.add_argument("--ours-extra", default="", help="s0 and s1: more trainer flags")
    p.add_argument("--trl-micro-batch", type=int, default=256,
                   help="TRL: completions per forward/backward (per_device_train_batch_size)")
    p.add_argument("--trl-generation", choices=["generate", "continuous"], default="generate",
                   help="TRL: HF generate, or transformers' continuous batching (casts the policy to bf16)")
    p.add_argument("--trl-attention", choices=["sdpa-no-cudnn", "sdpa", "eager"], default="sdpa-no-cudnn",
                   help="TRL: transformers' SDPA with torch's cuDNN attention off (its backward can return NaN "
                   "for the fully masked rows of left padding), SDPA as torch picks it, or eager attention")
    p.add_argument("--trl-max-train-s", type=float, default=0.0,
                   help="TRL: stop (and evaluate) once its training clock passes this many seconds (0 = no limit)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--runs-dir", default=None, help="keep each side's run folder (our metrics.jsonl) under this "
                   "folder (default: a temporary one)")
    p.add_argument("--report", default=None, help="only print the table of the JSON lines in this file (--out of "
                   "earlier runs, e.g. one per side; the last run of each side counts)")
    args = p.parse_args(argv)
    if args.report:
        curves, meta = read_report(args.report)
        vars(args).update({k: v for k, v in meta.items() if k in vars(args)})
        print_table(curves, {s: {"target": args.target, **reached(c, args.target)} for s, c in curves.items()}, args)
        return
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    curves: dict[str, list[dict]] = {}
    extra: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs_dir or tmp
        for side in args.sides:
            start = time.perf_counter()
            try:
                if side == "trl":
                    curves[side], extra[side] = run_trl(args, os.path.join(runs, side))
                else:
                    curves[side] = run_ours(args, {"s0": 0, "s1": 1}[side], os.path.join(runs, side))
            except Exception as e:  # noqa: BLE001 - report the other sides (e.g. without trl installed)
                print(f"{SIDES[side]}: FAILED {type(e).__name__}: {str(e)[-1500:]}", flush=True)
                continue
            print(f"{SIDES[side]}: done in {time.perf_counter() - start:.0f} s wall", flush=True)
    if not curves:
        raise SystemExit("no side completed")
    summary = {s: {"target": args.target, **reached(c, args.target)} for s, c in curves.items()}
    print_table(curves, summary, args)
    for side, info in extra.items():
        if "trl/failed" in info:
            print(f"{SIDES[side]} stopped early: {info['trl/failed']}")
    if args.out:
        meta = {"model": MODELS.get(args.model, args.model), "device": args.device, "steps": args.steps,
                "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens, "val_size": args.val_size}
        with open(args.out, "a") as f:
            for side, points in curves.items():
                f.writelines(json.dumps({"side": side, **point, **meta}) + "\n" for point in points)
                f.write(json.dumps({"side": side, "summary": True, **summary[side], **extra.get(side, {}), **meta})
                        + "\n")


if __name__ == "__main__":
    main()
