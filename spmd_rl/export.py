"""Export a checkpoint's actor as a Hugging Face model folder: one process, no torchrun.

    python -m spmd_rl.export runs/x/checkpoints/step_40 runs/x/hf
    python -m spmd_rl.export runs/x runs/x/hf --dtype bfloat16 --max-shard-size 2GB   # newest step
    python -m spmd_rl.export runs/x runs/x/adapter --adapter    # a LoRA run's adapters, PEFT's format

    from spmd_rl.export import export_hf
    export_hf("runs/x/checkpoints/step_40", "runs/x/hf")

It reads only the ``actor.model`` entries of the DCP checkpoint (whole tensors stitched from every
rank's shards, whatever the world size that saved them; no process group), or for the megatron
engine the ``hf`` copy its checkpoints hold under HF names (``actor.hf`` in older ones), writes
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
when the weights exceed ``--max-shard-size``) and copies the config and tokenizer files that the
checkpoint keeps in ``hf/``. ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` then loads the
trained weights. Peak memory is one full copy of the model on the CPU.

A LoRA run's checkpoint holds only the adapters (``actor.lora``): the export merges them into the
base model it trained (the ``model_folder`` of its ``meta.json``, or ``--base-model``) as
``W + (alpha / rank) * B @ A``; with ``--adapter`` it writes the adapters alone as PEFT's folder
(``adapter_config.json`` + ``adapter_model.safetensors``, for ``PeftModel.from_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import yaml

from spmd_rl.atomic import atomic_folder
from spmd_rl.checkpoint_files import load_without_process_group, read_meta, resolve_checkpoint
from spmd_rl.config import LoraConfig

MODEL_KEY = "actor.model"
HF_COPY_KEY = "hf"
"""The full HF-named weights a megatron actor's checkpoint holds (``Checkpointer.track(export=...)``)."""
OLD_HF_COPY_KEY = "actor.hf"
"""Where checkpoints written before ``hf`` existed kept that copy."""
DEFAULT_MAX_SHARD = "5GB"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(size: str | int) -> int:
    """Bytes from ``5GB`` / ``500MB`` / ``2GiB`` / a plain integer."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?))?B?\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {size!r}: expected a size such as 5GB, 500MB, 2GiB or 1000000")
    number, prefix, binary = float(m.group(1)), (m.group(2) or "").upper(), bool(m.group(3))
    base = 1024 if binary else 1000
    power = "KMGT".index(prefix) + 1 if prefix else 0
    return int(number * base**power)


def load_model_state(ckpt: str | os.PathLike, *, base_model: str | None = None) -> dict[str, torch.Tensor]:
    """The actor's full HF-named tensors from a checkpoint folder (or run / checkpoints folder):
    the FSDP engine's sharded weights (``actor.model``), or the HF copy that the megatron engine
    saves next to its own shards (``hf``); a LoRA run's adapters merged into its base model
    (``base_model``: that model's folder, default the one the run trained)."""
    folder = resolve_checkpoint(ckpt)
    adapters = load_adapters(folder)
    if adapters:
        from spmd_rl.engine.lora import merge_adapters
        from spmd_rl.models import load_causal_lm

        lora = checkpoint_lora(folder)
        base_folder = base_model or read_meta(folder).get("model_folder")
        if not base_folder or not Path(base_folder).is_dir():
            raise FileNotFoundError(f"{folder} holds LoRA adapters, and their base model folder {base_folder} is not "
                                    "there: pass --base-model FOLDER (the model the run trained), or --adapter")
        base = load_causal_lm(str(base_folder), dtype=torch.float32).state_dict()
        return merge_adapters(base, adapters, scale=lora.scale)
    state = load_without_process_group(folder, [MODEL_KEY, HF_COPY_KEY, OLD_HF_COPY_KEY])
    actor = state.get("actor", {})
    for found in (actor.get("model"), state.get(HF_COPY_KEY), actor.get("hf")):
        if found:
            return found
    raise ValueError(f"{folder} holds no {MODEL_KEY} or {HF_COPY_KEY} entries; top-level entries: {sorted(state)}, "
                     f"actor entries: {sorted(actor)}")


def load_adapters(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A LoRA run's adapters (``actor.model`` entries ``<module>.lora_A.default.weight`` ...); {} for
    a checkpoint of full weights."""
    from torch.distributed.checkpoint import FileSystemReader

    from spmd_rl.engine.lora import is_adapter_key

    index = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    names = [k for k in index if k.startswith(MODEL_KEY + ".") and is_adapter_key(k)]
    if not names:
        return {}
    state = load_without_process_group(folder, names)
    return state["actor"]["model"]


def checkpoint_lora(folder: str | os.PathLike) -> LoraConfig:
    """``actor.lora`` of the run that saved ``folder`` (its ``config.yaml``)."""
    path = Path(folder) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds LoRA adapters but no config.yaml to read actor.lora (rank, alpha) from")
    saved = (yaml.safe_load(path.read_text()) or {}).get("actor", {}).get("lora", {})
    return LoraConfig(rank=int(saved["rank"]), alpha=float(saved["alpha"]), targets=tuple(saved["targets"]))


def export_adapter(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a LoRA checkpoint's adapters to ``out_dir`` in PEFT's format; returns ``out_dir``."""
    from spmd_rl.engine.lora import save_peft_adapter

    folder = resolve_checkpoint(ckpt)
    adapters = load_adapters(folder)
    if not adapters:
        raise ValueError(f"--adapter: {folder} holds full weights (a run without actor.lora), no adapters; "
                         "export it without --adapter")
    lora = checkpoint_lora(folder)
    with _writing(out_dir, overwrite) as tmp:
        save_peft_adapter(adapters, lora, tmp, base_model=read_meta(folder).get("model_folder"))
    return Path(out_dir).expanduser().resolve()


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


@contextmanager
def _writing(out_dir: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """A temporary folder that replaces ``out_dir`` when the block ends without an error
    (:func:`~spmd_rl.atomic.atomic_folder`), so ``out_dir`` is never half written."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    with atomic_folder(out) as tmp:
        yield tmp


def export_hf(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "auto",
              max_shard_size: str | int = DEFAULT_MAX_SHARD, overwrite: bool = False,
              base_model: str | None = None) -> Path:
    """Write the checkpoint's actor to ``out_dir`` as a Hugging Face folder; returns ``out_dir``.

    ``dtype``: ``auto`` keeps the trained dtype (float32), else ``float32`` / ``bfloat16`` /
    ``float16``. ``out_dir`` must be absent or empty unless ``overwrite``. Written into a sibling
    temporary folder and renamed into place, so ``out_dir`` is never half written. ``base_model``: a
    LoRA run's base model folder, when not where the run found it.
    """
    from safetensors.torch import save_file

    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype}: expected auto or one of {sorted(_DTYPES)}")
    folder = resolve_checkpoint(ckpt)
    hf = folder / "hf"
    if not (hf / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no hf/config.json: it was saved without the model folder's "
                                f"config and tokenizer (meta.json model_folder={read_meta(folder).get('model_folder')})")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
    max_bytes = parse_size(max_shard_size)

    tensors = load_model_state(folder, base_model=base_model)
    config = json.loads((hf / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        del tensors["lm_head.weight"]  # tied: transformers rebuilds it from the embedding
    if dtype != "auto":
        tensors = {k: v.to(_DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    float_dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()}
    if len(float_dtypes) == 1:
        name = str(next(iter(float_dtypes))).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name

    with _writing(out, overwrite) as tmp:
        for item in sorted(hf.iterdir()):
            if item.is_file() and item.name != "config.json":
                shutil.copy2(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        shards = _shards(tensors, max_bytes)
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=metadata)
                weight_map.update({k: name for k in shard})
            total = sum(v.numel() * v.element_size() for v in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spmd_rl.export",
        description="Write a spmd_rl checkpoint's actor as a Hugging Face model folder "
                    "(safetensors + config + tokenizer). Runs in one process; no torchrun needed.")
    parser.add_argument("ckpt", help="a checkpoints/step_N folder, or a run (or checkpoints) folder: its newest complete step")
    parser.add_argument("out_dir", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                        help="weights dtype (auto: as trained, float32)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD,
                        help="split model.safetensors into shards of at most this size (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its adapters in PEFT's format (adapter_config.json + "
                             "adapter_model.safetensors) instead of merged weights")
    parser.add_argument("--base-model", default=None,
                        help="a LoRA run's base model folder, to merge into (default: the folder the run trained)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        folder = resolve_checkpoint(args.ckpt)
        if args.adapter:
            out = export_adapter(folder, args.out_dir, overwrite=args.overwrite)
        else:
            out = export_hf(folder, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                            overwrite=args.overwrite, base_model=args.base_model)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"spmd_rl.export: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir() if p.name.endswith(".safetensors"))
    print(f"exported {folder} (step {read_meta(folder)['step']}) to {out}: {size / 2**20:.1f} MiB of weights "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
