"""FP8 rollout weights (``--rollout.dtype fp8``) against the model dtype: decode speed and the log-prob gap.

    python bench/fp8_rollout.py                                          # one H200: the speed table below (~4 min)
    python bench/fp8_rollout.py --gap-model smollm2-135m-instruct --speed-shapes   # the gap on a real model only
    python bench/fp8_rollout.py --speed-shapes tiny --batches 8 --prompt-len 16 --new-tokens 16 \\
        --gap-model tiny --gap-prompts 4 --gap-new-tokens 8                # CPU smoke run (seconds)

**Speed** (``--speed-shapes``, random bf16 weights of bench/rollout.py's shapes): the fast decoder's fixed
mix (``--batches`` rows of ``--prompt-len`` random tokens, exactly ``--new-tokens`` new tokens each, T=1)
on the model's weights, then on the same model with its projections in FP8 (the decoder built again
with ``fp8=True``, which quantises them in place). tok/s = rows x new tokens / wall time of one call
after a warm-up call (compilation, graph capture); "graph step" = one decode step's CUDA graph replayed
alone; "weights" = the bytes the decoder reads per step (the projections at one byte in FP8).

**Gap** (``--gap-model``: a Hugging Face folder, a built-in name such as ``smollm2-135m-instruct``, or a
bench/shapes.py shape):
the built-in rollout (``NativeRollout``, bf16 on CUDA) generates ``--gap-prompts`` x ``--gap-n``
responses (T=1, EOS ignored) once with each weight format; the FSDP engine (the trainer: fp32 weights,
bf16 compute on CUDA) scores the same tokens; reported per format: mean and max |trainer - rollout|
log-prob and ``rollout_corr/kl`` / ``k3_kl`` (:func:`spmd_rl.algo.rollout_correction`). Prompts are the
arithmetic task's questions in the model's chat template when it has one, else random ids.

``--out FILE`` appends every row as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import SHAPES, build_model, timed  # noqa: E402  (bench/rollout.py)
from shapes import SHAPES as FOLDER_SHAPES  # noqa: E402
from shapes import model_folder  # noqa: E402

from spmd_rl.rollout.fast import FastDecoder, batch_buckets  # noqa: E402


def weight_bytes(fd: FastDecoder, model: torch.nn.Module) -> int:
    """What the decoder reads of the weights per step: every parameter of the model except the projections
    (embedding rows aside), plus the projections' fused tensors in their own formats."""
    fused = {id(p) for u in fd.fused for p in u.parameters()}
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if id(p) not in fused and not (n.endswith("embed_tokens.weight") and model.lm_head.weight is not p))
    return rest + sum(t.numel() * t.element_size() for u in fd.fused for t in u.tensors())


