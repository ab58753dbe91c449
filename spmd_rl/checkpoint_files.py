"""Checkpoint folders on disk: find them, read them without a process group, write files atomically.

The layout is described in :mod:`spmd_rl.checkpoint`, whose ``Checkpointer`` saves and resumes with
these helpers; ``python -m spmd_rl.export`` reads checkpoints with them alone.

* finding: :func:`step_of`, :func:`is_complete`, :func:`list_checkpoints`, :func:`latest_checkpoint`,
  :func:`resolve_checkpoint` (a run folder, its ``checkpoints/`` or one ``step_N``), :func:`read_meta`;
* reading without a process group: :func:`load_without_process_group` (DCP with planners that read
  non-tensor values with ``torch.load(weights_only=True)``);
* writing: :func:`~spmd_rl.atomic.write_atomic` (:mod:`spmd_rl.atomic`), :func:`truncate_metrics` (a
  resumed run's ``metrics.jsonl`` cut back to the checkpoint's step);
* every RNG a rank uses as JSON: :func:`rng_state`, :func:`set_rng_state`;
* :func:`describe_differences`: what changed between the saving and the resuming run;
* the run folder's lock: :func:`lock_output_dir`, :func:`unlock_output_dir` (one live run per
  ``trainer.output_dir``);
* checksums: :func:`write_manifest` (``manifest.json``: size and SHA-256 of every file, written
  before ``COMPLETE``), :func:`manifest_problems` and :func:`structure_problems` (what a resume
  would trip on, naming the file).
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

from spmd_rl.atomic import fsync_dir, write_atomic, write_file

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MARKER = "COMPLETE"
TMP_PREFIX = ".tmp-"
STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
LOCK = ".lock"
log = logging.getLogger("spmd_rl")
# Config keys whose change on resume is expected and not worth a log line.
_QUIET_KEYS = ("checkpoint.", "trainer.output_dir", "trainer.total_steps", "logging.")


# --------------------------------------------------------------------------- finding checkpoints


def step_of(folder: str | os.PathLike) -> int | None:
    """``N`` for a folder named ``step_N``, else None."""
    name = Path(folder).name
    if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit():
        return int(name[len(STEP_PREFIX):])
    return None


def is_complete(folder: str | os.PathLike) -> bool:
    """A published checkpoint: named ``step_N``, holding the completion marker and its metadata."""
    folder = Path(folder)
    return step_of(folder) is not None and (folder / MARKER).is_file() and (folder / "meta.json").is_file()


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints`` folder), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p))  # type: ignore[arg-type, return-value]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``resume: auto`` continues from: the ``latest`` pointer when it names a
    complete checkpoint, else the complete checkpoint with the highest step, else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        try:  # a corrupt pointer (bytes that are no name, a NUL) is no pointer: the newest complete one counts
            target = root / pointer.read_text(encoding="utf-8").strip()
            if target.name and is_complete(target):
                return target
        except (UnicodeDecodeError, ValueError, OSError) as e:
            log.warning(f"{pointer} is unreadable ({type(e).__name__}: {e}); ignoring it and taking the newest "
                        "complete step_N folder")
    complete = list_checkpoints(root)
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from a user path: a ``step_N`` folder, a ``checkpoints`` folder or a run
    folder (its newest complete checkpoint), or a checkpoint copied under another name (its step is in
    its ``meta.json``). Raises ``FileNotFoundError`` saying what was found."""
    path = Path(path).expanduser()
    if is_complete(path):
        return path.resolve()
    if step_of(path) is not None and path.is_dir():
        raise FileNotFoundError(f"{path} is an incomplete checkpoint (no {MARKER} marker): its save was "
                                "interrupted; use an earlier step_N folder")
    if (path / "meta.json").is_file():  # one checkpoint, renamed (e.g. a copy): not a run folder
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"{path} holds a checkpoint's meta.json but no {MARKER} marker: its save was "
                                    "interrupted, or the copy is partial (a complete one has the marker, written last)")
        try:
            step = read_meta(path)["step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"step {step!r}")
        except (ValueError, KeyError) as e:  # JSONDecodeError is a ValueError
            raise FileNotFoundError(f"{path}/meta.json does not name the checkpoint's step ({type(e).__name__}: "
                                    f"{e}); is it a checkpoint saved by spmd_rl?") from e
        return path.resolve()
    for root in (path, path / CHECKPOINTS):
        found = latest_checkpoint(root)
        if found is not None:
            return found.resolve()
    raise FileNotFoundError(f"{path}: no complete checkpoint there (looked for {STEP_PREFIX}N folders with a "
                            f"{MARKER} marker in it and in {path / CHECKPOINTS})")


def read_meta(folder: str | os.PathLike) -> dict[str, Any]:
    with open(Path(folder) / "meta.json") as f:
        return json.load(f)


# --------------------------------------------------------------------------- safe DCP loading


class _WeightsOnlyBytes:
    """Non-tensor DCP entries (optimizer hyper-parameters, scheduler and sampler states) are read
    with ``torch.load(weights_only=True)``: plain containers and numbers only, no arbitrary pickle."""

    def load_bytes(self, read_item, value) -> None:  # type: ignore[no-untyped-def]
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = obj  # type: ignore[attr-defined]


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """DCP's default load planner with weights-only reading of non-tensor values."""


class SafeEmptyLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds (a subset of) a saved state dict from the metadata alone, without a model."""


def load_without_process_group(folder: str | os.PathLike, prefixes: list[str] | None = None) -> dict[str, Any]:
    """Read a DCP checkpoint in one process, no process group needed: the nested state dict,
    restricted to entries under the given dotted ``prefixes`` (e.g. ``["actor.model"]``).

    Tensors come back whole (every rank's shard stitched together) on the CPU.
    """
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: PLC0415

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(folder)),
                     planner=SafeEmptyLoadPlanner(keys=set(prefixes) if prefixes else None), no_dist=True)
    return state


# --------------------------------------------------------------------------- RNG states


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states as JSON-able data: Python, NumPy, torch CPU and (when used) CUDA."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": None,
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


# --------------------------------------------------------------------------- small file helpers


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def set_aside_metrics(path: str | os.PathLike) -> tuple[Path, int] | None:
    """Rename an earlier run's ``metrics.jsonl`` to the first free ``metrics.jsonl.N`` (N = 1, 2, ...)
    when a run starts from step 0 in its folder, so its curves are kept; the new name and its line
    count, or None when there is no such file (or an empty one)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    kept = path.with_name(f"{path.name}.{n}")
    with open(path) as f:
        lines = sum(1 for line in f if line.strip())
    os.replace(path, kept)
    return kept, lines


def truncate_metrics(path: str | os.PathLike, keep_through_step: int) -> int:
    """Drop lines of a ``metrics.jsonl`` whose step is after ``keep_through_step`` (all lines when
    starting fresh, i.e. ``-1``), so a resumed run does not log a step twice. Returns lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):
                dropped += 1  # a line cut short by a kill
                continue
            if step <= keep_through_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        write_atomic(path, "".join(kept))
    return dropped


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def describe_differences(saved_meta: dict[str, Any], saved_config: dict[str, Any] | None,
                         rank_table: list[dict[str, Any]], config: dict[str, Any] | None) -> list[str]:
    """Human-readable differences between the saving run and this one (world, hosts, devices, config)."""
    out = []
    old_rows = saved_meta.get("rank_table") or []
    if len(old_rows) != len(rank_table):
        out.append(f"world size {len(old_rows)} -> {len(rank_table)}")
    old_hosts = sorted({str(r.get("host")) for r in old_rows})
    new_hosts = sorted({str(r.get("host")) for r in rank_table})
    if old_hosts != new_hosts:
        out.append(f"hosts {old_hosts} -> {new_hosts}")
    old_dev = sorted({str(r.get("device")).split(":")[0] for r in old_rows})
    new_dev = sorted({str(r.get("device")).split(":")[0] for r in rank_table})
    if old_dev != new_dev:
        out.append(f"devices {old_dev} -> {new_dev}")
    if saved_config is not None and config is not None:
        old, new = _flat(saved_config), _flat(config)
        for key in sorted(set(old) | set(new)):
            if key.startswith(_QUIET_KEYS) or old.get(key) == new.get(key):
                continue
            out.append(f"{key} {old.get(key)!r} -> {new.get(key)!r}")
    return out


# --------------------------------------------------------------------------- the run folder's lock

_HELD_LOCKS: dict[str, list[int]] = {}
"""Lock files this process holds: resolved path -> [file descriptor, holders in this process]."""


class OutputDirInUse(RuntimeError):
    """Another live run holds the output folder's lock."""


def lock_output_dir(folder: str | os.PathLike) -> Path | None:
    """Take ``<folder>/.lock`` for the life of this process and write this run's host, pid and start
    time into it; returns the lock file.

    An ``fcntl`` lock (``lockf``): the kernel drops it when its process ends, however it ends, and
    on NFS the lock manager makes it hold across nodes. A second call by the same process counts
    one more holder (:func:`unlock_output_dir` releases with the last). Raises
    :class:`OutputDirInUse` naming the holder when another process has it. On a filesystem without
    locks it warns and returns None (the run goes on unguarded).
    """
    folder = Path(folder)
    path = folder / LOCK
    try:
        folder.mkdir(parents=True, exist_ok=True)
        key = str(path.resolve())
        if key in _HELD_LOCKS:
            _HELD_LOCKS[key][1] += 1
            return path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(f"trainer.output_dir {folder}: cannot create the run folder or its lock file {path} "
                      f"({e.strerror or e}); set --trainer.output-dir to a writable folder") from e
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)  # this process holds no lock on the file: closing it releases nothing
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise OutputDirInUse(_in_use_message(folder, path)) from None
        log.warning(f"cannot lock {path} ({e.strerror or e}): the filesystem has no file locks, so a second run "
                    "started on this output folder would not be stopped")
        return None
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
    _HELD_LOCKS[key] = [fd, 1]
    return path


def unlock_output_dir(folder: str | os.PathLike) -> None:
    """Release one hold of :func:`lock_output_dir`; the last empties the file and drops the lock."""
    key = str((Path(folder) / LOCK).resolve())
    held = _HELD_LOCKS.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD_LOCKS[key]
    fd = held[0]
    try:
        os.ftruncate(fd, 0)
        fcntl.lockf(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


def _in_use_message(folder: Path, path: Path) -> str:
    holder = None
    for _ in range(20):  # the holder writes its details right after taking the lock
        try:
            holder = json.loads(path.read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.1)
    who = (f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"
           if isinstance(holder, dict) else "its host and pid unknown")
    return (f"trainer.output_dir {folder} is in use by another run ({who}; lock file {path}). Two runs in one "
            "folder would resume each other's checkpoints, delete each other's saves and mix their metrics.jsonl: "
            "wait for that run to end (or stop it), or give this run its own folder with --trainer.output-dir")


def model_parameters(folder: str | os.PathLike) -> int:
    """Parameters of a Hugging Face model folder, from its safetensors headers (nothing is loaded);
    for ``.bin`` / ``.pt`` weights, their bytes / 4 (a lower bound: fp32). For checkpoint sizes."""
    total = 0
    weights = sorted(Path(folder).glob("*.safetensors"))
    for path in weights:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")
    if not weights:
        total = sum(p.stat().st_size for suffix in ("*.bin", "*.pt", "*.pth") for p in Path(folder).glob(suffix)) // 4
    return total


# --------------------------------------------------------------------------- checksums and verification


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match what its save wrote, or that a resume cannot parse."""


class CheckpointMismatch(ValueError):
    """A sound checkpoint that does not fit this run: a component it lacks (e.g. a critic), prompt data or a
    seed other than the ones it was saved with."""


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def describe_files(folder: str | os.PathLike, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` of files under ``folder`` (names relative to it), for the manifest."""
    folder = Path(folder)
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)} for name in names}


