"""Distributed checkpoints: save the whole training state with DCP, find it again, resume from it.

    ckpt = Checkpointer(checkpoint=cfg.checkpoint, output_dir=cfg.trainer.output_dir,
                        total_steps=cfg.trainer.total_steps, rank_table=rows, config=to_dict(cfg))
    sink = RunSink(..., start_step=ckpt.start_step)          # known before anything is loaded
    ckpt.track(model_folder=folder, actor=engine, sampler=sampler)   # state_dict()/load_state_dict()
    step = ckpt.resume()                                     # 0 on a fresh start
    while step < total: ...; ckpt.maybe_save(step)           # its own cadence: every N, final

What a checkpoint holds (``<output_dir>/checkpoints/step_N/``):

* the tracked components' ``state_dict()`` in one ``torch.distributed.checkpoint`` (DCP) save: the
  actor's sharded model and optimizer (DTensors, never gathered), its LR scheduler, the prompt
  sampler's position. DCP files: ``.metadata`` and one ``__R_0.distcp`` per rank;
* ``rng/rank_R.json``: every rank's Python ``random``, NumPy, torch CPU (and CUDA) RNG states;
* ``meta.json``: step, time, the rank table of the saving run, the model it trained;
* ``config.yaml``: the run's resolved config;
* ``hf/``: the model folder's config and tokenizer files, so ``python -m spmd_rl.export`` needs
  nothing else;
* ``COMPLETE``: the completion marker, written last.

Atomicity: every rank writes into ``checkpoints/.tmp-step_N``; after a barrier rank 0 writes the
marker, renames the folder to ``step_N`` and replaces the ``latest`` pointer file (temp file +
``os.replace``). A process killed at any point leaves the previous checkpoint complete and chosen
by ``resume: auto``, which ignores ``.tmp-*`` folders and folders without the marker.

Resume reshards: DCP maps the saved shards onto the current world size and FSDP/HSDP layout. The
RNG state of rank R comes from ``rng/rank_R.json`` when the saving run had that rank. Differences
between the saving and the resuming run (world size, hosts, devices, config) are logged, not
refused. Non-tensor values inside DCP are read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from spmd_rl.checkpoint_files import (  # noqa: F401 (re-exported: the names users of this module import)
    CHECKPOINTS, FORMAT_VERSION, LATEST, MARKER, STEP_PREFIX, TMP_PREFIX, SafeEmptyLoadPlanner, SafeLoadPlanner,
    describe_differences, folder_bytes, fsync_dir, is_complete, latest_checkpoint, list_checkpoints,
    load_without_process_group, read_meta, resolve_checkpoint, rng_state, set_rng_state, step_of, truncate_metrics,
    write_atomic, write_file,
)
from spmd_rl.config import CheckpointConfig
from spmd_rl.distributed.comm import broadcast_object, fail_together

log = logging.getLogger("spmd_rl")
# Weight files are not copied into a checkpoint's hf/ folder: the checkpoint holds the weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_NOT_COPIED = {"model.safetensors.index.json", "pytorch_model.bin.index.json", ".spmd_rl_complete"}


class Stateful(Protocol):
    """What a checkpoint saves and a resume restores. A component whose saved state holds more than
    a resume needs (the megatron engine's HF copy, for export only) also has ``state_dict_to_load()``:
    the part a resume fills, so checkpoints written without the extra part still load."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Saves and restores a run's state (see the module docstring). Collective: every rank of
    ``group`` constructs it and calls :meth:`resume` / :meth:`maybe_save` together."""

    def __init__(self, *, checkpoint: CheckpointConfig, output_dir: str, total_steps: int,
                 rank_table: list[dict[str, Any]], config: dict[str, Any] | None = None,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None) -> None:
        self.cfg = checkpoint
        self.root = Path(output_dir) / CHECKPOINTS
        self.metrics_path = Path(output_dir) / "metrics.jsonl"
        self.total_steps = total_steps
        self.rank_table = rank_table
        self.config = config
        self.device = device
        self.group = group
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.is_coordinator = (dist.get_rank(group) if distributed else 0) == 0
        self.components: dict[str, Stateful] = {}
        self.model_folder: str | None = None
        # Rank 0 decides what to resume from and tells the others, so all load the same folder.
        source = None
        with fail_together(group=group, what="finding the checkpoint to resume"):
            if self.is_coordinator:
                source = self._locate()
        coordinator = dist.get_global_rank(group, 0) if distributed and group is not None else 0
        source = broadcast_object(None if source is None else str(source), src=coordinator, group=group)
        self.source: Path | None = Path(source) if source else None
        self.start_step = 0
        if self.source is not None:
            self.start_step = int(read_meta(self.source)["step"])
        self._last_saved = self.start_step if self.source is not None else None
        if self.is_coordinator:
            dropped = truncate_metrics(self.metrics_path, self.start_step if self.source is not None else -1)
            if dropped:
                log.info(f"{self.metrics_path}: dropped {dropped} line(s) after step {self.start_step}, "
                         "which this run logs again")

    def _locate(self) -> Path | None:
        """What to resume from (coordinator only): None, or a complete checkpoint folder."""
        mode = self.cfg.resume
        if mode == "never":
            if list_checkpoints(self.root):
                log.warning(f"checkpoint.resume=never: {self.root} already holds checkpoints; this run starts "
                            "from step 0 and its saves replace theirs step by step")
            return None
        if mode == "auto":
            found = latest_checkpoint(self.root)
            ignored = [p.name for p in self.root.iterdir()
                       if p.is_dir() and not is_complete(p)] if self.root.is_dir() else []
            if ignored:
                log.info(f"checkpoint.resume=auto: ignoring incomplete folder(s) {sorted(ignored)} in {self.root}")
            return found
        try:
            return resolve_checkpoint(mode)
        except FileNotFoundError as e:
            raise ValueError(f"checkpoint.resume={mode}: {e}") from e

    def track(self, *, model_folder: str | None = None, **components: Stateful) -> None:
        """Name the objects whose ``state_dict()`` a checkpoint holds, and the model folder whose
        config and tokenizer files are copied next to the weights (for the HF export)."""
        self.components.update(components)
        if model_folder is not None:
            self.model_folder = model_folder

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Load the chosen checkpoint into the tracked components and the RNGs; return its step
        (0 when starting fresh). Every rank calls this."""
        if self.source is None:
            if self.cfg.resume == "auto":
                log.info(f"checkpoint.resume=auto: no checkpoint in {self.root}, starting at step 0")
            return 0
        start = time.perf_counter()
        meta = read_meta(self.source)
        missing = sorted(set(self.components) - set(meta.get("components", [])))
        if missing:
            raise ValueError(f"checkpoint {self.source} has no state for {missing}; it holds {meta.get('components')}")
        states = {name: getattr(comp, "state_dict_to_load", comp.state_dict)()  # see Stateful
                  for name, comp in self.components.items()}
        dcp.load(states, storage_reader=dcp.FileSystemReader(str(self.source)), planner=SafeLoadPlanner(),
                 process_group=self.group)
        for name, comp in self.components.items():
            comp.load_state_dict(states[name])
        rng_file = self.source / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            with open(rng_file) as f:
                set_rng_state(json.load(f), self.device)
        else:
            log.warning(f"{self.source} has no RNG state for rank {self.rank} (saved by "
                        f"{len(meta.get('rank_table', []))} ranks); this rank keeps its seeded RNG state")
        saved_config = None
        if (self.source / "config.yaml").is_file():
            saved_config = yaml.safe_load((self.source / "config.yaml").read_text())
        diffs = describe_differences(meta, saved_config, self.rank_table, self.config)
        log.info(f"resumed from {self.source} at step {meta['step']} in {time.perf_counter() - start:.2f} s"
                 + (f"; differences from the saving run: {'; '.join(diffs)}" if diffs else
                    "; same world and config as the saving run"))
        return int(meta["step"])

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether ``step`` gets a checkpoint: every ``checkpoint.every`` steps and after the last."""
        if self._last_saved == step:
            return False
        every = self.cfg.every and step % self.cfg.every == 0
        final = self.cfg.save_final and step == self.total_steps
        return bool(every or final)

    def maybe_save(self, step: int, force: bool = False) -> Path | None:
        """Save when :meth:`due` (or ``force``); returns the published folder or None."""
        if not (force or self.due(step)):
            return None
        return self.save(step)

    def save(self, step: int) -> Path:
        """Write ``step_<step>`` atomically (collective over the group)."""
        start = time.perf_counter()
        name = f"{STEP_PREFIX}{step}"
        tmp = self.root / f"{TMP_PREFIX}{name}"
        with fail_together(group=self.group, what=f"checkpoint save setup ({tmp})"):
            if self.is_coordinator:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / "rng").mkdir(parents=True)
        states = {n: comp.state_dict() for n, comp in self.components.items()}
        dcp.save(states, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group)
        with fail_together(group=self.group, what=f"checkpoint save ({tmp})"):
            write_file(tmp / "rng" / f"rank_{self.rank}.json", json.dumps(rng_state(self.device)))
            if self.is_coordinator:
                self._write_rank0_files(tmp, step)
        # Every rank finished writing (fail_together is a barrier): publish.
        with fail_together(group=self.group, what=f"checkpoint publish ({name})"):
            if self.is_coordinator:
                self._publish(tmp, name)
        self._last_saved = step
        if self.is_coordinator:
            final = self.root / name
            log.info(f"saved checkpoint {final} ({folder_bytes(final) / 2**20:.1f} MiB) in "
                     f"{time.perf_counter() - start:.2f} s")
        return self.root / name

    def _write_rank0_files(self, tmp: Path, step: int) -> None:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": len(self.rank_table),
            "rank_table": self.rank_table,
            "components": sorted(self.components),
            "model_folder": self.model_folder,
            "torch_version": torch.__version__,
        }
        write_file(tmp / "meta.json", json.dumps(meta, indent=1, default=str) + "\n")
        if self.config is not None:
            write_file(tmp / "config.yaml", yaml.safe_dump(self.config, sort_keys=False))
        if self.model_folder is not None:
            hf = tmp / "hf"
            hf.mkdir()
            for item in sorted(Path(self.model_folder).iterdir()):
                if item.is_file() and item.name not in _NOT_COPIED and not item.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(item, hf / item.name)

    def _publish(self, tmp: Path, name: str) -> None:
        write_file(tmp / MARKER, json.dumps({"step": step_of(name)}) + "\n")
        fsync_dir(tmp)
        final = self.root / name
        if final.exists():  # a run started with resume=never, or a re-save of the same step
            trash = self.root / f"{TMP_PREFIX}old-{name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        write_atomic(self.root / LATEST, name + "\n")
        self._prune(step_of(name))  # type: ignore[arg-type]

    def _prune(self, current: int) -> None:
        """Keep the newest ``checkpoint.keep`` checkpoints up to ``current``; drop leftovers of
        interrupted saves. Checkpoints after ``current`` (an abandoned longer run) stay."""
        older = [p for p in list_checkpoints(self.root) if step_of(p) <= current]  # type: ignore[operator]
        for stale in older[:-self.cfg.keep]:
            shutil.rmtree(stale, ignore_errors=True)
        for leftover in self.root.glob(f"{TMP_PREFIX}*"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)


__all__ = [
    "Checkpointer", "SafeEmptyLoadPlanner", "SafeLoadPlanner", "describe_differences", "is_complete",
    "latest_checkpoint", "list_checkpoints", "load_without_process_group", "read_meta", "resolve_checkpoint",
    "rng_state", "set_rng_state", "step_of", "truncate_metrics",
]