def speed_rows(shape: str, batch: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    model = build_model(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch)).tolist()
    eos = torch.tensor([vocab], device=device)  # an id the model cannot produce: EOS ignored
    rows, base = [], None
    for fp8 in (False, True):
        fd = FastDecoder(model, device=device, max_batch=batch, pad_token_id=0, fp8=fp8,
                         compile_layers=args.compile_decode and device.type == "cuda")
        fd.buckets = batch_buckets(batch)

        def call(seed: int, fd: FastDecoder = fd):
            gen = torch.Generator(device=device).manual_seed(seed)
            return fd.generate_chunk(prompts, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                                     generator=gen, eos=eos)

        first = timed(lambda: call(0), device)
        wall = timed(lambda: call(1), device)
        tok_s = batch * args.new_tokens / wall
        replay_ms = None
        keys = [k for k in fd._graphs if k[0] == batch]
        if fd.use_graphs and keys:
            graph = fd._graphs[max(keys, key=lambda k: k[1])]
            replay_ms = 1e3 * timed(lambda: [graph.replay() for _ in range(32)], device) / 32
        base = base or tok_s
        rows.append(dict(kind="speed", shape=shape, batch=batch, weights="fp8" if fp8 else str(model.dtype).split(".")[-1],
                         fp8_gemms=fd.fp8_units, gemms=len(fd.fused), tok_s=tok_s, ms_per_step=1e3 * wall / args.new_tokens,
                         graph_step_ms=replay_ms, first_call_s=first, weight_gb=weight_bytes(fd, model) / 1e9,
                         vs_model_dtype=tok_s / base))
        print(json.dumps(rows[-1]), flush=True)
        fd.release()
        del fd
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def gap_prompts(folder: str, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The arithmetic task's questions in the model's chat template, else random ids."""
    from spmd_rl.data.prompts import encode_chats, has_chat_template
    from spmd_rl.data.tasks import generate_arithmetic
    from spmd_rl.models import load_tokenizer

    try:
        tok = load_tokenizer(folder)
    except Exception:  # noqa: BLE001  (a folder without a tokenizer)
        tok = None
    if tok is not None and has_chat_template(tok):
        _, samples = generate_arithmetic(seed=0, val_size=args.gap_prompts, operand_min=0, operand_max=99, ops="+",
                                         instruction="Reply with only the final number.")
        return encode_chats(tok, [[{"role": "user", "content": s.prompt}] for s in samples])
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.gap_prompts)]


def gap_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    from spmd_rl.algo import rollout_correction
    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.rollout.native import NativeRollout

    from spmd_rl.models import resolve_model_path

    folder = (model_folder(args.gap_model, root=args.root) if args.gap_model in FOLDER_SHAPES
              else resolve_model_path(args.gap_model, cache_dir=None))
    outs = {}
    for fp8 in (False, True):
        rollout = NativeRollout(folder, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                batch_size=args.gap_prompts * args.gap_n, pad_token_id=0, eos_token_ids=[], fp8=fp8)
        prompts = gap_prompts(folder, args, int(rollout.model.config.vocab_size))
        start = time.perf_counter()
        outs[fp8] = (rollout.generate(prompts, n=args.gap_n, temperature=1.0, top_p=1.0, top_k=0,
                                      max_new_tokens=args.gap_new_tokens, seed=1), time.perf_counter() - start)
        rollout.close()
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build(device.type), device=device, fsdp=FsdpConfig(),
                        actor=ActorConfig(), trainable=False, pad_token_id=0, use_packing=device.type == "cuda")
    rows = []
    for fp8, (out, gen_s) in outs.items():
        batch = RolloutBatch(prompts=out.prompt_ids, tensors={"response_ids": out.response_ids,
                                                              "response_mask": out.response_mask})
        lp, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=args.gap_micro_batch)
        mask = out.response_mask
        gap = (lp.float().cpu() - out.logprobs) * mask
        _, _, metrics = rollout_correction(lp.float().cpu(), out.logprobs, mask, is_level="token")
        rows.append(dict(kind="gap", model=args.gap_model, weights="fp8" if fp8 else "model dtype",
                         tokens=int(mask.sum()), logprob_abs_diff_mean=float(gap.abs().sum() / mask.sum()),
                         logprob_abs_diff_max=float(gap.abs().max()), kl=metrics["rollout_corr/kl"],
                         k3_kl=metrics["rollout_corr/k3_kl"], gen_s=gen_s))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speed-shapes", nargs="*", choices=sorted(SHAPES), default=["qwen2.5-7b", "qwen3-1.7b"])
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="fixed-mix batch sizes (default: 64 for qwen2.5-7b, 256 for the others)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gap-model", default=None, help="a Hugging Face folder or a bench/shapes.py shape (none: no gap rows)")
    p.add_argument("--gap-prompts", type=int, default=64)
    p.add_argument("--gap-n", type=int, default=4)
    p.add_argument("--gap-new-tokens", type=int, default=128)
    p.add_argument("--gap-micro-batch", type=int, default=32)
    p.add_argument("--root", default=os.path.expanduser("~/.cache/spmd_rl/bench_models"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="append the rows to this JSONL file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for shape in args.speed_shapes:
        for batch in args.batches or [64 if shape == "qwen2.5-7b" else 256]:
            rows += speed_rows(shape, batch, args, device)
    if args.gap_model:
        from spmd_rl.distributed.env import DistEnv

        env = DistEnv.from_environ().init(device=args.device)
        rows += gap_rows(args, env.device)
        env.shutdown()
    print("\n| shape | batch | weights | FP8 GEMMs | tok/s | × model dtype | ms / step | graph step | weights GB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "speed"):
        step = f"{r['graph_step_ms']:.2f} ms" if r["graph_step_ms"] else "-"
        print(f"| {r['shape']} | {r['batch']} | {r['weights']} | {r['fp8_gemms']} of {r['gemms']} | {r['tok_s']:,.0f} | "
              f"{r['vs_model_dtype']:.2f}× | {r['ms_per_step']:.2f} | {step} | {r['weight_gb']:.2f} |")
    gaps = [r for r in rows if r["kind"] == "gap"]
    if gaps:
        print("\n| model | rollout weights | tokens | mean abs Δ logp | max abs Δ logp | rollout_corr/kl | k3_kl |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for r in gaps:
            print(f"| {r['model']} | {r['weights']} | {r['tokens']} | {r['logprob_abs_diff_mean']:.2e} | "
                  f"{r['logprob_abs_diff_max']:.2e} | {r['kl']:.2e} | {r['k3_kl']:.2e} |")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
