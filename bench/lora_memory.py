"""Actor memory with and without LoRA: parameters, gradients and AdamW state, and the peak of one update.

    python bench/lora_memory.py                         # one GPU: Qwen2.5-1.5B shape, full vs LoRA r=16
    python bench/lora_memory.py --ranks 0 8 64          # full fine-tuning and two LoRA ranks
    python bench/lora_memory.py --tiny                  # CPU smoke run on a tiny shape (no peak on CPU)

One process (a world of one, FSDP over one rank). The model is the Qwen2.5-1.5B shape (28 layers,
hidden 1536, 12 / 2 heads, MLP 8960, vocabulary 151936, tied; the same dimensions as Qwen2-1.5B),
random weights from transformers' ``Qwen2Config`` stored in bf16 (``bench/shapes.py``), loaded by
the FSDP engine as the trainer loads the actor: full fine-tuning keeps fp32 weights computed in bf16;
LoRA (``actor.lora``, all seven projections of every layer) keeps the frozen base in bf16 and the
adapters in fp32. For each rank (0 = full fine-tuning) the table shows the trainable parameters,
the bytes this process holds for parameters, gradients and AdamW state after one update
(``FSDPEngine.train_mini_batch`` on a random GRPO batch of ``--rows`` responses), and on GPU the peak
allocated memory during that update (activations included) and its time.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import default_root, model_folder, random_grpo_batch  # noqa: E402

from spmd_rl.config import ActorConfig, FsdpConfig, LoraConfig  # noqa: E402
from spmd_rl.distributed.dims import FsdpLayout  # noqa: E402
from spmd_rl.distributed.env import DistEnv  # noqa: E402
from spmd_rl.engine.fsdp import FSDPEngine  # noqa: E402

GIB = 2**30
MIB = 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def measure(folder: str, rank: int, args: argparse.Namespace, device: torch.device, unit: int) -> dict[str, float]:
    lora = LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build(device.type), device=device, fsdp=FsdpConfig(),
                        actor=ActorConfig(lr=1e-6), total_updates=1, trainable=True, pad_token_id=0,
                        gradient_checkpointing=args.gradient_checkpointing, lora=lora)
    vocab = int(engine.config.vocab_size)
    batch = random_grpo_batch(rows=args.rows, n=min(args.rows, 8), vocab=min(vocab, 30000), prompt_len=tuple(args.prompt_len),
                              response_median=args.response_len, response_min=args.response_len,
                              response_max=args.response_len, sigma=0.0, logprob=-12.0, seed=0)
    tokens = float(batch["response_mask"].sum())

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro):
        adv = micro["advantages"].to(logprobs.device)
        return -(logprobs * adv).sum() / tokens, {}

    micro = engine.micro_batches(batch, micro_batch_size=args.micro_batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    engine.train_mini_batch(micro, loss_fn, temperature=1.0, need_entropy_grad=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    params = list(engine.model.parameters())
    optimizer = engine.optimizer
    states = [v for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    row = {
        "rank": rank,
        "trainable": sum(_local(p).numel() for p in params if p.requires_grad),
        "params": _bytes(params) / unit,
        "grads": _bytes(p.grad for p in params) / unit,
        "optimizer": _bytes(states) / unit,
        "peak": torch.cuda.max_memory_allocated(device) / unit if device.type == "cuda" else float("nan"),
        "seconds": seconds,
    }
    del engine, optimizer, params, states
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 16], help="LoRA ranks; 0 = full fine-tuning")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (a smoke run)")
    parser.add_argument("--rows", type=int, default=16, help="responses in the update")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[128, 256])
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--root", default=default_root(), help="where the random-weight model folders are built")
    args = parser.parse_args(argv)
    if args.tiny:
        args.rows, args.micro_batch_size, args.prompt_len, args.response_len = 8, 4, [4, 12], 16
    import transformers

    transformers.logging.disable_progress_bar()
    env = DistEnv.from_environ().init(device="cpu" if args.tiny else "auto")
    device = env.device
    shape = "tiny" if args.tiny else "qwen2-1.5b"
    folder = model_folder(shape, root=args.root)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"LoRA memory bench: {shape} shape, {name}, torch {torch.__version__}, {args.rows} responses of "
          f"{args.prompt_len[0]}-{args.prompt_len[1]} + {args.response_len} tokens, micro-batch {args.micro_batch_size}"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''}")
    unit, u = (MIB, "MiB") if args.tiny else (GIB, "GiB")
    header = (f"{'mode':<12} {'trainable':>13} {'params ' + u:>11} {'grads ' + u:>10} {'AdamW ' + u:>10} "
              f"{'sum ' + u:>8} {'peak ' + u:>9} {'update s':>9}")
    print(header)
    print("-" * len(header))
    for rank in args.ranks:
        r = measure(folder, rank, args, device, unit)
        mode = f"LoRA r={rank}" if rank else "full"
        total = r["params"] + r["grads"] + r["optimizer"]
        peak = "-" if r["peak"] != r["peak"] else f"{r['peak']:.2f}"
        print(f"{mode:<12} {r['trainable']:>13,} {r['params']:>11.3f} {r['grads']:>10.3f} {r['optimizer']:>10.3f} "
              f"{total:>8.3f} {peak:>9} {r['seconds']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
