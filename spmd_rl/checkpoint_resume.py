"""Resuming a run from its checkpoints, mixed into :class:`~spmd_rl.checkpoint.Checkpointer` (as
:mod:`spmd_rl.engine.fsdp_state` is into the FSDP engine): which checkpoint (:meth:`Resuming._locate`),
whether its files verify (:meth:`Resuming._first_verified`, collective: every rank checksums a share of
the manifest), and loading it into the tracked components and the RNGs (:meth:`Resuming.resume`). The
module docstring of :mod:`spmd_rl.checkpoint` says what a checkpoint holds and how ``auto`` falls back.

It reads the checkpointer's ``cfg`` (``checkpoint.resume``), ``root``, ``source`` (what the constructor
chose), ``components`` / ``optional`` (what :meth:`~spmd_rl.checkpoint.Checkpointer.track` named),
``group`` and its ``group_rank`` / ``group_size``, ``rank``, ``is_coordinator``, ``device``,
``rank_table`` and ``config``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from spmd_rl.checkpoint_files import (
    MANIFEST, CheckpointMismatch, CorruptCheckpoint, SafeLoadPlanner, describe_differences, is_complete,
    latest_checkpoint, list_checkpoints, manifest_problems, read_meta, resolve_checkpoint, set_rng_state, step_of,
    structure_problems,
)
from spmd_rl.distributed.comm import all_gather_objects

log = logging.getLogger("spmd_rl")
_UNVERIFIED: set[str] = set()  # checkpoints without a manifest already warned about (once each)

ELSEWHERE = "give a new --trainer.output-dir, or --checkpoint.resume never to start over here"
"""What a run whose checkpoint cannot resume it can do instead (in :class:`CheckpointMismatch` messages)."""


class Resuming:
    """:meth:`resume` and the choice and verification of its checkpoint (module docstring)."""

    def _locate(self) -> list[Path]:
        """What to resume from (coordinator only), best first: nothing, the named checkpoint, or for
        ``auto`` the newest complete checkpoint and then the older ones (the fallbacks when it does
        not verify)."""
        mode = self.cfg.resume
        if mode == "never":
            if list_checkpoints(self.root):
                log.warning(f"checkpoint.resume=never: {self.root} already holds checkpoints; this run starts "
                            "from step 0 and its saves replace theirs step by step")
            return []
        if mode == "auto":
            found = latest_checkpoint(self.root)
            ignored = [p.name for p in self.root.iterdir()
                       if p.is_dir() and not is_complete(p)] if self.root.is_dir() else []
            if ignored:
                log.info(f"checkpoint.resume=auto: ignoring incomplete folder(s) {sorted(ignored)} in {self.root}")
            if found is None:
                return []
            older = [p for p in list_checkpoints(self.root) if step_of(p) < step_of(found)]  # type: ignore[operator]
            return [found, *reversed(older)]
        try:
            return [resolve_checkpoint(mode)]
        except FileNotFoundError as e:
            raise ValueError(f"checkpoint.resume={mode}: {e}") from e

    def _first_verified(self, candidates: list[Path]) -> Path | None:
        """The first candidate whose files verify (collective). ``auto`` skips a corrupt checkpoint with
        a warning naming it and its bad file; an explicit path, or no checkpoint verifying, raises
        :class:`CorruptCheckpoint` (the same on every rank: every rank sees every rank's findings)."""
        skipped = []
        for folder in candidates:
            problems = self._verify(folder)
            if not problems:
                if skipped and self.is_coordinator:
                    log.warning(f"checkpoint.resume=auto: resuming from {folder.name}, an older checkpoint, after "
                                f"skipping {'; '.join(skipped)}")
                return folder
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            if self.cfg.resume != "auto":
                raise CorruptCheckpoint(f"checkpoint {folder} is corrupt: {shown}. Resume from another checkpoint "
                                        "(--checkpoint.resume), or restore the file")
            if self.is_coordinator:
                log.warning(f"checkpoint.resume=auto: skipping the corrupt checkpoint {folder}: {shown}")
            skipped.append(f"{folder.name} ({problems[0]})")
        if skipped:
            raise CorruptCheckpoint(f"checkpoint.resume=auto: no checkpoint in {self.root} verifies: "
                                    f"{'; '.join(skipped)}. Restore the files, or start over at step 0 with "
                                    "--checkpoint.resume never")
        return None

    def _verify(self, folder: Path) -> list[str]:
        """Problems of ``folder`` found by all ranks together (collective): each checksums its share of
        the manifest's files; the coordinator also parses what a resume reads. [] when it verifies.
        A checkpoint saved before manifests existed gets the parse checks only (a warning says so)."""
        try:
            hashed = manifest_problems(folder, part=self.group_rank, parts=self.group_size)
            parsed = structure_problems(folder) if self.is_coordinator else []
            if self.is_coordinator and not (folder / MANIFEST).is_file() and str(folder) not in _UNVERIFIED:
                _UNVERIFIED.add(str(folder))
                log.warning(f"{folder} has no {MANIFEST} (saved before checkpoints carried checksums): its files "
                            "are not verified against what the save wrote")
        except Exception as e:  # noqa: BLE001 - a rank that fails here must still join the gather
            hashed, parsed = [f"verification failed on rank {self.rank}: {type(e).__name__}: {e}"], []
        found = all_gather_objects((hashed, parsed), self.group)
        return [p for h, _ in found for p in h] or [p for _, s in found for p in s]

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
        saved = set(meta.get("components", []))
        missing = sorted(set(self.components) - saved - self.optional)
        if missing:
            raise CheckpointMismatch(f"checkpoint {self.source} has no state for {missing} (it holds "
                                     f"{meta.get('components')}); {ELSEWHERE}")
        loading = {name: comp for name, comp in self.components.items() if name in saved}
        states = {name: comp.state_dict() for name, comp in loading.items()}
        try:
            dcp.load(states, storage_reader=dcp.FileSystemReader(str(self.source)), planner=SafeLoadPlanner(),
                     process_group=self.group)
        except (Exception, CheckpointException) as e:  # DCP's error is a BaseException, raised on every rank
            raise RuntimeError(f"loading checkpoint {self.source} failed: {describe_dcp_error(e)}") from e
        for name, comp in loading.items():
            try:
                comp.load_state_dict(states[name])
            except ValueError as e:  # the sampler's prompt data or seed, say: this run is not the one that saved
                raise CheckpointMismatch(f"checkpoint {self.source} does not fit this run: {e}; resume with the "
                                         f"settings it was saved with, or {ELSEWHERE}") from e
        rng_file = self.source / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            try:
                state = json.loads(rng_file.read_text())
            except ValueError as e:
                raise CorruptCheckpoint(f"checkpoint {self.source} is corrupt: rng/{rng_file.name} is not JSON "
                                        f"({e})") from e
            set_rng_state(state, self.device)
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
        return int(meta["step"])  # at trainer.total_steps: nothing to train (RunSink says so at the start)


def describe_dcp_error(error: BaseException) -> str:
    """One line per failure: DCP's exception holds every failing rank's error (and a traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(f[0]).__name__}: {f[0]}" for rank, f in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


__all__ = ["ELSEWHERE", "Resuming", "describe_dcp_error"]
