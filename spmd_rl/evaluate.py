"""Score a model on held-out prompts: greedy answers (or ``trainer.val_n`` sampled ones with pass@k),
the task's rule reward, accuracy. SPMD like the trainer (the prompts are split over the ranks), or
one process.

    python -m spmd_rl.evaluate                                              # base model, default task
    python -m spmd_rl.evaluate --from-checkpoint runs/quickstart                 # its newest checkpoint
    python -m spmd_rl.evaluate --trainer.val-n 8 --trainer.val-temperature 1.0 --limit 16  # pass@1..8
    torchrun --nproc-per-node 8 -m spmd_rl.evaluate --config configs/gsm8k.yaml \\
        --data.val-path /data/gsm8k/test.jsonl --from-checkpoint runs/gsm8k --out gsm8k_test.json

The config is the trainer's (same flags, same presets), so a run's ``config.yaml`` evaluates the
same task, prompt format and lengths it trained on. Which prompts: every record of
``data.val_path`` when it is set (``--limit N`` keeps the first N), else the task's held-out split
of ``data.val_size`` prompts, exactly what the trainer validates on. Weights: ``model.path`` (a
Hugging Face folder, a ``.gguf`` file or a packaged model), overwritten by the actor of ``--from-checkpoint`` (a run
folder, its ``checkpoints`` folder or one ``step_N``) when given. Decoding:
``trainer.val_n`` answers per prompt at ``trainer.val_temperature`` (default: one, greedy),
``rollout.max_new_tokens``.

A response counts as correct when the task's main scorer gives it full marks (the format bonus is
not part of accuracy); accuracy and score are means over all answers, and the summary also holds
``pass@k`` and ``mean@k`` for k = 1, 2, 4, ... and val_n (:mod:`spmd_rl.passk`). Rank 0
prints the summary and writes it as JSON with ``--out``; ``--samples-out`` writes one JSON line per
answer (prompt, completion, score, correct).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spmd_rl.atomic import write_atomic
from spmd_rl.config import Config, load_config
from spmd_rl.distributed.comm import all_gather_objects, fail_together
from spmd_rl.distributed.env import DistEnv
from spmd_rl.metrics import setup_logging

log = logging.getLogger("spmd_rl")


@dataclass(kw_only=True)
class EvalFlags:
    """Evaluation: greedy (or `trainer.val_n` sampled) answers of a model or a checkpoint on held-out prompts."""

    from_checkpoint: str | None = None
    """A run folder, its `checkpoints` folder or one `step_N` folder: its actor weights replace
    `model.path`'s (which still gives the architecture and tokenizer)."""
    limit: int = 0
    """Score only the first N held-out prompts (0 = all of them)."""
    out: str | None = None
    """Write the summary as JSON to this file (rank 0)."""
    samples_out: str | None = None
    """Write one JSON line per answer (prompt, completion, score, correct) to this file (rank 0)."""


def held_out_prompts(cfg: Config, limit: int):
    """The held-out samples to score: all of ``data.val_path`` (or the task's held-out split)."""
    from spmd_rl.data import build_prompts

    data = cfg.data
    if data.val_path is not None:  # a file: every record unless --limit
        data = dataclasses.replace(data, val_size=limit or sys.maxsize)
    _, val = build_prompts(data)
    val = val[:limit] if limit else val
    if not val:
        raise ValueError("no held-out prompts to evaluate: set --data.val-path, or --data.val-size > 0")
    return val


