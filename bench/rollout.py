"""Rollout throughput: the built-in fast decoder vs plain ``transformers.generate``, one process, one table.

    python bench/rollout.py                              # GPU: the four shapes below, batch 64 and 256 (~20 min, H200)
    python bench/rollout.py --shapes qwen3-0.6b --batches 256 --mixes fixed      # a subset
    python bench/rollout.py --shapes qwen3-0.6b --batches 256 --rows-per-slot 2 8 --attention auto sdpa
    python bench/rollout.py --shapes qwen2.5-7b --batches 64 --mixes fixed longtail stream --rows-per-slot 8
    python bench/rollout.py --shapes tiny tiny-moe --batches 4 8 --prompt-len 16 --new-tokens 16 \\
        --longtail-min 4 --longtail-max 32 --longtail-batches 4 --rows-per-slot 2 8    # CPU smoke run

Shapes (random weights from transformers' config classes, bf16 on CUDA, fp32 on CPU; no download):
Qwen3-0.6B, Qwen3-1.7B, Qwen2.5-7B, ``qwen3-moe`` (Qwen3-30B-A3B's layer, 24 of its 48 layers: 15B
parameters, 128 experts, top-8, so it fits one GPU), the older ``qwen2-0.5b``, and ``tiny`` /
``tiny-moe`` for CPU runs. One model object serves both sides: the fast decoder's fused GEMMs are
views of the HF parameters, so ``generate`` runs on the same weights.

Three mixes, EOS ignored (an EOS id outside the vocabulary), sampling at T=1, top-k 0, top-p 1:

* ``fixed``: ``batch`` rows of ``--prompt-len`` random tokens, each exactly ``--new-tokens`` new
  tokens. tok/s = rows x new tokens / wall time of one call after a warm-up call (which compiles the
  decode layers and captures the CUDA graphs: "first call s"). ``generate`` gets the same prompts
  (``min_new_tokens`` forces the length) unless above ``--generate-max-batch`` rows; a call past
  ``--generate-max-time`` stops there and its tok/s counts the tokens it made (the note says so).
* ``longtail``: ``--rows-per-slot`` x ``batch`` rows on ``batch`` sequence slots (continuous batching:
  a finished row's slot takes the next queued row; 8 rows per slot is a GRPO step of ``batch`` prompts
  x n = 8), each row's length drawn log-uniform in ``[--longtail-min, --longtail-max]`` (seed 0) and
  forced by per-row limits. Its graphs (every bucket and attention span) are captured before the timed
  call ("capture s"). "of fixed" = its tok/s over the fixed mix's at the same batch and attention;
  "occupancy" = tokens / (decode steps x slots). By default each shape runs it at the batch of its goal
  (64 for the 7B and MoE shapes, 256 for the others); ``--longtail-batches`` picks others. When the
  cache of ``batch`` slots x (prompt + longest length) does not fit, the slots halve until it does
  (the note says so).
* ``stream``: the same lengths fed without end to :func:`~spmd_rl.rollout.stream.stream_decode` on
  ``batch`` slots, as the rollout pool runs with ``rollout.stream`` (asynchronous GRPO: the next steps'
  prompts take the slots of finished rows, so no call drains its tail). tok/s over ``--stream-steps``
  decode steps after ``--stream-warmup`` steps (by then the rows in flight have the stream's steady mix
  of lengths rather than all starting together); the tokens of a window are those of the rows finished
  in it plus the progress of the rows in the slots, read at its two ends. Its ceiling is the long-tail
  formula for the mix's lengths (100,000 draws).

The bandwidth ceiling (:func:`ceiling_tok_s`, one model for both mixes) is tokens over the time an ideal
decode needs to read its bytes at ``--bandwidth``: ``tokens / slots`` steps (every slot busy every
step), each reading the weights once (every linear layer, the norms, the ``lm_head``; of the routed
experts the share a batch of ``slots`` rows is expected to hit), plus, per generated token, the K/V of
its context (prompt + the tokens before it), in the model dtype. For the fixed mix the mean context is
prompt + (new tokens - 1) / 2; for the long tail it follows the lengths drawn (E[L^2] / 2E[L] past the
prompt: long rows hold most tokens, and each of those reads a long context), so its ceiling is lower
than the fixed mix's at the same batch, and "of fixed" cannot reach 100 % on shapes whose K/V
dominates a step. "graph ms" is one fixed-mix decode step alone (its CUDA graph replayed 32 times: no
host work) and "TB/s" the bytes it reads (weights + the K/V it attends over: each row's own entries
with flash varlen or the Triton kernel, the step's span of slots with SDPA) per second.

``--attention`` runs the table once per decode attention of the full-length layers: ``auto`` (what the
rollout picks), ``varlen``, ``triton`` (each row's own entries) or ``sdpa`` (masked, over the span);
one that does not run on this device is skipped with a line saying so. A ``timeout`` (SIGTERM) prints
the rows measured so far. ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import (
    Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spmd_rl.distributed.env import use_host_threads  # noqa: E402
from spmd_rl.rollout import decode_attention  # noqa: E402
from spmd_rl.rollout.fast import FastDecoder, batch_buckets  # noqa: E402
from spmd_rl.rollout.stream import stream_decode  # noqa: E402

QWEN3 = (Qwen3Config, Qwen3ForCausalLM)
COMMON = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False)
SHAPES = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 heads / 8 KV heads of 128, MLP 3072, vocab 151936, tied.
    "qwen3-0.6b": (*QWEN3, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    # Qwen3-1.7B: 28 layers, hidden 2048, 16 heads / 8 KV heads of 128, MLP 6144, vocab 151936, tied.
    "qwen3-1.7b": (*QWEN3, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    # Qwen2.5-7B: 28 layers, hidden 3584, 28 heads / 4 KV heads of 128, MLP 18944, vocab 152064, untied.
    "qwen2.5-7b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, tie_word_embeddings=False)),
    # Qwen3-30B-A3B's layers (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top-8,
    # renormalised), 24 of its 48 layers: 15B parameters, 30 GB in bf16.
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, tie_word_embeddings=False)),
    # Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads / 2 KV heads of 128, MLP 8960, vocab 151936, tied.
    "qwen2.5-1.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen2-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads of 64, MLP 4864, vocab 151936, tied.
    "qwen2-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True)),
    "tiny": (*QWEN3, dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "tiny-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, tie_word_embeddings=True)),
}
DEFAULT_SHAPES = ["qwen3-0.6b", "qwen3-1.7b", "qwen2.5-7b", "qwen3-moe"]
LONGTAIL_BATCH = {"qwen2.5-7b": 64, "qwen3-moe": 64}  # the issue's goal batch of each shape; 256 otherwise


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config_cls, model_cls, kwargs = SHAPES[shape]
    config = config_cls(**COMMON, **kwargs)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the model dtype: no float32 copy of a 15B model
    try:
        with torch.device(device):
            model = model_cls(config).eval()
    finally:
        torch.set_default_dtype(default)
    return model.requires_grad_(False)


def bytes_per_step(model: torch.nn.Module, *, rows: int, context: float) -> float:
    """Bytes one decode step of ``rows`` rows reads: the weights it uses (routed experts: the share a batch of
    ``rows`` tokens is expected to hit) and the K/V of ``context`` positions per row, model dtype."""
    config = model.config
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    total = 0.0
    for name, p in model.named_parameters(remove_duplicate=True):
        if name.endswith("embed_tokens.weight") and not tied:
            continue  # only the rows of the batch's tokens are read
        share = 1.0
        if ".experts." in name:
            k, e = config.num_experts_per_tok, config.num_experts
            share = 1 - (1 - k / e) ** rows
        total += p.numel() * p.element_size() * share
    attn = model.model.layers[0].self_attn
    item = model.model.embed_tokens.weight.element_size()
    kv = rows * config.num_hidden_layers * 2 * config.num_key_value_heads * attn.head_dim * context * item
    return total + kv


def mean_context(prompt_len: int, lengths: list[int]) -> float:
    """Mean context a generated token attends over: row of ``L`` new tokens, its ``t``-th token reads the
    prompt and the ``t`` tokens before it, so the rows add ``L P + L (L - 1) / 2`` over ``sum(L)`` tokens."""
    return prompt_len + sum(n * (n - 1) / 2 for n in lengths) / sum(lengths)


def draw_limits(args: argparse.Namespace, count: int, generator: torch.Generator | None = None) -> list[int]:
    """``count`` long-tail lengths, log-uniform in ``[--longtail-min, --longtail-max]`` (``generator``:
    default a fresh one seeded 0, the long-tail mix's draws)."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    lo, hi = math.log(args.longtail_min), math.log(args.longtail_max)
    u = torch.rand(count, generator=generator)
    return (u * (hi - lo) + lo).exp().round().clamp(args.longtail_min, args.longtail_max).long().tolist()


def ceiling_tok_s(model: torch.nn.Module, *, slots: int, prompt_len: int, lengths: list[int],
                  bandwidth: float) -> float:
    """The bandwidth ceiling of a mix of rows with ``lengths`` new tokens on ``slots`` sequence slots:
    tokens / the time to read, at ``bandwidth``, the weights once per ideal step (``tokens / slots`` steps)
    plus each generated token's context of K/V, i.e. ``slots`` tokens per :func:`bytes_per_step` of
    ``slots`` rows at the mix's :func:`mean_context`."""
    return slots * bandwidth / bytes_per_step(model, rows=slots, context=mean_context(prompt_len, lengths))


def profile_replays(graph: torch.cuda.CUDAGraph, *, label: str, top: int, replays: int = 8) -> None:
    """``replays`` replays of a decode step's graph under torch.profiler: the kernels' device time per
    step by group (GEMM / attention / the rest) and the ``top`` kernels, to see where a step short of
    the bandwidth ceiling goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels) / replays or 1.0  # us per step
    groups = {"attention": ("flash", "fmha", "attention", "_partials", "_merge"), "gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas")}
    share = {g: 0.0 for g in (*groups, "other")}
    for e in kernels:
        name = e.key.lower()
        share[next((g for g, keys in groups.items() if any(k in name for k in keys)), "other")] += e.self_device_time_total / replays
    print(f"profile {label}: kernels {total / 1e3:.2f} ms per step, {sum(e.count for e in kernels) // replays} "
          "launches; " + ", ".join(f"{g} {t / 1e3:.2f} ms" for g, t in share.items()), flush=True)
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / replays / 1e3:7.3f} ms  x{e.count // replays:<4d} {e.key[:110]}", flush=True)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Bench:
    """One shape's model, its fast decoder and the calls the table times."""

    def __init__(self, shape: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
        self.shape, self.args, self.device = shape, args, device
        self.model = build_model(shape, device, dtype)
        self.vocab = self.model.config.vocab_size
        self.fd = FastDecoder(self.model, device=device, max_batch=max(args.batches + (args.longtail_batches or [])),
                              pad_token_id=0, compile_layers=args.compile_decode and device.type == "cuda")
        self.picked = self.fd.attention  # what the rollout would use here
        self.attention = self.picked
        self.eos = torch.tensor([self.vocab], device=device)  # an id the model cannot produce: EOS ignored
        self.sample = dict(temperature=1.0, top_k=0, top_p=1.0)
        self.fixed_tok_s: dict[tuple[str, int], float] = {}
        self.sized_for: tuple[str, int] | None = None  # (attention, batch) of the last long-tail call's cache

    def use(self, attention: str) -> str | None:
        """Switch the decoder's attention (``auto``: the rollout's pick); None when it does not run here."""
        name = self.picked if attention == "auto" else attention
        dtype, fd = self.model.dtype, self.fd
        probe = {"dtype": dtype, "device": self.device, "heads": fd.heads, "kv_heads": fd.kv_heads,
                 "head_dim": fd.head_dim}
        runs = {"varlen": decode_attention.varlen_works, "triton": decode_attention.decode_attention_works}.get(name, lambda **_: True)
        if not runs(**probe):
            return None
        if name != fd.attention:
            fd.release()  # the graphs captured the other attention
            self.sized_for = None
            fd.attention = name
        self.attention = name
        return name

    def call(self, prompts: list[list[int]], *, max_new: int, limits: list[int] | None = None, seed: int = 0):
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return self.fd.generate_chunk(prompts, max_new_tokens=max_new, generator=gen, eos=self.eos,
                                      max_new_per_row=limits, **self.sample)

    def prompts(self, rows: int, seed: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (rows, self.args.prompt_len), generator=torch.Generator().manual_seed(seed))

    def fixed(self, batch: int) -> dict:
        args, fd, device = self.args, self.fd, self.device
        fd.buckets = batch_buckets(batch)
        self.sized_for = None  # the cache may grow for this batch
        prompts = self.prompts(batch, seed=batch)
        plist, note = prompts.tolist(), ""
        try:
            first = timed(lambda: self.call(plist, max_new=args.new_tokens), device)
        except Exception as exc:  # keep the rest of the table: measure the eager fast path instead
            note = f"CUDA graphs failed ({type(exc).__name__}: {exc}); eager fast path"
            print(note, flush=True)
            fd.release()
            fd.use_graphs = False
            first = timed(lambda: self.call(plist, max_new=args.new_tokens), device)
        out = {}
        fast = timed(lambda: out.setdefault("fast", self.call(plist, max_new=args.new_tokens, seed=1)), device)
        assert out["fast"][1].sum(-1).eq(args.new_tokens).all(), "EOS was not ignored"
        tokens = batch * args.new_tokens
        self.fixed_tok_s[self.attention, batch] = tokens / fast
        replay_ms = replay_tb_s = None
        keys = [k for k in fd._graphs if k[0] == batch and k[2:] == (False, 0, 1.0)]
        if fd.use_graphs and keys:  # the decode step alone: replay its graph (the call's last span), no host work
            key = max(keys, key=lambda k: k[1])
            span = key[1]
            fd._wpos[:batch].fill_(args.prompt_len)  # writes stay at slot prompt_len; attention over the span
            fd._pos[:batch].fill_(args.prompt_len)
            fd._ncol.zero_()
            graph = fd._graphs[key]
            replay_ms = 1e3 * timed(lambda: [graph.replay() for _ in range(32)], device) / 32
            read = args.prompt_len + 1 if fd.attention != "sdpa" else span  # varlen / triton: each row's own entries
            replay_tb_s = bytes_per_step(self.model, rows=batch, context=read) / (replay_ms / 1e3) / 1e12
            if args.profile:
                profile_replays(graph, label=f"{self.shape} batch {batch}", top=args.profile_top)
        hf, hf_tokens = None, 0
        if batch <= args.generate_max_batch:
            ids = prompts.to(device)
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0)
            with torch.no_grad():
                self.model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
                hf = timed(lambda: out.setdefault("hf", self.model.generate(
                    ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    max_time=args.generate_max_time, **kwargs)), device)
            made = out["hf"].shape[1] - args.prompt_len
            hf_tokens = batch * made
            if made < args.new_tokens:
                note += f"generate stopped by --generate-max-time after {made} of {args.new_tokens} tokens"
        ceiling = ceiling_tok_s(self.model, slots=batch, prompt_len=args.prompt_len, lengths=[args.new_tokens] * batch,
                                bandwidth=args.bandwidth)
        return dict(shape=self.shape, mix="fixed", attention=self.attention, batch=batch, slots=batch, rows=batch,
                    rows_per_slot=1, tokens=tokens,
                    fast_tok_s=tokens / fast, fast_s=fast, ms_per_step=1e3 * fast / args.new_tokens,
                    graph_replay_ms=replay_ms, graph_replay_tb_s=replay_tb_s, first_call_s=first,
                    generate_tok_s=hf_tokens / hf if hf else None, generate_s=hf,
                    ratio=(tokens / fast) / (hf_tokens / hf) if hf else None, ceiling_tok_s=ceiling,
                    fraction_of_ceiling=tokens / fast / ceiling,
                    mean_context=mean_context(args.prompt_len, [args.new_tokens] * batch), of_fixed=None,
                    occupancy=1.0, note=note)

    def size_and_capture(self, batch: int, first: Callable[[], object]) -> tuple[int, str, float]:
        """``first()`` sizes the cache for ``batch`` slots, halving them while it does not fit; then every
        bucket and span is captured. Returns the slots, a note when they were halved, the capture seconds."""
        fd, slots, note = self.fd, batch, ""
        if self.sized_for != (self.attention, batch):  # the last long-tail call's cache and graphs serve again
            fd.release()  # the cache is sized for this mix alone (not for a larger fixed batch before it)
        while True:
            fd.buckets = batch_buckets(slots)
            try:
                first()
                break
            except MemoryError as exc:
                if slots == 1:
                    raise
                note = f"{batch} slots do not fit ({str(exc).split(', but ')[0].split('needs ')[-1]}); "
                slots //= 2
        if slots < batch:
            note += f"ran {slots} slots"
        capture = timed(lambda: fd.capture_graphs(**self.sample), self.device)
        self.sized_for = (self.attention, batch)
        return slots, note, capture

    def longtail(self, batch: int, per_slot: int) -> dict:
        args, fd, device = self.args, self.fd, self.device
        rows = per_slot * batch
        plist = self.prompts(rows, seed=10_000 + batch).tolist()
        limits = draw_limits(args, rows)
        # the cache sized for the mix by a call of one token per row
        slots, note, capture = self.size_and_capture(
            batch, lambda: self.call(plist, max_new=args.longtail_max, limits=[1] * rows))
        steps = fd.steps
        out = {}
        elapsed = timed(lambda: out.setdefault("tail", self.call(plist, max_new=args.longtail_max, limits=limits)),
                        device)
        steps = fd.steps - steps
        made = int(out["tail"][1].sum())
        assert made == sum(limits), f"long-tail rows made {made} tokens, their limits sum to {sum(limits)}"
        fixed = self.fixed_tok_s.get((self.attention, batch))
        ceiling = ceiling_tok_s(self.model, slots=slots, prompt_len=args.prompt_len, lengths=limits,
                                bandwidth=args.bandwidth)
        return dict(shape=self.shape, mix="longtail", attention=self.attention, batch=batch, slots=slots, rows=rows,
                    rows_per_slot=per_slot, tokens=made, fast_tok_s=made / elapsed, fast_s=elapsed,
                    ms_per_step=1e3 * elapsed / steps, graph_replay_ms=None, graph_replay_tb_s=None,
                    first_call_s=capture, generate_tok_s=None, generate_s=None, ratio=None, ceiling_tok_s=ceiling,
                    fraction_of_ceiling=made / elapsed / ceiling, mean_context=mean_context(args.prompt_len, limits),
                    of_fixed=made / elapsed / fixed if fixed else None, occupancy=made / (steps * slots), note=note)

    def stream(self, batch: int) -> dict:
        """The long-tail lengths fed as a stream (``rollout.stream``, :func:`stream_decode`): a feed that
        never runs dry, on ``batch`` slots; tok/s over ``--stream-steps`` decode steps once
        ``--stream-warmup`` steps have passed, when the rows in flight have the stream's steady mix of
        lengths instead of all starting together."""
        args, fd = self.args, self.fd
        draw = torch.Generator().manual_seed(0)  # the long-tail mix's lengths, continued as long as the feed runs
        made = {"fed": 0, "finished": 0}

        def feed(k: int) -> list[tuple[int, list[int], int]]:
            limits = draw_limits(args, k, draw)
            ids = self.prompts(k, seed=20_000 + made["fed"]).tolist()
            rows = [(made["fed"] + i, ids[i], limits[i]) for i in range(k)]
            made["fed"] += k
            return rows

        def finish(key, tokens, logprobs, truncated) -> None:
            made["finished"] += len(tokens)

        def run(stop_at: int, marks: dict[int, tuple[float, int] | None] | None = None):
            """A stream interrupted after ``stop_at`` steps; ``marks`` gets (time, tokens made) at the steps it names."""
            def interrupt(steps: int) -> bool:
                if marks is not None and steps in marks:
                    live = fd._row_of != fd._out_tok.shape[0] - 1  # slots holding a row (one host sync)
                    in_slots = int(fd._ncol[live].sum())
                    marks[steps] = (time.perf_counter(), made["finished"] + in_slots)
                return steps >= stop_at

            return stream_decode(fd, feed=feed, finish=finish, max_new_tokens=args.longtail_max,
                                 slots=args.prompt_len + args.longtail_max, seed=0, eos=self.eos,
                                 interrupt=interrupt, **self.sample)

        slots, note, capture = self.size_and_capture(batch, lambda: run(1))  # sized by a one-step stream
        warm, steps = args.stream_warmup, args.stream_steps
        marks = {warm: None, warm + steps: None}
        run(warm + steps, marks)
        (t0, made0), (t1, made1) = marks[warm], marks[warm + steps]
        tokens = made1 - made0
        lengths = draw_limits(args, 100_000, torch.Generator().manual_seed(1))  # the mix's lengths
        fixed = self.fixed_tok_s.get((self.attention, batch))
        ceiling = ceiling_tok_s(self.model, slots=slots, prompt_len=args.prompt_len, lengths=lengths,
                                bandwidth=args.bandwidth)
        tok_s = tokens / (t1 - t0)
        return dict(shape=self.shape, mix="stream", attention=self.attention, batch=batch, slots=slots,
                    rows=made["fed"], rows_per_slot=0, tokens=tokens, fast_tok_s=tok_s, fast_s=t1 - t0,
                    ms_per_step=1e3 * (t1 - t0) / steps, graph_replay_ms=None, graph_replay_tb_s=None,
                    first_call_s=capture, generate_tok_s=None, generate_s=None, ratio=None, ceiling_tok_s=ceiling,
                    fraction_of_ceiling=tok_s / ceiling, mean_context=mean_context(args.prompt_len, lengths),
                    of_fixed=tok_s / fixed if fixed else None, occupancy=tokens / (steps * slots), note=note)

    def close(self) -> None:
        self.fd.release()
        self.model = self.fd = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    def num(v, fmt, width):
        return f"{v:{width}{fmt}}" if v is not None else f"{'-':>{width}}"

    print(f"\n{'shape':>11} {'mix':>8} {'attn':>6} {'batch':>5} {'rows':>5} {'r/slot':>6} {'fast tok/s':>11} "
          f"{'ms/step':>8} {'graph ms':>8} {'TB/s':>5} {'generate tok/s':>14} {'ratio':>6} {'ceiling tok/s':>13} "
          f"{'of ceil':>7} {'of fixed':>8} {'occup':>6} {'warm s':>6}")
    for r in rows:
        print(f"{r['shape']:>11} {r['mix']:>8} {r['attention']:>6} {r['batch']:5d} {r['rows']:5d} "
              f"{num(r['rows_per_slot'] or None, 'd', 6)} {r['fast_tok_s']:11,.0f} "
              f"{r['ms_per_step']:8.2f} {num(r['graph_replay_ms'], '.2f', 8)} {num(r['graph_replay_tb_s'], '.2f', 5)} "
              f"{num(r['generate_tok_s'], ',.0f', 14)} {num(r['ratio'], '.1f', 5)}{'x' if r['ratio'] else ' '} "
              f"{num(r['ceiling_tok_s'], ',.0f', 13)} {num(r['fraction_of_ceiling'], '.1%', 7)} "
              f"{num(r['of_fixed'], '.1%', 8)} {r['occupancy']:6.1%} {r['first_call_s']:6.1f}"
              + (f"  ({r['note']})" if r["note"] else ""))


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              rows_out: list[dict]) -> None:
    start = time.perf_counter()
    bench = Bench(shape, args, device, dtype)
    params = sum(p.numel() for p in bench.model.parameters()) / 1e9
    print(f"{shape}: {params:.2f}B parameters, decode layers {'compiled' if bench.fd.compile_layers else 'eager'}"
          f", the rollout's attention: {bench.picked}", flush=True)
    try:
        for attention in dict.fromkeys(bench.picked if a == "auto" else a for a in args.attention):
            name = bench.use(attention)
            if name is None:
                print(f"{shape}: attention {attention} does not run on {device} in {dtype}: skipped", flush=True)
                continue
            if "fixed" in args.mixes:
                for batch in args.batches:
                    rows_out.append(bench.fixed(batch))
                    print(json.dumps(rows_out[-1]), flush=True)
            if "longtail" in args.mixes:
                for batch in args.longtail_batches or [LONGTAIL_BATCH.get(shape, 256)]:
                    for per_slot in args.rows_per_slot:
                        rows_out.append(bench.longtail(batch, per_slot))
                        print(json.dumps(rows_out[-1]), flush=True)
            if "stream" in args.mixes:
                for batch in args.longtail_batches or [LONGTAIL_BATCH.get(shape, 256)]:
                    rows_out.append(bench.stream(batch))
                    print(json.dumps(rows_out[-1]), flush=True)
    finally:
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
        print(f"{shape}: {time.perf_counter() - start:.0f} s, peak {peak:.1f} GiB", flush=True)
        bench.close()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="batch sizes of the fixed mix")
    parser.add_argument("--mixes", choices=["fixed", "longtail", "stream"], nargs="+",
                        default=["fixed", "longtail", "stream"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens of every row of the fixed mix")
    parser.add_argument("--longtail-batches", type=int, nargs="+", default=None,
                        help="sequence slots of the long-tail mix (default: 64 for the 7B and MoE shapes, else 256)")
    parser.add_argument("--rows-per-slot", type=int, nargs="+", default=[2],
                        help="long-tail rows per sequence slot, one row of the table each (8: a GRPO step of "
                             "batch prompts x n = 8)")
    parser.add_argument("--stream-warmup", type=int, default=None,
                        help="stream mix: decode steps before the timed window (default --longtail-max: the rows "
                             "that started together have all ended)")
    parser.add_argument("--stream-steps", type=int, default=None,
                        help="stream mix: decode steps timed (default 2 x --longtail-max)")
    parser.add_argument("--longtail-min", type=int, default=64)
    parser.add_argument("--longtail-max", type=int, default=4096)
    parser.add_argument("--generate-max-batch", type=int, default=1024,
                        help="skip transformers.generate above this many rows")
    parser.add_argument("--generate-max-time", type=float, default=30.0,
                        help="stop a generate call after this many seconds (its max_time) and report the "
                             "tokens it made by then")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth, bytes/s (H200: 4.8e12)")
    parser.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=True,
                        help="the decode layers through torch.compile (the CUDA default of the rollout)")
    parser.add_argument("--attention", nargs="+", choices=["auto", "varlen", "triton", "sdpa"], default=["auto"],
                        help="decode attention of the full-length layers, the table once per value: auto (the "
                             "rollout's pick), varlen / triton (each row's own cache entries), sdpa (masked, "
                             "over the step's span of slots)")
    parser.add_argument("--profile", action="store_true", help="the fixed mix's decode step under torch.profiler: "
                        "kernel time by group and the longest kernels")
    parser.add_argument("--profile-top", type=int, default=12, help="how many kernels --profile lists")
    parser.add_argument("--out", type=str, default=None, help="write the table rows here as JSON")
    args = parser.parse_args()
    args.stream_warmup = args.longtail_max if args.stream_warmup is None else args.stream_warmup
    args.stream_steps = 2 * args.longtail_max if args.stream_steps is None else args.stream_steps
    if args.stream_warmup < 1 or args.stream_steps < 1:
        parser.error(f"--stream-warmup ({args.stream_warmup}) and --stream-steps ({args.stream_steps}) must be >= 1")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_host_threads(device)  # the host threads a rollout rank of spmd_rl.train runs with
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {dtype}, {args.prompt_len}-token prompts, fixed mix "
          f"{args.new_tokens} new tokens, long-tail mix {args.longtail_min}-{args.longtail_max} (log-uniform, "
          f"{' / '.join(map(str, args.rows_per_slot))} rows per slot), sampling T=1", flush=True)
    rows_out: list[dict] = []

    def stop(signum, frame):  # `timeout` sends SIGTERM: end with the rows measured so far
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        for shape in args.shapes:
            run_shape(shape, args, device, dtype, rows_out)
    except KeyboardInterrupt as exc:
        print(f"stopped ({exc or 'interrupted'}): the table holds the rows measured before", flush=True)
    print_table(rows_out)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, dtype=str(dtype), args=vars(args), rows=rows_out),
                                             indent=1))


if __name__ == "__main__":
    main()
