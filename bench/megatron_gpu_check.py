"""Megatron engine vs FSDP engine on GPUs (NCCL, bf16): log-probs, one GRPO update, updated weights.

    torchrun --standalone --nproc-per-node 2 bench/megatron_gpu_check.py                    # SmolLM2-135M
    torchrun --standalone --nproc-per-node 2 bench/megatron_gpu_check.py --model tiny-random
    torchrun --standalone --nproc-per-node 1 bench/megatron_gpu_check.py --layouts dp        # one GPU
    torchrun --standalone --nproc-per-node 2 bench/megatron_gpu_check.py --family qwen3_moe  # qwen3 / llama3 too
    python bench/megatron_gpu_check.py --device cpu ... (under torchrun; needs the test shims:
        PYTHONPATH=tests and --cpu-shims) for a smoke run without GPUs

Every rank builds the same deterministic GRPO batch (ragged prompts and responses, advantages, old
and reference log-probs = the model's own plus noise so clipping and KL are active). The FSDP
engine (data parallel over all ranks) is the baseline: its log-probs, its summed loss, gradient
norm and updated weights after one ``train_mini_batch``. Then, for each megatron layout (``dp`` =
tp 1 pp 1, ``tp2``, ``pp2``, ``tp2_sp``, ``ep2`` for an MoE model), the megatron engine does the same
from the same HF weights; rank 0 prints one row per layout: max / mean |log-prob difference| over response
tokens, relative loss and grad-norm differences, and the max relative difference of the updated
weights (full HF tensors from ``named_full_tensors``). bf16 compute on both sides, so expect
log-prob differences around 1e-2 (different kernels and reduction orders), loss and grad norm within
~1e-2 relative, weights within ~1e-2 relative (one AdamW step of lr 1e-5 moves weights by ~1e-5).

The weights' relative difference cannot see whether the step happened (bf16 rounding of the exported
weights, ~4e-3 relative, is far larger than the step), so the weight CHANGE is compared too: ``step``
= <d_meg, d_fsdp> / <d_fsdp, d_fsdp>, the megatron engine's exported (bf16 compute) weight change
projected on the FSDP engine's fp32 weight change: ~1 when the bf16 weights move by the fp32 step on
average, as bf16(fp32 weights) do (``fsdp step``, the same measure of the FSDP engine's own bf16
compute weights, is the yardstick); ``bf16 diff`` = the fraction of megatron's bf16 weights that
differ from bf16(FSDP weights after the step). fp32 main weights started from the bf16-rounded
checkpoint instead of the fp32 one move the bf16 weights far less than the step (CPU emulation:
tests/test_megatron_bf16.py; on SmolLM2: docs/RESULTS.md).
Exit status 1 when a layout fails to run or a difference is above ``--tol`` (loose, for gross bugs),
or ``step`` is below ``--min-step``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

LAYOUTS = {"dp": {}, "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_sp": dict(tp=2, sequence_parallel=True),
           "ep2": dict(ep=2)}
# --family: a random model of the family at a small real-looking shape (head_dim 128 != hidden / heads,
# as Qwen3; Llama 3.1's llama3 RoPE numbers), built once under $BENCH_MODELS
FAMILY_SHAPE = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=4096, max_position_embeddings=16384, rms_norm_eps=1e-6,
                    tie_word_embeddings=False)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128, rope_theta=1e6)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=128, num_experts=8, num_experts_per_tok=2,
                                                                moe_intermediate_size=256, norm_topk_prob=True,
                                                                rope_theta=1e6)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))),
}


def family_folder(family: str) -> str:
    """The random ``--family`` model's folder (rank 0 builds it on first use; collective)."""
    import transformers
    from pathlib import Path

    folder = Path(os.environ.get("BENCH_MODELS", "/tmp/spmd_rl_bench_models")) / f"megatron-check-{family}"
    config_cls, model_cls, extra = FAMILIES[family]
    if dist.get_rank() == 0 and not (folder / "COMPLETE").exists():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**FAMILY_SHAPE, **extra)
        getattr(transformers, model_cls)(config).save_pretrained(folder)
        (folder / "COMPLETE").touch()
    dist.barrier()
    return str(folder)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or HF folder (SmolLM2 has 9 "
                   "heads / 3 kv heads: no tp2; use --model tiny-random --tiny 4 256 8 4 for tp)")
    p.add_argument("--tiny", nargs=4, type=int, default=None, metavar=("LAYERS", "HIDDEN", "HEADS", "KV_HEADS"),
                   help="shape of --model tiny-random")
    p.add_argument("--family", choices=list(FAMILIES), default=None,
                   help="instead of --model: a random model of this family (a shape of FAMILY_SHAPE)")
    p.add_argument("--layouts", nargs="+", default=None, help=f"subset of {list(LAYOUTS)} (default: all that fit)")
    p.add_argument("--rows", type=int, default=16, help="responses in the batch (all ranks see the whole batch)")
    p.add_argument("--response-len", type=int, default=48)
    p.add_argument("--micro", type=int, default=4, help="micro-batch rows")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tol", type=float, default=0.1, help="failure threshold for the relative differences")
    p.add_argument("--min-step", type=float, default=0.5,
                   help="failure threshold for the effective step of the megatron weights (1 = the FSDP step)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cpu-shims", action="store_true", help="install tests/support/megatron_cpu shims (CPU smoke run)")
    return p.parse_args()


