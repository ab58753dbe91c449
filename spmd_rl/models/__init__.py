"""Models: find or materialise a model folder, then load its tokenizer and weights.

    folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir,
                                tiny={"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seed": 0})
    tok = load_tokenizer(folder)
    model = load_causal_lm(folder, dtype=torch.float32)       # on CPU, eval mode; caller moves it
    rm = load_reward_model(rm_folder, dtype=torch.float32)    # sequence classifier, one output
    flops = model_flops_per_token(model.config, seq_len=512)  # for MFU

Nothing here uses the network: a model is a local Hugging Face folder, or a built-in name that is
materialised once into the cache (see :mod:`spmd_rl.models.builtin`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

from .builtin import (
    BUILTIN_NAMES, SMOLLM2_NAME, TINY_NAME, TINY_RM_NAME, TinyShape, cache_root, materialise_smollm2,
    materialise_tiny_random, materialise_tiny_random_rm,
)
from .tokenizer import build_char_tokenizer, load_tokenizer


def resolve_model_path(path: str, *, cache_dir: str | None, tiny: dict | None = None) -> str:
    """Return a local folder holding ``config.json``, weights and tokenizer for ``path``.

    ``path`` is a local Hugging Face folder or a built-in name (``smollm2-135m-instruct``,
    ``tiny-random``, the reward model ``tiny-random-rm``). Built-ins are written once under
    ``cache_dir`` (default ``$SPMD_RL_CACHE`` or ``~/.cache/spmd_rl``); concurrent callers (all
    ranks) are safe. ``tiny`` gives the ``tiny-random(-rm)`` shape: keys ``layers``, ``hidden``,
    ``heads``, ``kv_heads``, ``seed``.
    """
    if path == SMOLLM2_NAME:
        return str(materialise_smollm2(cache_root(cache_dir)))
    if path == TINY_NAME:
        return str(materialise_tiny_random(cache_root(cache_dir), TinyShape.from_dict(tiny)))
    if path == TINY_RM_NAME:
        return str(materialise_tiny_random_rm(cache_root(cache_dir), TinyShape.from_dict(tiny)))
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return str(folder.resolve())
    if folder.is_dir():
        raise FileNotFoundError(
            f"--model.path {path}: the folder {folder.resolve()} has no config.json; "
            "point it at a Hugging Face model folder (config.json, *.safetensors, tokenizer files)"
        )
    raise FileNotFoundError(
        f"--model.path {path}: no such folder ({folder.resolve()}/config.json not found) and not a "
        f"built-in model name ({', '.join(BUILTIN_NAMES)})"
    )


def load_causal_lm(
    folder: str,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM from a local folder onto the CPU in ``dtype``, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
    )
    model.eval()
    return model


def load_reward_model(folder: str, *, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """Load a sequence-classification reward model (one output per sequence) onto the CPU, in eval
    mode with gradients off; ``ValueError`` when the folder's head does not give one score."""
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa",
    )
    if model.config.num_labels != 1:
        raise ValueError(
            f"--reward.model.path {folder}: the model has num_labels={model.config.num_labels}; a reward "
            "model gives one score per sequence (num_labels=1)"
        )
    model.requires_grad_(False)
    model.eval()
    return model


def count_params(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters; tied weights (shared tensors) count once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# Model types whose MLP is up + down only; everything else is assumed Llama-like (gate, up, down).
_UNGATED_MLP = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2"}


def _cfg(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"model config {type(config).__name__} has none of the attributes {names}; "
                     "model_flops_per_token supports dense decoder-only (Llama-shaped) models")


def model_flops_per_token(config: Any, *, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a dense decoder: ``6 * N + 12 * L * H * seq_len``.

    ``N`` counts the parameters that take part in matmuls: every transformer layer plus the output
    projection (``vocab * hidden``, counted even when tied, because it is a matmul); the input
    embedding is a lookup and is left out. The second term is attention's ``QK^T`` and ``AV`` with
    ``H = heads * head_dim`` over the full (not causally halved) ``seq_len``, as in the PaLM paper.
    Inference (forward only) is a third of this.
    """
    text = getattr(config, "text_config", None) or config
    hidden = int(_cfg(text, "hidden_size", "n_embd", "d_model"))
    layers = int(_cfg(text, "num_hidden_layers", "n_layer"))
    heads = int(_cfg(text, "num_attention_heads", "n_head"))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
    vocab = int(_cfg(text, "vocab_size"))
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
    gated = getattr(text, "model_type", "") not in _UNGATED_MLP  # gate, up and down projections
    mlp = (3 if gated else 2) * hidden * intermediate
    n_matmul = layers * (attn + mlp) + vocab * hidden
    return float(6 * n_matmul + 12 * layers * heads * head_dim * seq_len)


__all__ = [
    "BUILTIN_NAMES", "SMOLLM2_NAME", "TINY_NAME", "TINY_RM_NAME", "build_char_tokenizer", "count_params",
    "load_causal_lm", "load_reward_model", "load_tokenizer", "model_flops_per_token", "resolve_model_path",
]
