"""Models: find or materialise a model folder, then load its tokenizer and weights.

    folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir)
    tok = load_tokenizer(folder)
    eos = eos_token_ids(tok)                                  # the ids that end a response
    model = load_causal_lm(folder, dtype=torch.float32)       # on CPU, eval mode; caller moves it
    rm = load_reward_model(rm_folder, dtype=torch.float32)    # sequence classifier, one output
    flops = model_flops_per_token(model.config, seq_len=512)  # for MFU; FlopsModel: per phase

Nothing here uses the network: a model is a local Hugging Face folder, a local ``.gguf`` file or a
built-in name; the last two are materialised once into the cache (see :mod:`spmd_rl.models.builtin`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .flops import FlopsModel, model_flops_per_token

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# Loaded on first use (they import torch or transformers): the layout tool reads
# ``spmd_rl.models.families`` through this package and must run without either.
_LAZY = {
    **dict.fromkeys(("BUILTIN_NAMES", "SMOLLM2_NAME", "TINY_NAME", "TINY_RM_NAME", "TinyShape", "cache_root",
                     "materialise_gguf", "materialise_smollm2", "materialise_tiny_random",
                     "materialise_tiny_random_rm"), "builtin"),
    **dict.fromkeys(("build_char_tokenizer", "decode_responses", "decode_tokens", "eos_token_ids", "load_tokenizer",
                     "response_tokens"), "tokenizer"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_model_path(path: str, *, cache_dir: str | None) -> str:
    """Return a local folder holding ``config.json``, weights and tokenizer for ``path``.

    ``path`` is a local Hugging Face folder, a local ``.gguf`` file (dequantised once to float32,
    cached by its absolute path, size and modification time; needs the ``gguf`` package) or a built-in
    name (``smollm2-135m-instruct``, ``tiny-random``, the reward model ``tiny-random-rm``). Built-ins
    and GGUF files are written once under ``cache_dir`` (default ``$SPMD_RL_CACHE`` or
    ``~/.cache/spmd_rl``); concurrent callers (all ranks) are safe. ``tiny-random(-rm)`` have the
    default :class:`~.builtin.TinyShape`; a model of another shape or seed is a folder built with
    :func:`~.builtin.materialise_tiny_random`.
    """
    from spmd_rl import console

    console.phase(f"finding the model {path}")
    from .builtin import (
        BUILTIN_NAMES, SMOLLM2_NAME, TINY_NAME, TINY_RM_NAME, TinyShape, cache_root, materialise_gguf,
        materialise_smollm2, materialise_tiny_random, materialise_tiny_random_rm,
    )

    if path == SMOLLM2_NAME:
        return str(materialise_smollm2(cache_root(cache_dir)))
    if path == TINY_NAME:
        return str(materialise_tiny_random(cache_root(cache_dir), TinyShape()))
    if path == TINY_RM_NAME:
        return str(materialise_tiny_random_rm(cache_root(cache_dir), TinyShape()))
    folder = Path(path).expanduser()
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        return str(materialise_gguf(cache_root(cache_dir), folder))
    if (folder / "config.json").is_file():
        return str(folder.resolve())
    if folder.is_dir():
        raise FileNotFoundError(
            f"--model.path {path}: the folder {folder.resolve()} has no config.json; "
            "point it at a Hugging Face model folder (config.json, *.safetensors, tokenizer files)"
        )
    raise FileNotFoundError(
        f"--model.path {path}: no such folder ({folder.resolve()}/config.json not found), not a local "
        f".gguf file and not a built-in model name ({', '.join(BUILTIN_NAMES)}). Models are local: a "
        f"folder, a .gguf file or a built-in name; nothing is downloaded. {_download_hint(path)}"
    )


def _download_hint(path: str) -> str:
    """How to get a Hugging Face Hub model (``ORG/NAME``) as a local folder."""
    org_name = len(Path(path).parts) == 2 and not path.startswith((".", "/", "~"))
    name = path if org_name else "ORG/NAME"
    start = f"{path} looks like a Hugging Face Hub id: download" if org_name else "To use a Hugging Face Hub model, download"
    return (f"{start} it on a machine with internet, `huggingface-cli download {name} --local-dir DIR` "
            f"(copy DIR here if this machine has no internet), then pass --model.path DIR")


def load_causal_lm(
    folder: str,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM from a local folder onto the CPU in ``dtype``, in eval mode.

    ``use_kernels=False``: with the ``kernels`` package installed (transformers >= 5.2x depends on it),
    transformers kernelizes a loaded model by default and, once it is on a GPU, fetches RMSNorm / RoPE
    kernels from the Hugging Face Hub at ``.train()`` / ``.eval()`` (an error without internet); a run
    must not depend on the Hub, and the engines fuse those layers themselves."""
    from transformers import AutoModelForCausalLM

    from spmd_rl import console

    console.phase(f"loading the weights of {Path(folder).name}")
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
        use_kernels=False,
    )
    model.eval()
    return model


def load_reward_model(folder: str, *, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """Load a sequence-classification reward model (one output per sequence) onto the CPU, in eval
    mode with gradients off; ``ValueError`` when the folder's head does not give one score."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa",
        use_kernels=False,  # no Hub kernels (load_causal_lm)
    )
    if model.config.num_labels != 1:
        raise ValueError(
            f"--reward.model.path {folder}: the model has num_labels={model.config.num_labels}; a reward "
            "model gives one score per sequence (num_labels=1)"
        )
    model.requires_grad_(False)
    model.eval()
    return model


def sliding_window(config) -> int | None:
    """The sliding attention window some layer of a decoder-only HF model uses, or None: ``sliding_window``
    when ``layer_types`` (Qwen2 and newer configs) name a ``sliding_attention`` layer, or, without
    ``layer_types`` (Mistral, Mixtral), whenever it is set."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def check_sliding_window(longest: int, window: int | None, *, engine: str) -> None:
    """Raise for a sequence longer than the model's sliding window: the training engines' attention is
    full causal, so it would compute a different function than the model's."""
    if window is not None and longest > window:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the model's sliding window ({window}); the {engine} engine's "
            "attention is full causal, so it would not match the model: lower data.max_prompt_length + "
            "rollout.max_new_tokens to the window or below")


__all__ = [
    "check_sliding_window",
    "sliding_window",
    "BUILTIN_NAMES", "FlopsModel", "SMOLLM2_NAME", "TINY_NAME", "TINY_RM_NAME", "build_char_tokenizer",
    "decode_responses", "decode_tokens", "eos_token_ids", "load_causal_lm", "load_reward_model", "load_tokenizer",
    "model_flops_per_token", "response_tokens", "resolve_model_path",
]