def evaluate(cfg: Config, flags: EvalFlags, env: DistEnv) -> dict[str, float | int | str | None]:
    """Score this rank's share of the held-out prompts; every rank returns the same summary."""
    from spmd_rl.data.prompts import render_prompts
    from spmd_rl.data.tasks import columns_of
    from spmd_rl.models import decode_responses, eos_token_ids, load_tokenizer, resolve_model_path
    from spmd_rl.passk import answer_metrics, is_correct
    from spmd_rl.reward.registry import build_scorer
    from spmd_rl.rollout import build_rollout

    group = None  # the world: env.init() joins it, also as a world of one
    start = time.perf_counter()
    with fail_together(group=group, what="evaluation setup"):
        folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir)
        tokenizer = load_tokenizer(folder, trust_remote_code=cfg.model.trust_remote_code)
        samples, prompt_ids, dropped = render_prompts(
            held_out_prompts(cfg, flags.limit), tokenizer, system_prompt=cfg.data.system_prompt,
            max_prompt_length=cfg.data.max_prompt_length)
        scorer = build_scorer(fn=cfg.reward.fn, task=cfg.data.task, format_weight=cfg.reward.format_weight,
                              on_error=cfg.reward.on_error, timeout_s=cfg.reward.timeout_s)
        device = env.device
        rollout = build_rollout(
            "native", model_folder=folder, device=device,
            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            batch_size=cfg.rollout.batch_size, pad_token_id=int(tokenizer.pad_token_id),
            eos_token_ids=eos_token_ids(tokenizer), trust_remote_code=cfg.model.trust_remote_code)
        if flags.from_checkpoint is not None:
            from spmd_rl.export import load_model_state

            rollout.load_weights(load_model_state(flags.from_checkpoint).items())
    setup_s = time.perf_counter() - start

    share = math.ceil(len(samples) / env.world_size)
    mine = list(range(env.rank * share, min((env.rank + 1) * share, len(samples))))
    start = time.perf_counter()
    rows: list[dict[str, object]] = []
    new_tokens = 0
    with fail_together(group=group, what="evaluation"):
        if mine:
            n = cfg.trainer.val_n
            out = rollout.generate([prompt_ids[i] for i in mine], n=n, temperature=cfg.trainer.val_temperature,
                                   top_p=1.0, top_k=0, max_new_tokens=cfg.rollout.max_new_tokens,
                                   seed=cfg.trainer.seed)
            new_tokens = int(out.response_mask.sum().item())
            texts = decode_responses(tokenizer, out.response_ids, out.response_mask)
            picked = [samples[i] for i in mine for _ in range(n)]  # prompt-major: n answers per prompt
            result = scorer([s.prompt for s in picked], texts, columns_of(picked))
            for row, (text, score, main, cut) in enumerate(zip(texts, result.scores, result.main_scores,
                                                               out.truncated.tolist())):
                i = mine[row // n]
                rows.append({"index": i, "sample": row % n, "prompt": samples[i].prompt, "completion": text,
                             "score": float(score), "correct": is_correct(main), "truncated": bool(cut)})
    rollout.close()
    gen_s = time.perf_counter() - start
    gathered = all_gather_objects((rows, new_tokens, gen_s), group)
    rows = sorted((r for part, _, _ in gathered for r in part), key=lambda r: (r["index"], r["sample"]))
    tokens = sum(t for _, t, _ in gathered)
    slowest = max(s for _, _, s in gathered)
    summary = {
        "model": cfg.model.path, "checkpoint": flags.from_checkpoint, "task": cfg.data.task,
        "path": cfg.data.val_path or cfg.data.path, "prompts": len({r["index"] for r in rows}), "dropped_too_long": dropped,
        "samples_per_prompt": cfg.trainer.val_n,
        **answer_metrics((r["index"], r["score"], r["correct"]) for r in rows),
        "truncated": sum(r["truncated"] for r in rows) / len(rows),
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.trainer.val_temperature,
        "world_size": env.world_size, "setup_s": round(setup_s, 2), "generate_s": round(slowest, 2),
        "new_tokens_per_s": round(tokens / max(slowest, 1e-9), 1),
    }
    if env.is_main:
        if flags.samples_out:
            _write(flags.samples_out, "".join(json.dumps(r) + "\n" for r in rows))
        if flags.out:
            _write(flags.out, json.dumps(summary, indent=2) + "\n")
    return summary


def _write(path: str, text: str) -> None:
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, text)


def main(argv: list[str] | None = None) -> int:
    env = DistEnv.from_environ()
    setup_logging(env.rank, env.hostname)
    try:
        cfg, flags = load_config(argv, prog="spmd_rl.evaluate", extra=EvalFlags, description=__doc__)
        if flags.limit < 0:
            raise ValueError(f"--limit must be >= 0 (0 = all), got {flags.limit}")
        if flags.from_checkpoint is not None and not os.path.exists(flags.from_checkpoint):
            raise FileNotFoundError(f"--from-checkpoint {flags.from_checkpoint}: no such file or folder")
    except (ValueError, FileNotFoundError) as e:
        if env.is_main:
            print(f"spmd_rl.evaluate: {e}", file=sys.stderr)
        return 2
    env.init(device=cfg.trainer.device, timeout_s=cfg.trainer.dist_timeout_s)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        summary = evaluate(cfg, flags, env)
    finally:
        env.shutdown()
    if env.is_main:
        passk = "".join(f"; {k} {v:.4f}" for k, v in summary.items() if k.startswith("pass@") and k != "pass@1")
        print(f"accuracy {summary['accuracy']:.4f} on {summary['prompts']} prompts ({summary['task']}; "
              f"score {summary['score']:.4f}{passk}; truncated {summary['truncated']:.3f}; "
              f"{summary['new_tokens_per_s']} new tok/s)")
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
