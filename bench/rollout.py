"""Rollout throughput: the built-in fast decode (NativeRollout) vs plain ``transformers.generate``, one process.

    python bench/rollout.py                                    # GPU: Qwen2-0.5B shape, bf16, batch 64 256 1024
    python bench/rollout.py --shape tiny --batches 4 8 --prompt-len 16 --new-tokens 16   # CPU smoke run

Both sides get the same random-weight model (built from a config, no download), the same random
prompts of ``--prompt-len`` tokens and sample ``--new-tokens`` tokens at temperature 1 (top-k 0,
top-p 1) with EOS ignored (generate: ``min_new_tokens``; the engine: an EOS id outside the
vocabulary), so every row produces exactly ``--new-tokens`` tokens. tok/s = rows x new tokens /
wall time of one call after a warm-up call (the engine's warm-up call captures its CUDA graphs;
its time is shown as "first call"). "after sleep" is a call right after ``sleep(1)`` +
``wake_up()``, which frees and reallocates the KV cache and recaptures the graphs, as in training.
``generate`` above ``--generate-max-batch`` rows is skipped, and a call that runs past
``--generate-max-time`` stops there (its tok/s then counts the tokens it made; the table says so).

The bandwidth ceiling is rows / (bytes a decode step must read / ``--bandwidth``): the weights a
step uses (every linear layer, the norms and the ``lm_head``) plus the K/V of the mean context
(prompt + half the new tokens), in the model dtype. "graph ms" is one decode step alone (its CUDA
graph, which samples the previous logits and runs the forward, replayed 32 times: no host work),
"TB/s" the bytes that step reads (weights + K/V of every cache slot, which is what it attends over)
per second of it.
``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spmd_rl.rollout import NativeRollout  # noqa: E402

SHAPES = {
    # Qwen2-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads of 64, MLP 4864, vocab 151936, tied.
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
}


def bytes_per_step(config: Qwen2Config, *, rows: int, context: float, dtype_bytes: int) -> float:
    h, layers, heads, kv_heads = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                                  config.num_key_value_heads)
    head_dim = h // heads
    per_layer = h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * config.intermediate_size + 2 * h
    weights = layers * per_layer + config.vocab_size * h + h
    kv = rows * layers * 2 * kv_heads * head_dim * context
    return (weights + kv) * dtype_bytes


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--generate-max-batch", type=int, default=1024,
                        help="skip transformers.generate above this many rows")
    parser.add_argument("--generate-max-time", type=float, default=45.0,
                        help="stop a generate call after this many seconds (its max_time) and report the "
                             "tokens it made by then")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth, bytes/s (H200: 4.8e12)")
    parser.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=True,
                        help="the decode layers through torch.compile (NativeRollout's CUDA default)")
    parser.add_argument("--out", type=str, default=None, help="write the table rows here as JSON")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = Qwen2Config(use_sliding_window=False, **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    folder = tempfile.mkdtemp(prefix="bench_rollout_")
    model.save_pretrained(folder)
    engine = NativeRollout(folder, device=device, dtype=dtype, batch_size=max(args.batches), pad_token_id=0,
                           eos_token_ids=[config.vocab_size],  # an id the model cannot produce: EOS ignored
                           compile_decode=None if args.compile_decode else False)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if engine._fast is None:
        raise SystemExit("bench/rollout.py: the fast decode path is off for this model (see the warning above)")
    print(f"device {name}, torch {torch.__version__}, {args.shape} {dtype}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{args.prompt_len} prompt + {args.new_tokens} new tokens, sampling T=1, decode layers "
          f"{'compiled' if engine._fast.compile_layers else 'eager'}", flush=True)

    rows_out = []
    gen = torch.Generator().manual_seed(1)
    for rows in args.batches:
        prompts = torch.randint(3, config.vocab_size, (rows, args.prompt_len), generator=gen)
        tokens = rows * args.new_tokens
        sample = dict(n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens)
        plist = prompts.tolist()
        out, note = {}, ""
        try:
            first = timed(lambda: out.setdefault("first", engine.generate(plist, seed=0, **sample)), device)
        except Exception as exc:  # keep the rest of the table: measure the eager fast path instead
            note = f"CUDA graphs failed ({type(exc).__name__}: {exc}); eager fast path"
            print(note, flush=True)
            engine._fast.release()
            engine._fast.use_graphs = False
            first = timed(lambda: out.setdefault("first", engine.generate(plist, seed=0, **sample)), device)
        fast = timed(lambda: out.setdefault("fast", engine.generate(plist, seed=1, **sample)), device)
        assert out["fast"].response_lengths.eq(args.new_tokens).all(), "EOS was not ignored"
        replay_ms = replay_tb_s = None
        fd = engine._fast
        key = (rows, False, 0, 1.0)  # the step of this batch, sampling at top-k 0 / top-p 1
        if fd.use_graphs and key in fd._graphs:  # the decode step alone: replay its graph, no host work
            graph, slots = fd._graphs[key], fd.cache.shape[4]
            fd._slot.fill_(args.prompt_len)  # replays write slots prompt_len.. (< slots): cache stays in bounds
            fd._pos[:rows].fill_(args.prompt_len)
            fd._col.zero_()  # and output columns 0..
            reps = min(32, slots - args.prompt_len - 1)
            replay_ms = 1e3 * timed(lambda: [graph.replay() for _ in range(reps)], device) / reps
            replay_tb_s = bytes_per_step(config, rows=rows, context=slots, dtype_bytes=torch.finfo(dtype).bits // 8
                                         ) / (replay_ms / 1e3) / 1e12
        engine.sleep(1)
        engine.wake_up()
        after_sleep = timed(lambda: engine.generate(plist, seed=2, **sample), device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")

        hf, hf_tokens = None, 0
        if rows <= args.generate_max_batch:
            ids = prompts.to(device)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
                hf = timed(lambda: out.setdefault("hf", model.generate(
                    ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    max_time=args.generate_max_time, **kwargs)), device)
            made = out["hf"].shape[1] - args.prompt_len
            hf_tokens = rows * made
            if made < args.new_tokens:
                note += f"generate stopped by --generate-max-time after {made} of {args.new_tokens} tokens"

        context = args.prompt_len + (args.new_tokens - 1) / 2
        ceiling = rows * args.bandwidth / bytes_per_step(config, rows=rows, context=context,
                                                         dtype_bytes=torch.finfo(dtype).bits // 8)
        row = dict(rows=rows, fast_tok_s=tokens / fast, fast_ms_per_step=1e3 * fast / args.new_tokens,
                   graph_replay_ms=replay_ms, graph_replay_tb_s=replay_tb_s,
                   first_call_s=first, after_sleep_s=after_sleep, fast_s=fast,
                   generate_tok_s=hf_tokens / hf if hf else None, generate_s=hf,
                   ratio=(tokens / fast) / (hf_tokens / hf) if hf else None, ceiling_tok_s=ceiling,
                   fraction_of_ceiling=tokens / fast / ceiling, peak_gib=peak, graphs=sorted(fd._graphs), note=note)
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{'batch':>6} {'fast tok/s':>11} {'ms/step':>8} {'graph ms':>8} {'TB/s':>5} {'generate tok/s':>15} "
          f"{'ratio':>7} "
          f"{'ceiling tok/s':>14} {'of ceiling':>10} {'first call s':>12} {'after sleep s':>13}")
    for r in rows_out:
        gen_s = f"{r['generate_tok_s']:15,.0f}" if r["generate_tok_s"] else f"{'skipped':>15}"
        ratio = f"{r['ratio']:6.1f}x" if r["ratio"] else f"{'-':>7}"
        graph_s = (f"{r['graph_replay_ms']:8.2f} {r['graph_replay_tb_s']:5.2f}" if r["graph_replay_ms"]
                   else f"{'-':>8} {'-':>5}")
        print(f"{r['rows']:6d} {r['fast_tok_s']:11,.0f} {r['fast_ms_per_step']:8.2f} {graph_s} {gen_s} {ratio} "
              f"{r['ceiling_tok_s']:14,.0f} {r['fraction_of_ceiling']:10.1%} {r['first_call_s']:12.2f} "
              f"{r['after_sleep_s']:13.2f}" + (f"  ({r['note']})" if r["note"] else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, shape=args.shape, dtype=str(dtype),
                                                  prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                                  rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
