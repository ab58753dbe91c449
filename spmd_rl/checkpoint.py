"""Distributed checkpoints: save the whole training state with DCP, find it again, resume from it.

    ckpt = Checkpointer(checkpoint=cfg.checkpoint, output_dir=cfg.trainer.output_dir,
                        total_steps=cfg.trainer.total_steps, rank_table=rows, config=to_dict(cfg))
    sink = RunSink(..., start_step=ckpt.start_step,          # known before anything is loaded
                   start_elapsed_s=ckpt.start_elapsed_s)
    ckpt.track(model_folder=folder, actor=engine, sampler=sampler)   # state_dict()/load_state_dict()
    ckpt.check_writable(checkpoint_bytes(num_params))        # before the first step: writable, space
    step = ckpt.resume()                                     # 0 on a fresh start
    while step < total: ...; ckpt.maybe_save(step)           # every N, every_s, final; on a stop signal:
                                                             # save, then Preempted on every rank
    ckpt.close()                                             # releases the output folder's lock

What a checkpoint holds (``<output_dir>/checkpoints/step_N/``):

* the tracked components' ``state_dict()`` in one ``torch.distributed.checkpoint`` (DCP) save: the
  actor's sharded model and optimizer (DTensors, never gathered), its LR scheduler, the prompt
  sampler's position. DCP files: ``.metadata`` and one ``__R_0.distcp`` per rank;
* ``rng/rank_R.json``: every rank's Python ``random``, NumPy, torch CPU (and CUDA) RNG states;
* ``meta.json``: step, time, the run's elapsed wall time (``elapsed_s``, continued by a resume), the
  rank table of the saving run, the model it trained;
* ``config.yaml``: the run's resolved config;
* ``hf/``: the model folder's config and tokenizer files, so ``python -m spmd_rl.export`` needs
  nothing else;
* ``manifest.json``: size and SHA-256 of every file above (each rank checksums what it wrote);
* ``COMPLETE``: the completion marker, written last.

One run per output folder: the constructor's rank 0 takes ``<output_dir>/.lock`` (an ``fcntl`` lock,
released when the process ends) before it reads or writes anything there; a second run refuses,
naming the holder's host, pid and start time.

Atomicity: every rank writes into ``checkpoints/.tmp-step_N``; after a barrier rank 0 writes the
marker, renames the folder to ``step_N`` and replaces the ``latest`` pointer file (temp file +
``os.replace``). A process killed at any point leaves the previous checkpoint complete and chosen
by ``resume: auto``, which ignores ``.tmp-*`` folders and folders without the marker. A save that
runs out of disk space removes its partial folder and keeps the previous checkpoint: a periodic
save warns and training goes on, the last save raises.

Verification: before loading, the ranks checksum the chosen checkpoint's files against its manifest
(each a share) and rank 0 parses what a resume reads; ``auto`` falls back to the newest older
checkpoint that verifies (a warning names the skipped one and its bad file), an explicit path
fails naming the file. Checkpoints without a manifest (older saves) get the parse checks only.

Resume reshards: DCP maps the saved shards onto the current world size and FSDP/HSDP layout. The
RNG state of rank R comes from ``rng/rank_R.json`` when the saving run had that rank. Differences
between the saving and the resuming run (world size, hosts, devices, config) are logged, not
refused. Non-tensor values inside DCP are read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from spmd_rl.checkpoint_files import (
    CHECKPOINTS, FORMAT_VERSION, LATEST, MARKER, STEP_PREFIX, TMP_PREFIX, describe_files, folder_bytes, fsync_dir,
    latest_checkpoint, list_checkpoints, lock_output_dir, read_meta, rng_state, set_aside_metrics, step_of,
    truncate_metrics, unlock_output_dir, write_atomic, write_file, write_manifest,
)
from spmd_rl.checkpoint_resume import Resuming
from spmd_rl.config import CheckpointConfig
from spmd_rl.distributed import watchdog
from spmd_rl.distributed.comm import all_gather_objects, broadcast_object, fail_together
from spmd_rl.distributed.process import PREEMPTED, Preempted, stop_signal

log = logging.getLogger("spmd_rl")
# Weight files are not copied into a checkpoint's hf/ folder: the checkpoint holds the weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_NOT_COPIED = {"model.safetensors.index.json", "pytorch_model.bin.index.json", ".spmd_rl_complete"}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class Stateful(Protocol):
    """What a checkpoint saves and a resume restores (the engines, the prompt sampler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


EXPORT = "hf"
"""Top-level checkpoint entry of the full HF-named weights that ``spmd_rl.export`` reads when the
actor's own state does not hold them under HF names (the megatron engine's); written, never loaded."""


class Checkpointer(Resuming):
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
        self.optional: set[str] = set()
        self.export: Callable[[], dict[str, torch.Tensor]] | None = None
        self.model_folder: str | None = None
        self.output_dir = Path(output_dir)
        self.group_rank = dist.get_rank(group) if distributed else 0
        self.group_size = dist.get_world_size(group) if distributed else 1
        self.expected_bytes: int | None = None  # one checkpoint's size: check_writable's estimate, then the last save's
        # One live run per output folder: rank 0 locks it before anything in it is read or written.
        self._locked = False
        with fail_together(group=group, what=f"locking the output folder {output_dir}"):
            if self.is_coordinator:
                self._locked = lock_output_dir(output_dir) is not None
        try:
            # Rank 0 lists what to resume from and tells the others; all verify the checkpoint together
            # (each rank checksums a share of its files), so all load the same folder.
            candidates = None
            with fail_together(group=group, what="finding the checkpoint to resume"):
                if self.is_coordinator:
                    candidates = [str(p) for p in self._locate()]
            coordinator = dist.get_global_rank(group, 0) if distributed and group is not None else 0
            candidates = broadcast_object(candidates, src=coordinator, group=group)
            self.source: Path | None = self._first_verified([Path(c) for c in candidates])
        except BaseException:
            self.close()
            raise
        self.start_step = 0
        self.start_elapsed_s = 0.0  # the run's wall time when the checkpoint was saved: elapsed_s goes on from it
        if self.source is not None:
            saved = read_meta(self.source)
            if saved.get("weights_only"):  # every rank read the same meta.json: all refuse together
                self.close()
                raise ValueError(
                    f"checkpoint {self.source} holds the model's weights only (checkpoint.weights_only), which cannot "
                    f"resume a run: give a new --trainer.output-dir, or --checkpoint.resume never to start over here; "
                    f"spmd_rl.evaluate --from-checkpoint and spmd_rl.export read it")
            self.start_step = int(saved["step"])
            self.start_elapsed_s = float(saved.get("elapsed_s", 0.0))
        if self.start_step > total_steps:  # every rank read the same meta.json: all refuse together
            self.close()
            raise ValueError(f"checkpoint {self.source} is at step {self.start_step}, past trainer.total_steps="
                             f"{total_steps}: give --trainer.total-steps above {self.start_step} to train on, "
                             "or --checkpoint.resume never to start over")
        self._clock_zero = time.time() - self.start_elapsed_s
        self._last_saved = self.start_step if self.source is not None else None
        self.clock: Callable[[], float] = time.monotonic  # rank 0's clock decides checkpoint.every_s (tests swap it)
        self._last_save_at = self.clock()
        self.save_seconds = 0.0  # time spent saving since the last pop_timing() (rank 0's clock)
        if self.is_coordinator:
            if self.source is not None:
                self.expected_bytes = folder_bytes(self.source)  # what the next save will need, about
            kept = set_aside_metrics(self.metrics_path) if self.source is None else None  # another run's curves
            if kept is not None:
                log.info(f"{self.metrics_path}: an earlier run's {kept[1]} line(s) kept as {kept[0].name}; this run "
                         "starts at step 0 and writes a new one")
            dropped = truncate_metrics(self.metrics_path, self.start_step if self.source is not None else -1)
            if dropped:
                log.info(f"{self.metrics_path}: dropped {dropped} line(s) after step {self.start_step}, "
                         "which this run logs again")

    def track(self, *, model_folder: str | None = None, export: Callable[[], dict[str, torch.Tensor]] | None = None,
              optional: Iterable[str] = (), **components: Stateful) -> None:
        """Name the objects whose ``state_dict()`` a checkpoint holds, the model folder whose config and
        tokenizer files are copied next to the weights, and ``export``: full HF-named weights saved
        under :data:`EXPORT` for ``spmd_rl.export`` and never loaded (the actor's ``export_weights``).
        ``optional`` components keep their state when a checkpoint has none for them (one saved by a
        run that did not track them)."""
        self.components.update(components)
        self.optional.update(optional)
        if model_folder is not None:
            self.model_folder = model_folder
        if export is not None:
            self.export = export

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether ``step`` gets a checkpoint: every ``checkpoint.every`` steps and after the last."""
        if self._last_saved == step:
            return False
        every = self.cfg.every and step % self.cfg.every == 0
        final = self.cfg.save_final and step == self.total_steps
        return bool(every or final)

    def maybe_save(self, step: int, force: bool = False) -> Path | None:
        """Save when :meth:`due`, when ``checkpoint.every_s`` passed on rank 0's clock, on a stop signal
        (any rank's) or with ``force``; returns the published folder or None. Collective: the ranks
        decide together (:meth:`decide`). After a save for a stop signal it raises :class:`Preempted`
        (every rank), unless ``step`` was the last."""
        signum, timed = self.decide()
        path = None
        if force or timed or signum or self.due(step):
            path = self.save(step) if self._last_saved != step else self.root / f"{STEP_PREFIX}{step}"
        if signum and step < self.total_steps:
            raise self._preempted(signum, step, path)
        return path

    def decide(self) -> tuple[int, bool]:
        """(the stop signal any rank received, 0 if none; whether ``checkpoint.every_s`` has passed on
        rank 0's clock): one all-reduce over the group, so every rank acts alike."""
        timed = bool(self.cfg.every_s) and self.is_coordinator and self.clock() - self._last_save_at >= self.cfg.every_s
        flags = [stop_signal() or 0, int(timed)]
        if dist.is_initialized() and self.group_size > 1:
            device = self.device if self.device is not None and self.device.type == "cuda" else torch.device("cpu")
            both = torch.tensor(flags, dtype=torch.int64, device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
            flags = both.tolist()
        return int(flags[0]), bool(flags[1])

    def _preempted(self, signum: int, step: int, path: Path | None) -> Preempted:
        """The one line (rank 0) and the exception every rank raises after a save on a stop signal."""
        name = signal.Signals(signum).name
        if path is not None:
            kept, what = str(path), f"saved {path}"
        else:
            newest = latest_checkpoint(self.root)
            kept = None if newest is None else str(newest)
            what = f"the save failed, the newest complete checkpoint is {kept}" if kept else "no checkpoint could be saved"
        message = (f"stopped by {name} after step {step}/{self.total_steps}: {what}; run the same command again to "
                   f"resume (exit status {PREEMPTED})")
        if self.is_coordinator:
            log.warning(message)
        return Preempted(message, signum=signum, step=step, checkpoint=kept)

    def pop_timing(self) -> dict[str, float]:
        """``timing_s/checkpoint``: seconds spent saving since the last call (rank 0's clock); {} when none."""
        seconds, self.save_seconds = self.save_seconds, 0.0
        return {"timing_s/checkpoint": seconds} if seconds else {}

    def save(self, step: int) -> Path | None:
        """Write ``step_<step>`` atomically (collective over the group), as the watchdog's stage
        ``checkpoint`` (a rank that hangs in it ends the run after ``trainer.stall_timeout_s``). When the
        disk is full (or the quota spent) the partial folder is removed and the previous checkpoint
        kept; a periodic save then returns None after a warning and training goes on, the run's last
        save raises."""
        start = time.perf_counter()
        try:
            with watchdog.current().stage("checkpoint", step):
                return self._save(step)
        finally:
            self.save_seconds += time.perf_counter() - start
            self._last_save_at = self.clock()

    def _save(self, step: int) -> Path | None:
        start = time.perf_counter()
        name = f"{STEP_PREFIX}{step}"
        tmp = self.root / f"{TMP_PREFIX}{name}"
        states = {n: comp.state_dict() for n, comp in self.components.items()}
        if self.cfg.weights_only:  # checkpoint.weights_only: the models' weights, nothing a resume needs
            states = {n: {"model": s["model"]} for n, s in states.items() if isinstance(s, dict) and "model" in s}
        if self.export is not None:
            states[EXPORT] = self.export()  # collective (a gather of every weight); {} when not needed
        try:  # every stage fails on every rank together, so all ranks reach the except clause together
            with fail_together(group=self.group, what=f"checkpoint save setup ({tmp})"):
                if self.is_coordinator:
                    if tmp.exists():
                        shutil.rmtree(tmp)
                    (tmp / "rng").mkdir(parents=True)
            dcp.save(states, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group)
            mine: dict[str, dict[str, Any]] = {}
            with fail_together(group=self.group, what=f"checkpoint save ({tmp})"):
                write_file(tmp / "rng" / f"rank_{self.rank}.json", json.dumps(rng_state(self.device)))
                if self.is_coordinator:
                    self._write_rank0_files(tmp, step)
                else:  # checksums of the files this rank wrote (the coordinator does the rest at publish)
                    own = [f"rng/rank_{self.rank}.json", *sorted(p.name for p in tmp.glob(f"__{self.group_rank}_*"))]
                    mine = describe_files(tmp, own)
            reported = all_gather_objects(mine, self.group)
            # Every rank finished writing (fail_together is a barrier): publish.
            with fail_together(group=self.group, what=f"checkpoint publish ({name})"):
                if self.is_coordinator:
                    self._publish(tmp, name, {k: v for part in reported for k, v in part.items()})
        except (Exception, CheckpointException) as e:  # DCP's error is a BaseException
            return self._save_failed(step, tmp, e)
        self._last_saved = step
        if self.is_coordinator:
            final = self.root / name
            self.expected_bytes = folder_bytes(final)
            log.info(f"saved checkpoint {final} ({self.expected_bytes / 2**20:.1f} MiB) in "
                     f"{time.perf_counter() - start:.2f} s")
        return self.root / name

    def _save_failed(self, step: int, tmp: Path, error: BaseException) -> None:
        """After a save failed on every rank: out of space on any rank -> remove the partial folder
        and warn (periodic save) or raise (the run's last save); anything else is raised as it is."""
        kept = latest_checkpoint(self.root) if self.is_coordinator else None
        report = (_out_of_space(error), self.expected_bytes, _free_bytes(self.root) if self.is_coordinator else None,
                  None if kept is None else str(kept))
        try:
            reports = all_gather_objects(report, self.group)
        except Exception:  # noqa: BLE001 - the group is broken: the save's own error says more
            raise error from None
        if not any(report[0] for report in reports):
            raise error
        _, needed, free, kept_path = reports[0]
        with fail_together(group=self.group, what=f"removing the partial {tmp}"):  # all go on once it is gone
            if self.is_coordinator:
                shutil.rmtree(tmp, ignore_errors=True)
        kept = f"kept {kept_path}" if kept_path else "there is no earlier checkpoint in it"
        message = (f"checkpoint step_{step}: no space left in {self.root} (a checkpoint needs about "
                   f"{_bytes(needed)}, {_bytes(free)} free); removed the partial {tmp.name}, {kept}")
        if step >= self.total_steps:
            again = ("it resumes from the kept checkpoint" if kept_path else
                     "there is no checkpoint to resume from, so it starts over at step 0")
            raise OSError(errno.ENOSPC, f"{message}. Free space (or set --trainer.output-dir elsewhere) and run "
                          f"the same command again: {again}") from error
        if self.is_coordinator:
            log.warning(f"!!! {message}. Training goes on without this checkpoint; the next save tries again. "
                        "Free space now, or a crash loses the steps since the kept checkpoint")
        return None

    def check_writable(self, expected_bytes: int) -> None:
        """Before the first step (collective): refuse when the checkpoint folder cannot be written, or
        has less free space than one checkpoint needs (``expected_bytes``, e.g.
        :func:`checkpoint_bytes`; the resumed checkpoint's size when larger). Nothing is checked
        when the run saves no checkpoint."""
        if self.is_coordinator:
            self.expected_bytes = max(expected_bytes, self.expected_bytes or 0)
            log.info(self.disk_line())
        if not (self.cfg.every or self.cfg.save_final):
            return
        with fail_together(group=self.group, what=f"checking the checkpoint folder {self.root}"):
            if self.is_coordinator:
                probe = self.root / f".probe-{os.getpid()}"
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                    write_file(probe, "can this run write checkpoints here?\n")
                    probe.unlink()
                except OSError as e:
                    raise OSError(f"checkpoint folder {self.root} is not writable ({type(e).__name__}: "
                                  f"{e.strerror or e}); this run would lose its steps at the first save: fix the "
                                  "folder or set --trainer.output-dir") from e
                free = _free_bytes(self.root)
                if free is not None and free < self.expected_bytes:  # type: ignore[operator]
                    raise OSError(f"checkpoint folder {self.root} has {_bytes(free)} free, but a checkpoint of this "
                                  f"run needs about {_bytes(self.expected_bytes)}: free space, or set "
                                  "--trainer.output-dir on a larger disk")

    def disk_line(self) -> str:
        """The start's one line on checkpoints: how big, where, how many kept, and how to save less."""
        cfg = self.cfg
        if not (cfg.every or cfg.save_final or cfg.every_s):
            return f"checkpoints: none (checkpoint.every 0, --checkpoint.no-save-final): {self.root} stays empty"
        when = ", ".join(w for w, on in ((f"every {cfg.every} steps", cfg.every), (f"every {cfg.every_s:g} s", cfg.every_s),
                                         ("after the last step", cfg.save_final)) if on)
        what = ("model weights only, not resumable" if cfg.weights_only else
                "fp32 weights + AdamW + run state, resumable; --checkpoint.weights-only saves a third")
        size = self.expected_bytes or 0
        size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
        return (f"checkpoints: about {size_text} each ({what}) in {self.root}, {when}, the newest "
                f"{cfg.keep} kept (--checkpoint.keep); --checkpoint.no-save-final saves none")

    def close(self) -> None:
        """Release the output folder's lock (the OS releases it too when the process ends)."""
        if self._locked:
            self._locked = False
            unlock_output_dir(self.output_dir)

    def _write_rank0_files(self, tmp: Path, step: int) -> None:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": len(self.rank_table),
            "rank_table": self.rank_table,
            "components": sorted(self.components),
            "weights_only": self.cfg.weights_only,
            "model_folder": self.model_folder,
            "torch_version": torch.__version__,
            "elapsed_s": round(time.time() - self._clock_zero, 3),
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

    def _publish(self, tmp: Path, name: str, files: dict[str, dict[str, Any]]) -> None:
        """Manifest (the other ranks' checksums in ``files``, the coordinator's files added here),
        marker, rename, ``latest``, prune."""
        rest = sorted(rel for p in tmp.rglob("*")
                      if p.is_file() and (rel := p.relative_to(tmp).as_posix()) not in files and rel != MARKER)
        write_manifest(tmp, {**files, **describe_files(tmp, rest)})
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


def checkpoint_bytes(num_params: int, *, hf_copy: bool = False, weights_only: bool = False) -> int:
    """About how many bytes one checkpoint of a model with ``num_params`` parameters takes: fp32
    weights and AdamW's two fp32 moments (12 bytes a parameter; ``weights_only``: the weights, 4),
    ``hf_copy`` the megatron engine's full copy of the weights for the export (4 more), and 16 MiB
    for indexes, RNG and tokenizer files."""
    return num_params * ((4 if weights_only else 12) + (4 if hf_copy else 0)) + 16 * 2**20


def _out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps, including DCP's per-rank failures) is ENOSPC / EDQUOT."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return False


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def _bytes(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    if n < 2**20:
        return f"{n} bytes"
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n} bytes ({n / 2**20:.1f} MiB)"


__all__ = ["Checkpointer", "Stateful", "checkpoint_bytes"]
