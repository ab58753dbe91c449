"""Where the megatron engine's bf16 log-probs differ from the FSDP engine's and Hugging Face's: the same
batch through each, against an fp32 Hugging Face forward, with pieces of the megatron model swapped
one at a time. One process; prints one table.

    python3 bench/megatron_logprob_gap.py                          # CUDA: SmolLM2-135M shape, random weights
    python3 bench/megatron_logprob_gap.py --model.path /models/SmolLM2-135M-Instruct
    PYTHONPATH=tests python3 bench/megatron_logprob_gap.py --cpu   # CPU: megatron's bf16 path emulated
                                                                     # (tests/support/megatron_cpu shims)

Rows (mean and max |log-prob - fp32 reference| over the response tokens, and mean |Δ| to the bf16
Hugging Face forward, the stand-in for a bf16 rollout engine):

* ``hf bf16``: the model in bf16 (SDPA attention), as a rollout engine computes it;
* ``fsdp``: the FSDP engine (bf16 compute, fp32 weights; fp32 on ``--cpu``);
* ``megatron``: the megatron engine (bf16 parameters under ``Float16Module``);
* ``megatron + rope fp32``: rotary embedding applied in fp32 (megatron casts cos / sin to bf16 and
  rotates in bf16, as HF does);
* ``megatron + norm weight fp32``: RMSNorm's weight multiplied in fp32 before the cast (HF Llama
  casts first, then multiplies in bf16);
* ``megatron + core attention``: megatron's own ``DotProductAttention`` (bf16 ``baddbmm`` scores)
  instead of the engine's SDPA attention;
* ``megatron + logits fp32``: the output layer's GEMM in fp32 (both engines and HF form bf16 logits).

The random weights (``--embed-std``, default 0.15, tied embedding) make the next-token distributions
peaked like a trained model's (mean entropy printed); weights are stored in fp32, off the bf16 grid,
as in a dequantised checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

# SmolLM2-135M: Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, MLP 1536, vocab 49152, tied
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True, "rope_theta": 100000.0,
               "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model.path", dest="model_path", default=None, help="an HF folder instead of random weights")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than SmolLM2's 30 (random weights)")
    p.add_argument("--embed-std", type=float, default=0.15)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (megatron's bf16 path through the test shims)")
    p.add_argument("--variants", nargs="+", default=None, help="subset of the megatron rows (names after 'megatron + ')")
    return p.parse_args()


def random_folder(root: str, layers: int | None, embed_std: float) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from spmd_rl.models import build_char_tokenizer

    config = LlamaConfig(**{**SMOLLM2, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, embed_std)
    model.save_pretrained(root)
    build_char_tokenizer(model_max_length=8192).save_pretrained(root)
    return root


def make_batch(vocab: int, rows: int, prompt_len: int, response_len: int):
    from spmd_rl.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, vocab, (int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(rows)]
    lengths = torch.randint(response_len // 4, response_len + 1, (rows,), generator=g)
    lengths[0] = response_len
    mask = (torch.arange(response_len)[None, :] < lengths[:, None]).float()
    ids = torch.where(mask.bool(), torch.randint(3, vocab, (rows, response_len), generator=g), 0)
    return RolloutBatch(prompts=prompts, tensors={"response_ids": ids, "response_mask": mask,
                                                   "group_index": torch.arange(rows)})


@torch.no_grad()
def hf_logprobs(folder: str, batch, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of a plain HF forward, one row at a time (no padding)."""
    from spmd_rl.models import load_causal_lm

    model = load_causal_lm(folder, dtype=torch.float32).to(device=device, dtype=dtype).eval()
    t = batch.response_len
    logp = torch.zeros(len(batch), t)
    ent = torch.zeros(len(batch), t)
    for i, prompt in enumerate(batch.prompts):
        ids = torch.tensor(prompt + batch["response_ids"][i].tolist(), device=device)[None]
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + t].float()
        lsm = logits.log_softmax(-1)
        logp[i] = lsm.gather(-1, ids[0, len(prompt):len(prompt) + t, None])[:, 0].cpu()
        ent[i] = -(lsm.exp() * lsm).sum(-1).cpu()
    del model
    return logp * batch["response_mask"], ent


