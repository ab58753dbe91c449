"""MoE router replay: the rollout/trainer log-prob mismatch with and without the rollout's experts replayed.

    python bench/router_replay.py                                   # CPU: the tiny MoE shape, ~1 minute
    python bench/router_replay.py --shape qwen3-moe-6l --prompts 64 --max-new-tokens 512   # one H200

A random-weight Qwen3-MoE of ``--shape`` (bench/shapes.py: ``qwen3-moe-6l`` is six of Qwen3-30B-A3B's
layers, 128 experts, top 8) generates with the built-in rollout (bf16 on CUDA, recording each
generated token's experts), then the FSDP engine (the trainer: fp32 weights, bf16 compute on CUDA;
fp32 on CPU) scores the same tokens twice: routing by its own router logits, and replaying the
recorded experts. Reported per way, over the generated tokens: the mean and max |trainer - rollout|
log-prob, ``rollout_corr/kl`` and ``k3_kl`` (spmd_rl.algo.rollout_correction), the share of tokens
whose experts the trainer picks differently in at least one MoE layer (without replay), and the
size of the records. ``--out FILE`` appends the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import model_folder  # noqa: E402

from spmd_rl.algo import rollout_correction  # noqa: E402
from spmd_rl.config import ActorConfig, FsdpConfig  # noqa: E402
from spmd_rl.data.batch import RolloutBatch  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402
from spmd_rl.rollout.native import NativeRollout  # noqa: E402



def disagreement(engine: FSDPEngine, batch: RolloutBatch, micro: int) -> float:
    """The share of generated tokens for which the trainer's own routers (no replay) pick another expert set
    than the rollout recorded, in at least one MoE layer: a log-prob pass whose routers ignore the records,
    the records' grid of each micro-batch kept from its staging and the routers' choices from hooks."""
    replay, grids, seen = engine.replay, [], []
    stage = engine._stage
    engine._stage = lambda part, rows=None: grids.append(stage(part, rows)) or grids[-1]
    replay.set = lambda routes: type(replay).set(replay, None)  # every token by the trainer's own logits
    hooks = [r.register_forward_hook(lambda m, a, res: seen.append(res[2])) for r in replay.routers]
    try:
        engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=micro)
    finally:
        for h in hooks:
            h.remove()
        del engine._stage, replay.set
    layers, differ, total = len(replay.routers), 0, 0
    for i, staged in enumerate(grids):
        grid = staged.routes.flatten(0, 1)  # [cells, layers, k], -1 where no generated token
        own = torch.stack(seen[i * layers:(i + 1) * layers], dim=1).sort(-1).values
        cells = (grid >= 0).all(-1).all(-1)
        differ += int((own[cells] != grid[cells].long().sort(-1).values).any(-1).any(-1).sum())
        total += int(cells.sum())
    return differ / max(total, 1)


def run(args: argparse.Namespace) -> list[dict]:
    env = DistEnv.from_environ().init(device=args.device)
    dev = env.device
    folder = model_folder(args.shape, root=args.root)
    bf16 = dev.type == "cuda" or args.rollout_dtype == "bf16"  # on CPU too by default: a precision gap to measure
    rollout = NativeRollout(folder, device=dev, dtype=torch.bfloat16 if bf16 else torch.float32,
                            batch_size=args.prompts * args.n, pad_token_id=0, eos_token_ids=[], record_routes=True)
    vocab = int(rollout.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    start = time.perf_counter()
    out = rollout.generate(prompts, n=args.n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                           seed=1)
    gen_s = time.perf_counter() - start
    rollout.close()
    del rollout
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    batch = RolloutBatch(prompts=out.prompt_ids, tensors={"response_ids": out.response_ids,
                                                          "response_mask": out.response_mask,
                                                          "routed_experts": out.routed_experts})
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build(dev.type), device=dev, fsdp=FsdpConfig(),
                        actor=ActorConfig(router_replay=True), trainable=True, pad_token_id=0,
                        use_packing=dev.type == "cuda")
    mask = out.response_mask
    rows = []
    share = disagreement(engine, batch, args.micro_batch_size)
    for replay in (False, True):
        part = batch if replay else RolloutBatch(batch.prompts, {k: v for k, v in batch.tensors.items()
                                                                  if k != "routed_experts"})
        lp, _ = engine.compute_logprobs(part, temperature=1.0, micro_batch_size=args.micro_batch_size)
        lp = lp.float().cpu()
        gap = (lp - out.logprobs) * mask
        _, _, metrics = rollout_correction(lp, out.logprobs, mask, is_level="token")
        rows.append({"shape": args.shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     "replay": replay, "tokens": int(mask.sum()), "logprob_abs_diff_mean": float(gap.abs().sum() / mask.sum()),
                     "logprob_abs_diff_max": float(gap.abs().max()), "kl": metrics["rollout_corr/kl"],
                     "k3_kl": metrics["rollout_corr/k3_kl"], "experts_differ_frac": share,
                     "records_mib": out.routed_experts.numel() * 2 / 2 ** 20, "gen_s": gen_s})
    env.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny-moe", help="a Qwen3-MoE shape of bench/shapes.py (default: tiny-moe)")
    p.add_argument("--root", default=os.path.expanduser("~/.cache/spmd_rl/bench_models"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rollout-dtype", choices=["auto", "bf16"], default="bf16",
                   help="bf16: the rollout in bf16 on CPU too (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--out", default=None, help="append the rows to this JSONL file")
    args = p.parse_args(argv)
    rows = run(args)
    print(f"router replay: {args.shape}, {rows[0]['device']}, torch {torch.__version__}, {args.prompts} prompts x "
          f"{args.n}, {args.max_new_tokens} new tokens, {rows[0]['tokens']} generated tokens")
    print(f"{'replay':7s} {'|dlogp| mean':>13s} {'|dlogp| max':>12s} {'kl':>10s} {'k3_kl':>10s} "
          f"{'experts differ':>15s} {'records MiB':>12s}")
    for r in rows:
        print(f"{'on' if r['replay'] else 'off':7s} {r['logprob_abs_diff_mean']:13.5f} {r['logprob_abs_diff_max']:12.4f} "
              f"{r['kl']:10.2e} {r['k3_kl']:10.2e} {r['experts_differ_frac']:15.4f} {r['records_mib']:12.2f}")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
