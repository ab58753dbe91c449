"""Random-weight model folders of real model shapes, for the update / hot-swap / GRPO-step benchmarks.

    folder = model_folder("qwen2-0.5b", root="/tmp/bench_models", group=None)  # config + random bf16 weights + tokenizer

Built once per shape under ``root`` (global rank 0 writes, then a barrier over ``group``): a Qwen2
(or the shape's ``model_type``: Qwen3, Qwen3-MoE) config of the named size, weights drawn by transformers' initialiser (seed 0) and stored in bf16,
and the project's character tokenizer (its ids are the low end of the 151936-token vocabulary;
sampled ids beyond it decode to nothing). ``tiny`` is a small shape for CPU runs of the scripts.

    batch = random_grpo_batch(rows=256, n=8, vocab=151936, prompt_len=(64, 256), response_median=200,
                              response_min=8, response_max=1024, sigma=0.6, logprob=-12.0, seed=0)

:func:`random_grpo_batch` is the benchmarks' GRPO batch: random prompts and responses with
log-normal response lengths, random advantages, old / reference log-probs near ``logprob``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

SHAPES: dict[str, dict[str, object]] = {
    # Qwen2-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads of 64, MLP 4864, vocab 151936, tied.
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen2-1.5B: 28 layers, hidden 1536, 12 heads / 2 KV heads of 128, MLP 8960, vocab 151936, tied.
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    # SmolLM2-135M-like (the learning runs' model; as a Qwen2 config, so with q/k/v biases): 30 layers,
    # hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152, tied.
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    # Qwen3-1.7B: 28 layers, hidden 2048, 16 heads / 8 KV heads of 128 (q/k RMSNorm), MLP 6144, vocab 151936, tied.
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    # Qwen2.5-7B: 28 layers, hidden 3584, 28 heads / 4 KV heads of 128 (q/k/v biases), MLP 18944, vocab 152064, untied.
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer (128 experts of 768, top-8, renormalised; 32 heads / 4 KV heads of 128, hidden
    # 2048) with 6 of its 48 layers: 3.9B parameters, 0.5B active per token, so fp32 AdamW fits one GPU.
    "qwen3-moe-6l": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                         num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         tie_word_embeddings=False),
    "tiny-moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                     moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
COMMON = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
              attention_dropout=0.0)


def random_grpo_batch(*, rows: int, n: int, vocab: int, prompt_len: tuple[int, int], response_median: float,
                      response_min: int, response_max: int, sigma: float, logprob: float, seed: int):
    """``rows`` responses (``n`` per prompt) of random ids in ``[3, vocab)``: prompt lengths uniform in
    ``prompt_len``, response lengths log-normal (median ``response_median``, log-sigma ``sigma``)
    clipped to ``[response_min, response_max]``; advantages N(0, 1) per response; old / reference
    log-probs ``logprob`` plus small noise. Deterministic for ``seed``."""
    from spmd_rl.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    lo, hi = prompt_len
    prompts = [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows // n)]
    lengths = (torch.randn(rows, generator=g) * sigma + torch.log(torch.tensor(float(response_median)))).exp()
    lengths = lengths.round().clamp(response_min, response_max).long()
    t = int(lengths.max())
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    ids = torch.where(mask.bool(), torch.randint(3, vocab, (rows, t), generator=g), 0)
    noise = torch.randn(rows, t, generator=g)
    return RolloutBatch(
        prompts=[prompts[i // n] for i in range(rows)],
        tensors={"response_ids": ids, "response_mask": mask, "group_index": torch.arange(rows) // n,
                 "advantages": torch.randn(rows, 1, generator=g).expand(rows, t) * mask,
                 "old_logprobs": (logprob + 0.1 * noise) * mask, "ref_logprobs": (logprob + 0.2 * noise) * mask},
    )


def model_folder(shape: str, *, root: str) -> str:
    """The folder of ``shape`` under ``root``, built by global rank 0 on first use; collective
    (a barrier) when a process group is up."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if shape not in SHAPES:
        raise ValueError(f"--shapes: unknown shape {shape!r}; known: {sorted(SHAPES)}")
    folder = Path(root) / shape
    marker = folder / "COMPLETE"  # holds the shape it was built from: a folder of an older shape is rebuilt
    built_from = json.dumps({**SHAPES[shape], **COMMON}, sort_keys=True, default=str)
    if rank == 0 and not (marker.exists() and marker.read_text() == built_from):
        import shutil

        from transformers import AutoConfig, AutoModelForCausalLM

        from spmd_rl.models import build_char_tokenizer

        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        fields = dict(SHAPES[shape])
        config = AutoConfig.for_model(fields.pop("model_type", "qwen2"), **fields, **COMMON)
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising 1.5B on the GPU takes a second
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(folder)
        build_char_tokenizer(model_max_length=32768).save_pretrained(folder)
        del model
        if device == "cuda":  # the caller may start the runs on this GPU: hand the cached blocks back
            torch.cuda.empty_cache()
        marker.write_text(built_from)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return str(folder)


def resolve_bench_model(model: str, tiny: list[int] | None) -> str:
    """``--model`` of a script as a local folder: ``tiny-random`` of the ``--tiny LAYERS HIDDEN HEADS
    KV_HEADS`` shape (seed 0, built once in the model cache) when given, else what ``--model.path``
    resolves to."""
    from spmd_rl.models import resolve_model_path
    from spmd_rl.models.builtin import TINY_NAME, TinyShape, cache_root, materialise_tiny_random

    if model == TINY_NAME and tiny:
        layers, hidden, heads, kv_heads = tiny
        shape = TinyShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads)
        return str(materialise_tiny_random(cache_root(None), shape))
    return resolve_model_path(model, cache_dir=None)


def default_root() -> str:
    return os.environ.get("BENCH_MODELS", "/tmp/spmd_rl_bench_models")


__all__ = ["SHAPES", "default_root", "model_folder"]