class Swaps:
    """The megatron pieces a row swaps, as context managers over the modules' attributes."""

    def __init__(self) -> None:
        self.saved: list[tuple[object, str, object]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved = []


def apply_swap(swaps: Swaps, name: str) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from spmd_rl.engine.megatron import model as mmodel

    if name == "rope fp32":
        bshd = rope_utils._apply_rotary_pos_emb_bshd

        def rope32(t, freqs, *args, **kwargs):
            return bshd(t.float(), freqs.float(), *args, **kwargs).to(t.dtype)

        swaps.set(rope_utils, "_apply_rotary_pos_emb_bshd", rope32)
    elif name == "norm weight fp32":
        def forward(self, x):
            dtype = x.dtype
            x = x.float()
            return (self.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))).to(dtype)

        swaps.set(mmodel.RMSNorm, "forward", forward)
    elif name == "core attention":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        swaps.set(mmodel, "CausalSDPA", DotProductAttention)
    elif name == "logits fp32":
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        plain = ColumnParallelLinear.forward

        def forward(self, input_, weight=None, **kwargs):
            if not getattr(self, "is_output_layer_probe", False):
                return plain(self, input_, weight=weight, **kwargs)
            w = self.weight if weight is None else weight
            return F.linear(input_.float(), w.float()), None

        swaps.set(ColumnParallelLinear, "forward", forward)
    else:
        raise ValueError(f"unknown variant {name!r}")


VARIANTS = ("rope fp32", "norm weight fp32", "core attention", "logits fp32")


def megatron_logprobs(folder: str, batch, device: torch.device, micro: int, swap: str | None) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    from spmd_rl.config import MegatronConfig
    from spmd_rl.distributed.dims import MegatronLayout
    from spmd_rl.engine.megatron import MegatronEngine

    swaps = Swaps()
    try:
        if swap:
            apply_swap(swaps, swap)
        engine = MegatronEngine(model_folder=folder, device=device, layout=MegatronLayout(1), megatron=MegatronConfig(),
                                trainable=False, pad_token_id=0)
        for chunk in engine._chunks():
            if getattr(chunk, "output_layer", None) is not None:
                chunk.output_layer.is_output_layer_probe = True
        logp, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=micro)
        return logp.float().cpu()
    finally:
        swaps.undo()
        ps.destroy_model_parallel()


def fsdp_logprobs(folder: str, batch, device: torch.device, micro: int) -> torch.Tensor:
    from spmd_rl.config import FsdpConfig
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build(device.type), device=device, fsdp=FsdpConfig(),
                        trainable=False, pad_token_id=0)
    logp, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=micro)
    return logp.float().cpu()


def main() -> int:
    args = parse()
    if args.cpu:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from support.megatron_cpu import install_megatron_cpu_shims

        install_megatron_cpu_shims()
        compute = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu (megatron's bf16 path emulated on the CPU)")
        return 2
    else:
        compute = torch.device("cuda", 0)
        torch.cuda.set_device(compute)
    # the megatron engine takes its bf16 path on a "cuda" device (the shims send it to the CPU with --cpu)
    megatron_device = torch.device("cuda") if args.cpu else compute
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or random_folder(tmp, args.layers, args.embed_std)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(folder).vocab_size
        batch = make_batch(vocab, args.rows, args.prompt_len, args.response_len)
        mask = batch["response_mask"].bool()
        ref, entropy = hf_logprobs(folder, batch, torch.float32, compute)
        rows = {"hf bf16": hf_logprobs(folder, batch, torch.bfloat16, compute)[0]}
        rows["fsdp" + (" (fp32 on CPU)" if args.cpu else "")] = fsdp_logprobs(folder, batch, compute, args.micro)
        rows["megatron"] = megatron_logprobs(folder, batch, megatron_device, args.micro, None)
        for name in args.variants or VARIANTS:
            rows[f"megatron + {name}"] = megatron_logprobs(folder, batch, megatron_device, args.micro, name)
    hf16 = rows["hf bf16"]
    print(f"\n{'fp32 reference' if not args.model_path else args.model_path}: {int(mask.sum())} response tokens, "
          f"mean entropy {entropy[mask].mean():.3f} nats, mean log-prob {ref[mask].mean():.3f}; "
          f"device {'cpu (megatron bf16 emulated)' if args.cpu else torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"| {'forward':<28} | mean abs diff vs fp32 | max abs diff vs fp32 | mean abs diff vs hf bf16 |")
    print(f"|{'-' * 30}|{'-' * 22}|{'-' * 22}|{'-' * 26}|")
    for name, logp in rows.items():
        d = (logp - ref)[mask].abs()
        h = (logp - hf16)[mask].abs()
        print(f"| {name:<28} | {d.mean():>20.3e} | {d.max():>20.3e} | {h.mean():>24.3e} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