def make_batch(engine, vocab: int, rows: int, response_len: int, micro: int):
    from spmd_rl.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(1234)
    prompts_n = rows // 2
    prompt_lens = torch.randint(8, 40, (prompts_n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    lengths = torch.randint(4, response_len + 1, (rows,), generator=g)
    lengths[0] = response_len
    mask = (torch.arange(response_len)[None, :] < lengths[:, None]).float()
    ids = torch.where(mask.bool(), torch.randint(3, vocab, (rows, response_len), generator=g), 0)
    batch = RolloutBatch(prompts=[prompts[i // 2] for i in range(rows)],
                         tensors={"response_ids": ids, "response_mask": mask, "group_index": torch.arange(rows) // 2})
    own, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=micro)
    own = own.cpu()
    batch["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, response_len) * mask
    batch["old_logprobs"] = (own + 0.1 * torch.randn(own.shape, generator=g)) * mask
    batch["ref_logprobs"] = (own + 0.2 * torch.randn(own.shape, generator=g)) * mask
    return batch, own


def update(engine, batch, *, dp_rank: int, dp_size: int, count_weight: float, micro: int, device):
    """One train_mini_batch on this rank's share; returns (summed loss, grad_norm)."""
    from spmd_rl.algo.objective import actor_objective
    from spmd_rl.config import AlgoConfig

    algo = AlgoConfig(clip_low=0.2, clip_high=0.28, use_kl_loss=True, kl_coef=0.1, kl_kind="k3", entropy_coef=0.0)
    share = len(batch) // dp_size
    mine = batch.select(range(dp_rank * share, (dp_rank + 1) * share))
    counts = torch.tensor([mine["response_mask"].sum().item(), float(len(mine))], dtype=torch.float64,
                          device=device) * count_weight
    dist.all_reduce(counts)
    tokens, seqs = counts.tolist()
    total = torch.zeros((), dtype=torch.float64, device=device)

    def loss_fn(logprobs, entropy, m):
        nonlocal total
        loss, _ = actor_objective(
            logprobs, entropy, old_logprobs=m["old_logprobs"].to(device), advantages=m["advantages"].to(device),
            response_mask=m["response_mask"].to(device), ref_logprobs=m["ref_logprobs"].to(device), algo=algo,
            global_tokens=tokens, global_seqs=seqs)
        total = total + loss.detach().double() * count_weight
        return loss, {}

    stats = engine.train_mini_batch(engine.micro_batches(mine, micro_batch_size=micro), loss_fn,
                                    temperature=1.0, need_entropy_grad=False)
    dist.all_reduce(total)
    return total.item(), stats["grad_norm"]


def cpu32(t: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU copy (never a view of live weights: on the CPU ``.float().cpu()`` is the tensor itself)."""
    return t.detach().to("cpu", torch.float32, copy=True)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> int:
    args = parse()
    if args.cpu_shims:
        from support.megatron_cpu import install_megatron_cpu_shims

        install_megatron_cpu_shims()
    from spmd_rl.config import ActorConfig, FsdpConfig, MegatronConfig
    from spmd_rl.distributed.dims import FsdpLayout, MegatronLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.engine.megatron import MegatronEngine
    from spmd_rl.engine.megatron.model import ModelSpec, check_layout, transformer_config
    from transformers import AutoConfig

    def load_config(folder: str):
        return AutoConfig.from_pretrained(folder)
    from shapes import resolve_bench_model

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    folder = family_folder(args.family) if args.family else resolve_bench_model(args.model, args.tiny)
    actor = ActorConfig(lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01, grad_clip=1.0)

    fsdp = FSDPEngine(model_folder=folder, mesh=FsdpLayout(world).build(device.type), device=device, fsdp=FsdpConfig(),
                      actor=actor, total_updates=1, trainable=True, pad_token_id=0)
    batch, base_logp = make_batch(fsdp, fsdp.config.vocab_size, args.rows, args.response_len, args.micro)
    mask = batch["response_mask"]
    base_before = {n: cpu32(t) for n, t in fsdp.named_full_tensors()}
    base_loss, base_norm = update(fsdp, batch, dp_rank=rank, dp_size=world, count_weight=1.0, micro=args.micro,
                                  device=device)
    base_weights = {n: cpu32(t) for n, t in fsdp.named_full_tensors()}
    base_delta = {n: base_weights[n] - base_before[n] for n in base_weights}
    base_sq = sum(d.double().pow(2).sum().item() for d in base_delta.values())

    def projected(delta: dict) -> float:
        """<delta, FSDP change> / <FSDP change, FSDP change>"""
        return sum((delta[n].double() * base_delta[n].double()).sum().item() for n in base_delta) / max(base_sq, 1e-30)

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    fsdp_step = projected({n: bf16(base_weights[n]) - bf16(base_before[n]) for n in base_delta})
    del fsdp
    if device.type == "cuda":
        torch.cuda.empty_cache()

    names = args.layouts or [n for n, kw in LAYOUTS.items()
                             if world % (kw.get("tp", 1) * kw.get("pp", 1) * kw.get("ep", 1)) == 0]
    rows, failed = [], False
    spec = ModelSpec.from_hf(load_config(folder))
    for name in names:
        kw = dict(LAYOUTS[name])
        sp = kw.pop("sequence_parallel", False)
        try:
            layout = MegatronLayout(world, **kw)
            check_layout(spec, layout)
            transformer_config(spec, layout, params_dtype=torch.float32, bf16=False, sequence_parallel=sp,
                               batch_p2p_comm=True)  # refuses MoE under tp without sequence parallel
        except ValueError as e:  # the model cannot be split this way: say why, do not count it
            rows.append(dict(layout=name, skipped=str(e)))
            continue
        try:
            engine = MegatronEngine(model_folder=folder, device=device, layout=layout,
                                    megatron=MegatronConfig(**kw, sequence_parallel=sp), actor=actor, total_updates=1,
                                    trainable=True, pad_token_id=0, seed=1)
            logp, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=args.micro)
            diff = (logp.cpu() - base_logp).abs() * mask
            before = {n: cpu32(t) for n, t in engine.named_full_tensors()}
            c = layout.coords(rank)
            weight = float(c["tp"] == 0 and c["pp"] == layout.pp - 1)
            loss, norm = update(engine, batch, dp_rank=c["dp"], dp_size=layout.dp_size, count_weight=weight,
                                micro=args.micro, device=device)
            after = {n: cpu32(t) for n, t in engine.named_full_tensors()}
            wdiff = max((t - base_weights[n]).norm().item() / max(base_weights[n].norm().item(), 1e-12)
                        for n, t in after.items())
            step = projected({n: after[n] - before[n] for n in base_delta})
            bf16_diff = (sum((bf16(after[n]) != bf16(base_weights[n])).sum().item() for n in base_delta)
                         / sum(t.numel() for t in base_delta.values()))
            row = dict(layout=name, logp_max=diff.max().item(), logp_mean=(diff.sum() / mask.sum()).item(),
                       loss=loss, loss_rel=rel(loss, base_loss), norm=norm, norm_rel=rel(norm, base_norm),
                       weights_rel=wdiff, step=step, bf16_diff=bf16_diff)
            failed |= max(row["loss_rel"], row["norm_rel"], row["weights_rel"], row["logp_mean"]) > args.tol
            failed |= step < args.min_step
            del engine
        except Exception:  # noqa: BLE001 - report the layout and go on with the next
            row = dict(layout=name, error=traceback.format_exc(limit=4).strip().splitlines()[-1])
            if rank == 0:
                traceback.print_exc()
            failed = True
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        rows.append(row)
    if rank == 0:
        print(f"\nmegatron vs FSDP engine, {args.family or args.model}, {world} x {device.type}, "
              f"bf16={device.type == 'cuda'}; "
              f"FSDP: loss {base_loss:.6f}, grad_norm {base_norm:.5f}, fsdp step {fsdp_step:.3f}; "
              f"{int(mask.sum())} response tokens")
        print(f"{'layout':8} {'|dlogp| max':>12} {'|dlogp| mean':>13} {'loss':>11} {'loss rel':>9} "
              f"{'grad_norm':>10} {'norm rel':>9} {'weights rel':>12} {'step':>6} {'bf16 diff':>10}")
        for r in rows:
            if "skipped" in r:
                print(f"{r['layout']:8} skipped: {r['skipped']}")
            elif "error" in r:
                print(f"{r['layout']:8} ERROR {r['error']}")
            else:
                print(f"{r['layout']:8} {r['logp_max']:12.3e} {r['logp_mean']:13.3e} {r['loss']:11.6f} "
                      f"{r['loss_rel']:9.2e} {r['norm']:10.5f} {r['norm_rel']:9.2e} {r['weights_rel']:12.3e} "
                      f"{r['step']:6.3f} {r['bf16_diff']:10.4f}")
        print("FAILED" if failed else "OK")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
