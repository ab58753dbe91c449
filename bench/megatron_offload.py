"""The megatron engine's offload on one GPU: device memory freed and seconds taken by ``offload()`` /
``onload()`` for a Qwen2.5-1.5B shape (random weights, bf16 parameters, fp32 main weights and AdamW
moments in megatron's distributed optimizer), after one update so every buffer exists. Prints one
table; checks that a cycle restores every parameter and optimizer tensor bit for bit.

    python3 bench/megatron_offload.py                 # Qwen2.5-1.5B shape (qwen2-1.5b of bench/shapes.py)
    python3 bench/megatron_offload.py --shape qwen2-0.5b --repeats 5

Rows: the parameters and their gradient buffers (``actor.megatron.param_offload``: parameters copied
to pinned host memory, gradient buffers freed), the optimizer (``actor.megatron.optimizer_offload``:
fp32 main weights and both moments copied), both. "freed" is ``torch.cuda.memory_allocated`` before
minus after the offload; times include a device synchronisation; the median of ``--repeats`` cycles.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2-1.5b", help="a shape of bench/shapes.py")
    p.add_argument("--root", default=None, help="where the random-weight model folders are built")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=8)
    return p.parse_args()


def snapshot(engine) -> list[torch.Tensor]:
    """Copies of every parameter and optimizer tensor (main weights, moments)."""
    tensors = [p.detach() for chunk in engine.model for p in chunk.parameters()]
    tensors += engine._optimizer_tensors()
    return [t.clone() for t in tensors]


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("megatron_offload needs a CUDA device")
        return 2
    from shapes import default_root, model_folder, random_grpo_batch

    from spmd_rl.config import ActorConfig, MegatronConfig
    from spmd_rl.distributed.dims import MegatronLayout
    from spmd_rl.engine.megatron import MegatronEngine

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    folder = model_folder(args.shape, root=args.root or default_root())
    engine = MegatronEngine(model_folder=folder, device=device, layout=MegatronLayout(1),
                            megatron=MegatronConfig(param_offload=False, optimizer_offload=False),
                            actor=ActorConfig(lr=1e-6), total_updates=2, trainable=True, pad_token_id=0)
    vocab = engine.spec.vocab
    batch = random_grpo_batch(rows=args.rows, n=2, vocab=vocab, prompt_len=(64, 128), response_median=128,
                              response_min=16, response_max=256, sigma=0.4, logprob=-12.0, seed=0)
    tokens = float(batch["response_mask"].sum())

    def loss_fn(logprobs, entropy, micro):
        mask = micro["response_mask"].to(logprobs.device)
        return -(logprobs * mask * micro["advantages"].to(logprobs.device)).sum() / tokens, {}

    engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=2), loss_fn, temperature=1.0,
                            need_entropy_grad=False)
    torch.cuda.synchronize()
    before = snapshot(engine)
    params = sum(p.numel() for chunk in engine.model for p in chunk.parameters())

    def cycle(params_: bool, optimizer: bool) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        engine._park(params=params_, optimizer=optimizer)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        freed = allocated - torch.cuda.memory_allocated()
        engine.onload(optimizer=True)
        torch.cuda.synchronize()
        return freed / 2**30, t1 - t0, time.perf_counter() - t1

    print(f"\n{args.shape}: {params / 1e9:.2f}B parameters, 1 x {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}; {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated after one update")
    print("| offloaded | GiB freed | offload s | onload s |")
    print("|---|---|---|---|")
    for name, (p, o) in {"parameters + gradient buffers": (True, False), "optimizer (main weights, moments)":
                         (False, True), "both": (True, True)}.items():
        runs = [cycle(p, o) for _ in range(args.repeats)]
        freed, off, on = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {name} | {freed:.2f} | {off:.3f} | {on:.3f} |")
    after = snapshot(engine)
    exact = all(torch.equal(a, b) for a, b in zip(before[:len(after)], after))
    print(f"parameters and optimizer tensors restored bit for bit: {exact}")
    dist.destroy_process_group()
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
