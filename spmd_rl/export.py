"""Export a checkpoint's actor as a Hugging Face model folder: one process, no torchrun.

    python -m spmd_rl.export runs/x/checkpoints/step_40 runs/x/hf
    python -m spmd_rl.export runs/x runs/x/hf --dtype bfloat16 --max-shard-size 2GB   # newest step

    from spmd_rl.export import export_hf
    export_hf("runs/x/checkpoints/step_40", "runs/x/hf")

It reads only the ``actor.model`` entries of the DCP checkpoint (whole tensors stitched from every
rank's shards, whatever the world size that saved them; no process group), or for the megatron
engine the ``hf`` copy its checkpoints hold under HF names (``actor.hf`` in older ones), writes
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
when the weights exceed ``--max-shard-size``) and copies the config and tokenizer files that the
checkpoint keeps in ``hf/``. ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` then loads the
trained weights. Peak memory is one full copy of the model on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from spmd_rl.checkpoint_files import load_without_process_group, read_meta, resolve_checkpoint

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


def load_model_state(ckpt: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The actor's full HF-named tensors from a checkpoint folder (or run / checkpoints folder):
    the FSDP engine's sharded weights (``actor.model``), or the HF copy that the megatron engine
    saves next to its own shards (``hf``)."""
    folder = resolve_checkpoint(ckpt)
    state = load_without_process_group(folder, [MODEL_KEY, HF_COPY_KEY, OLD_HF_COPY_KEY])
    actor = state.get("actor", {})
    for found in (actor.get("model"), state.get(HF_COPY_KEY), actor.get("hf")):
        if found:
            return found
    raise ValueError(f"{folder} holds no {MODEL_KEY} or {HF_COPY_KEY} entries; top-level entries: {sorted(state)}, "
                     f"actor entries: {sorted(actor)}")


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


def _readable(folder: Path) -> None:
    """The usual umask modes (safetensors writes its files private, an export is meant to be shared)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~mask)


def export_hf(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "auto",
              max_shard_size: str | int = DEFAULT_MAX_SHARD, overwrite: bool = False) -> Path:
    """Write the checkpoint's actor to ``out_dir`` as a Hugging Face folder; returns ``out_dir``.

    ``dtype``: ``auto`` keeps the trained dtype (float32), else ``float32`` / ``bfloat16`` /
    ``float16``. ``out_dir`` must be absent or empty unless ``overwrite``. Written into a sibling
    temporary folder and renamed into place, so ``out_dir`` is never half written.
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

    tensors = load_model_state(folder)
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

    tmp = out.with_name(f".{out.name}.tmp-export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
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
        _readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        folder = resolve_checkpoint(args.ckpt)
        out = export_hf(folder, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"spmd_rl.export: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir() if p.name.endswith(".safetensors"))
    print(f"exported {folder} (step {read_meta(folder)['step']}) to {out}: {size / 2**20:.1f} MiB of weights "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
