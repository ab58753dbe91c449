"""The megatron engine's context-parallel attention path: time and peak memory of one forward +
backward of a Qwen2-0.5B-shaped model (random weights, bf16) at 8k and 16k tokens per sequence.

    python3 bench/megatron_cp.py                                    # one GPU: plain vs chunked (cp 1)
    torchrun --standalone --nproc-per-node 2 bench/megatron_cp.py --cp 2   # cp over 2 GPUs
    python3 bench/megatron_cp.py --tiny                             # CPU smoke run (tiny shape, fp32)

Rows: ``plain`` is the engine's attention without context parallelism (``CausalSDPA``: one causal
SDPA call per layer); ``chunked`` is ``ContextParallelSDPA`` (:mod:`spmd_rl.engine.megatron.context`):
each rank holds chunks r and 2cp-1-r of 2cp, K/V are all-gathered over the cp group (a no-op with
cp 1) and each query chunk attends to its key prefix with a lower-right causal mask (flash
attention). With cp 1 the two rows differ only in that path (the two half-sequence SDPA calls, the
K/V stack and reorder), so their ratio is its overhead; with cp N each rank holds 1/N of the tokens.
One step = megatron-core ``GPTModel`` forward on this rank's tokens, the engine's vocab-parallel
log-probs at every position, backward; the time is the median of ``--iters`` steps after one warm-up,
``peak GiB`` is ``torch.cuda.max_memory_allocated`` during those steps (rank 0; the weights and
their gradients are ~1.9 GiB of it). Needs megatron-core (no TransformerEngine). On CPU the
megatron-core CUDA shims of ``tests/support/megatron_cpu.py`` are installed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# Qwen2-0.5B: 24 layers, hidden 896, 14 heads / 2 kv heads of 64, MLP 4864, vocab 151936, tied
QWEN2_05B = dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shape, 256 and 512 tokens (a CPU smoke run)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per sequence (default 8192 16384)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel degree (default: the world size)")
    p.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--iters", type=int, default=3)
    return p.parse_args()


def build(spec, layout, *, chunked: bool, bf16: bool) -> torch.nn.Module:
    from spmd_rl.engine.megatron.model import build_chunks, transformer_config

    config = transformer_config(spec, layout, params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16,
                                sequence_parallel=False, batch_p2p_comm=True)
    (model,) = build_chunks(spec, layout, config, context_parallel=chunked)
    return model


def step(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, vocab: int) -> None:
    from spmd_rl.engine.megatron.vocab import vocab_parallel_logprobs

    logits = model(tokens, positions, None)  # [rows, local tokens, V]
    labels = tokens.roll(-1, dims=1).reshape(-1)
    logp, _ = vocab_parallel_logprobs(logits.reshape(-1, logits.shape[-1]), labels, group=None, vocab_start=0,
                                      vocab=vocab, entropy=False)
    logp.sum().backward()


def measure(model, tokens, positions, vocab, device, iters: int) -> tuple[float, float | None]:
    cuda = device.type == "cuda"
    step(model, tokens, positions, vocab)  # warm-up (kernels, allocator)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step(model, tokens, positions, vocab)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    return statistics.median(times), peak


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from support.megatron_cpu import install_megatron_cpu_shims

        install_megatron_cpu_shims()
    from megatron.core import parallel_state as ps
    from transformers import Qwen2Config

    from spmd_rl.distributed.dims import MegatronLayout
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.engine.megatron.context import chunk_columns
    from spmd_rl.engine.megatron.groups import init_model_parallel
    from spmd_rl.engine.megatron.model import ModelSpec

    env = DistEnv.from_environ().init(device="auto")
    device, world = env.device, dist.get_world_size()
    cp = args.cp or world
    layout = MegatronLayout(world, cp=cp)
    init_model_parallel(layout, seed=0)
    cp_rank = ps.get_context_parallel_rank()
    shape = TINY if args.tiny else QWEN2_05B
    spec = ModelSpec.from_hf(Qwen2Config(**shape, max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-6))
    lengths = args.tokens or ([256, 512] if args.tiny else [8192, 16384])
    bf16 = device.type == "cuda"
    paths = ["plain", "chunked"] if cp == 1 else ["chunked"]
    rows = []
    for path in paths:
        torch.manual_seed(0)
        model = build(spec, layout, chunked=path == "chunked", bf16=bf16).to(device)
        for n in lengths:
            n = -(-n // (2 * cp)) * (2 * cp)
            g = torch.Generator().manual_seed(n)
            full = torch.randint(0, spec.vocab, (args.rows, n), generator=g)
            cols = chunk_columns(n, cp, cp_rank) if path == "chunked" else torch.arange(n)
            tokens = full[:, cols].to(device)
            positions = cols.expand(args.rows, -1).contiguous().to(device)
            try:
                seconds, peak = measure(model, tokens, positions, spec.vocab, device, args.iters)
                rows.append((path, cp, n, f"{seconds * 1e3:.1f}", f"{peak:.2f}" if peak is not None else "-",
                             f"{args.rows * n / seconds:,.0f}"))
            except torch.OutOfMemoryError:
                rows.append((path, cp, n, "OOM", "-", "-"))
                torch.cuda.empty_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if env.rank == 0:
        name = "tiny" if args.tiny else "Qwen2-0.5B shape"
        print(f"\nmegatron cp attention path: {name}, {args.rows} row(s), {'bf16' if bf16 else 'fp32'}, "
              f"{world} rank(s), {torch.cuda.get_device_name() if bf16 else 'CPU'}, torch {torch.__version__}")
        header = ("path", "cp", "tokens/seq", "fwd+bwd ms", "peak GiB", "tokens/s")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(str(x) for x in row) + " |")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