def write_manifest(folder: str | os.PathLike, files: dict[str, dict[str, Any]]) -> None:
    """``manifest.json``: the size and SHA-256 of every file of the checkpoint, written before ``COMPLETE``."""
    text = json.dumps({"format_version": 1, "files": dict(sorted(files.items()))}, indent=1) + "\n"
    write_file(Path(folder) / MANIFEST, text)


def read_manifest(folder: str | os.PathLike) -> dict[str, dict[str, Any]] | None:
    """The manifest's files, or None for a checkpoint saved before manifests existed; raises
    :class:`CorruptCheckpoint` when the manifest itself is unreadable."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not all(isinstance(v, dict) and {"bytes", "sha256"} <= set(v) for v in files.values()):
            raise ValueError("an entry without bytes and sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(f"{MANIFEST}: unreadable ({type(e).__name__}: {e})") from e
    return files


def manifest_problems(folder: str | os.PathLike, *, part: int = 0, parts: int = 1) -> list[str]:
    """Files of this caller's share of the manifest (every ``parts``-th, from ``part``) that are
    missing, of another size, or whose SHA-256 differs; [] when they verify or there is no manifest."""
    folder = Path(folder)
    try:
        files = read_manifest(folder)
    except CorruptCheckpoint as e:
        return [str(e)] if part == 0 else []
    problems = []
    for name in sorted(files or {})[part::parts]:
        path, saved = folder / name, files[name]  # type: ignore[index]
        if not path.is_file():
            problems.append(f"{name}: missing (the save wrote {saved['bytes']} bytes)")
        elif (size := path.stat().st_size) != saved["bytes"]:
            problems.append(f"{name}: {size} bytes, the save wrote {saved['bytes']} (truncated or replaced)")
        elif file_sha256(path) != saved["sha256"]:
            problems.append(f"{name}: its bytes changed after the save (SHA-256 differs from {MANIFEST})")
    return problems


def structure_problems(folder: str | os.PathLike) -> list[str]:
    """What a resume would fail to parse, without the manifest: ``meta.json``, the RNG files, DCP's
    ``.metadata`` index, and each shard file at least as long as the index says."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

    folder = Path(folder)
    problems = []
    try:
        step = read_meta(folder)["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step {step!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"meta.json: unreadable ({type(e).__name__}: {e})")
    for rng in sorted((folder / "rng").glob("*.json")):
        try:
            json.loads(rng.read_text())["python"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"rng/{rng.name}: unreadable ({type(e).__name__}: {e})")
    if not (folder / ".metadata").is_file():
        return problems + [".metadata: missing (DCP's index of the saved tensors)"]
    try:
        index = FileSystemReader(str(folder)).read_metadata()
        ends: dict[str, int] = {}
        for info in index.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - an unpickling error can be of any type
        return problems + [f".metadata: unreadable ({type(e).__name__}: {e})"]
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing (named in .metadata)")
        elif (size := path.stat().st_size) < end:
            problems.append(f"{name}: {size} bytes, shorter than the {end} that .metadata indexes (truncated)")
    return problems


__all__ = ["CHECKPOINTS", "FORMAT_VERSION", "LATEST", "MARKER", "STEP_PREFIX", "TMP_PREFIX", "SafeEmptyLoadPlanner",
           "SafeLoadPlanner", "describe_differences", "is_complete", "latest_checkpoint", "list_checkpoints",
           "load_without_process_group", "read_meta", "resolve_checkpoint", "rng_state", "set_rng_state", "step_of",
           "set_aside_metrics", "truncate_metrics", "folder_bytes", "fsync_dir", "write_atomic", "write_file",
           "LOCK", "MANIFEST", "CorruptCheckpoint", "OutputDirInUse", "describe_files", "file_sha256",
           "lock_output_dir", "manifest_problems", "model_parameters", "read_manifest", "structure_problems",
           "unlock_output_dir",
           "write_manifest"]
