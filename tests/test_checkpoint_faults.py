"""Nothing lost, nothing hangs: a shared output folder, an unwritable or full disk, corrupt checkpoints.

* one live run per ``trainer.output_dir``: rank 0 holds an ``fcntl`` lock on ``<output_dir>/.lock``;
  a second run refuses (every rank, naming the holder's pid) before it reads or writes anything;
* the checkpoint folder is checked before the first step (writable, free space for a checkpoint),
  and a save that hits ENOSPC keeps the previous checkpoint (periodic: warn and go on; last: raise);
* every checkpoint carries ``manifest.json`` (SHA-256 of each file); a resume names the bad file of a
  corrupt checkpoint, and ``resume: auto`` falls back to the newest one that verifies.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.checkpoint import Checkpointer
from spmd_rl.checkpoint_files import (
    LOCK, MANIFEST, CorruptCheckpoint, OutputDirInUse, list_checkpoints, lock_output_dir, unlock_output_dir,
)
from spmd_rl.config import CheckpointConfig
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed, run_program
from test_train_e2e import TINY

TABLE = [{"rank": 0, "host": "h", "device": "cpu"}]


def torchrun(out_dir: Path, *flags: str, nproc: int = 2, env: dict | None = None, popen: bool = False):
    """The entry point on ``nproc`` ranks: a live ``torchrun`` (``popen``), or ranks forked from a
    warm process (``run_program``) when only the outcome matters."""
    if not popen:
        return run_program("spmd_rl.train", [*TINY, "--trainer.output-dir", str(out_dir), *flags], nproc=nproc,
                           env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **(env or {})),
                           cwd=REPO, timeout=300)
    environ = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", str(out_dir), *flags]
    return subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR\n{proc.stderr[-6000:]}"


class _Component:
    def __init__(self) -> None:
        self.x = torch.arange(6.0)

    def state_dict(self) -> dict:
        return {"x": self.x}

    def load_state_dict(self, state: dict) -> None:
        self.x.copy_(state["x"])


def _outcome(fn) -> tuple[str, str]:
    try:
        return "ok", str(fn())
    except BaseException as e:  # noqa: BLE001 - the test compares every rank's outcome
        return type(e).__name__, str(e)


# --------------------------------------------------------------------------- the output folder's lock


def _open_checkpointer_body(rank: int, world_size: int, out_dir: str) -> tuple[str, str]:
    def build() -> str:
        ckpt = Checkpointer(checkpoint=CheckpointConfig(), output_dir=out_dir, total_steps=4,
                            rank_table=TABLE * world_size)
        held = (Path(out_dir) / LOCK).read_text()
        ckpt.close()
        return held
    return _outcome(build)


def test_a_second_run_on_a_locked_folder_refuses_on_every_rank(tmp_path):
    """This process holds the folder (as a live run's rank 0 would): both ranks of a new run refuse,
    naming this process, and leave metrics.jsonl alone; once released, the new run takes it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    lock_output_dir(out)
    try:
        results = run_distributed(_open_checkpointer_body, 2, str(out))
    finally:
        unlock_output_dir(out)
    (kind0, msg0), (kind1, msg1) = results
    assert kind0 == OutputDirInUse.__name__, results
    for needle in (f"pid {os.getpid()}", f"host {socket.gethostname()}", "--trainer.output-dir", str(out)):
        assert needle in msg0, msg0
    assert kind1 == "RankFailure" and f"pid {os.getpid()}" in msg1, results  # rank 1 learns it, no hang
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'  # a fresh start truncates it
    (kind0, held), (kind1, _) = run_distributed(_open_checkpointer_body, 2, str(out))
    assert kind0 == kind1 == "ok" and json.loads(held)["pid"] != os.getpid(), held


def test_lock_is_shared_within_a_process_and_dropped_at_the_last_release(tmp_path):
    lock_output_dir(tmp_path)
    lock_output_dir(tmp_path)  # a second holder in the same process (the sink after the Checkpointer)
    unlock_output_dir(tmp_path)
    assert run_distributed(_open_checkpointer_body, 1, str(tmp_path))[0][0] == "OutputDirInUse"
    unlock_output_dir(tmp_path)
    assert run_distributed(_open_checkpointer_body, 1, str(tmp_path))[0][0] == "ok"


def test_two_concurrent_runs_on_one_folder(tmp_path):
    """A live run (held at its first reward call) keeps a second run out of its folder: the second
    exits non-zero naming the first's pid; the first completes; a run started after it ends resumes."""
    out = tmp_path / "run"
    started, go = tmp_path / "started", tmp_path / "go"
    first = torchrun(out, "--trainer.total-steps", "2", "--checkpoint.every", "1", "--reward.timeout-s", "0",
                     "--reward.fn", "support.faults:digit_fraction_paused_once", nproc=1, popen=True,
                     env={"PAUSE_STARTED": str(started), "PAUSE_GO": str(go)})
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert started.exists(), f"the first run did not reach its first step: {first.communicate()[1][-4000:]}"
        holder = json.loads((out / LOCK).read_text())
        second = torchrun(out, "--trainer.total-steps", "2")
        assert second.returncode != 0
        assert f"pid {holder['pid']}" in second.stderr and "is in use by another run" in second.stderr, \
            second.stderr[-4000:]
        assert "--trainer.output-dir" in second.stderr
    finally:
        go.write_text("")
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-6000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    third = torchrun(out, "--trainer.total-steps", "3", nproc=1)  # the lock died with the first run
    _ok(third)
    assert "step_2 at step 2" in third.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


# --------------------------------------------------------------------------- unwritable or full disks


def _check_writable_body(rank: int, world_size: int, tmp: str) -> list[tuple[str, str]]:
    table = TABLE * world_size
    unwritable = Path(tmp) / "unwritable"
    if rank == 0:
        (unwritable / "checkpoints").parent.mkdir(parents=True, exist_ok=True)
        (unwritable / "checkpoints").write_text("a regular file where the checkpoint folder goes\n")
    torch.distributed.barrier()
    ckpt = Checkpointer(checkpoint=CheckpointConfig(), output_dir=str(unwritable), total_steps=4, rank_table=table)
    refused = _outcome(lambda: ckpt.check_writable(10**6))
    ckpt.close()
    roomy = Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/ok", total_steps=4, rank_table=table)
    fine = _outcome(lambda: roomy.check_writable(10**6))
    full = _outcome(lambda: roomy.check_writable(shutil.disk_usage(tmp).free + 2**50))
    probes = [p.name for p in roomy.root.iterdir()]
    roomy.close()
    return [refused, fine, full, ("probes", str(probes))]


def test_check_writable_refuses_an_unwritable_or_full_checkpoint_folder(tmp_path):
    """Before the first step: a checkpoint folder that cannot be created (a path under a regular
    file: refused even for root) and a disk with less free space than a checkpoint needs are refused
    on every rank, naming the folder, the bytes needed and the bytes free."""
    ranks = run_distributed(_check_writable_body, 2, str(tmp_path))
    for rank, (refused, fine, full, probes) in enumerate(ranks):
        assert refused[0] == ("OSError" if rank == 0 else "RankFailure"), refused
        assert "unwritable/checkpoints is not writable" in refused[1] and "--trainer.output-dir" in refused[1], refused
        assert fine == ("ok", "None"), fine
        assert full[0] == ("OSError" if rank == 0 else "RankFailure"), full
        assert "ok/checkpoints has" in full[1] and "free, but a checkpoint of this run needs about" in full[1], full
        assert str(2**50) in full[1] or "GiB" in full[1], full
        assert probes == ("probes", "[]"), probes  # the probe file is removed


def test_trainer_refuses_an_unwritable_checkpoint_folder_before_the_first_step(tmp_path):
    """The trainer calls ``check_writable`` once its engines exist: no step is trained (and lost)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a regular file where the checkpoint folder goes\n")
    proc = torchrun(out, "--trainer.total-steps", "2")
    assert proc.returncode != 0
    assert f"checkpoint folder {out / 'checkpoints'} is not writable" in proc.stderr, proc.stderr[-4000:]
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    assert not any('"step": 1' in line for line in lines), lines


def test_checkpoint_size_estimate_counts_the_model_parameters():
    from transformers import AutoModelForCausalLM

    from spmd_rl.checkpoint import checkpoint_bytes
    from spmd_rl.checkpoint_files import model_parameters
    from spmd_rl.models import resolve_model_path

    folder = resolve_model_path("tiny-random", cache_dir=None)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert model_parameters(folder) == params  # from the safetensors header alone
    assert checkpoint_bytes(params) == 12 * params + 16 * 2**20
    assert checkpoint_bytes(params, hf_copy=True) == 16 * params + 16 * 2**20


def _enospc_body(rank: int, world_size: int, tmp: str) -> dict:
    import logging

    import torch.distributed.checkpoint.filesystem as dcp_fs

    import spmd_rl.checkpoint as checkpoint_module

    warnings: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("spmd_rl").addHandler(Grab())
    comp = _Component()
    ckpt = Checkpointer(checkpoint=CheckpointConfig(every=2, keep=2), output_dir=tmp, total_steps=8,
                        rank_table=TABLE * world_size)
    ckpt.track(actor=comp)
    out: dict = {"first": str(ckpt.save(2))}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    # 1. a periodic save: rank 0's DCP write fails (it alone writes the replicated tensor) -> every
    #    rank goes on (rank 0 warns), step_2 is kept
    real_write_item = dcp_fs._write_item
    if rank == 0:
        dcp_fs._write_item = no_space
    out["periodic"] = _outcome(lambda: ckpt.save(4))
    dcp_fs._write_item = real_write_item
    out["after_periodic"] = sorted(p.name for p in ckpt.root.iterdir())
    out["latest_after_periodic"] = (ckpt.root / "latest").read_text().strip()
    out["next"] = str(ckpt.save(6))  # space again: the next save works
    # 2. the last save: rank 1's RNG file write fails -> every rank raises, step_6 is kept
    real_write_file = checkpoint_module.write_file
    if rank == 1:
        checkpoint_module.write_file = lambda path, text: no_space() if path.name == "rank_1.json" \
            else real_write_file(path, text)
    out["final"] = _outcome(lambda: ckpt.save(8))
    checkpoint_module.write_file = real_write_file
    out["after_final"] = sorted(p.name for p in ckpt.root.iterdir())
    out["latest_after_final"] = (ckpt.root / "latest").read_text().strip()
    out["warnings"] = warnings
    ckpt.close()
    return out


def test_out_of_space_at_save_keeps_the_previous_checkpoint(tmp_path):
    ranks = run_distributed(_enospc_body, 2, str(tmp_path / "run"))
    root = tmp_path / "run" / "checkpoints"
    for rank, out in enumerate(ranks):
        assert out["periodic"] == ("ok", "None"), out["periodic"]  # every rank took the same branch
        assert ".tmp-step_4" not in out["after_periodic"] and "step_4" not in out["after_periodic"], out
        assert out["latest_after_periodic"] == "step_2"
        assert out["next"].endswith("step_6")
        kind, message = out["final"]
        assert kind == "OSError", out["final"]
        for needle in (f"no space left in {root}", "a checkpoint needs about", "free", "removed the partial "
                       ".tmp-step_8", f"kept {root / 'step_6'}", "--trainer.output-dir"):
            assert needle in message, message
        assert ".tmp-step_8" not in out["after_final"] and out["latest_after_final"] == "step_6", out
    warning = "\n".join(ranks[0]["warnings"])
    assert "checkpoint step_4: no space left in" in warning and "Training goes on" in warning, warning
    assert f"kept {root / 'step_2'}" in warning, warning
    assert [p.name for p in list_checkpoints(root)] == ["step_2", "step_6"]


# --------------------------------------------------------------------------- corrupt checkpoints


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A tiny-model run (2 processes, 4 steps) with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("saved") / "run"
    _ok(torchrun(out, "--trainer.total-steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2"))
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_2", "step_4"]
    return out


def _shard(folder: Path, rank: int = 0) -> Path:
    return next(folder.glob(f"__{rank}_*.distcp"))


def _truncate(folder: Path) -> str:
    shard = _shard(folder, 1)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.name


def _zero(folder: Path) -> str:
    _shard(folder).write_bytes(b"")
    return _shard(folder).name


def _no_index(folder: Path) -> str:
    (folder / ".metadata").unlink()
    return ".metadata"


def _garbage(name: str):
    def corrupt(folder: Path) -> str:
        (folder / name).write_text("garbage, not what the save wrote\n")
        return name
    return corrupt


def _overwrite(folder: Path) -> str:
    """Bytes changed in the middle of a shard, size unchanged: DCP loads it without a word."""
    shard = _shard(folder)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    return shard.name


CORRUPTIONS = {
    "truncated shard": _truncate,
    "zero-byte shard": _zero,
    "missing .metadata": _no_index,
    "garbage .metadata": _garbage(".metadata"),
    "garbage meta.json": _garbage("meta.json"),
    "garbage rng file": _garbage("rng/rank_1.json"),
    "bytes overwritten in a shard": _overwrite,
    "garbage manifest": _garbage(MANIFEST),
}
FOUND_WITHOUT_MANIFEST = {"truncated shard", "zero-byte shard", "missing .metadata", "garbage .metadata",
                          "garbage meta.json", "garbage rng file"}


def _corrupt_copy(saved_run: Path, tmp_path: Path, kind: str, manifest: bool = True) -> tuple[Path, str]:
    run = tmp_path / "copy"
    shutil.copytree(saved_run, run, ignore=shutil.ignore_patterns(LOCK))
    step_4 = run / "checkpoints" / "step_4"
    if not manifest:
        (step_4 / MANIFEST).unlink()
    return run, CORRUPTIONS[kind](step_4)


def test_saved_checkpoints_carry_a_manifest(saved_run):
    step_4 = saved_run / "checkpoints" / "step_4"
    files = json.loads((step_4 / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(step_4).as_posix() for p in step_4.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {MANIFEST, "COMPLETE"}, set(files) ^ on_disk
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json", "rng/rank_0.json", "rng/rank_1.json"} \
        <= set(files)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_explicit_resume_of_a_corrupt_checkpoint_names_the_file(saved_run, tmp_path, kind):
    run, bad = _corrupt_copy(saved_run, tmp_path, kind)
    step_4 = run / "checkpoints" / "step_4"
    with pytest.raises(CorruptCheckpoint) as caught:
        Checkpointer(checkpoint=CheckpointConfig(resume=str(step_4)), output_dir=str(tmp_path / "out"),
                     total_steps=6, rank_table=TABLE)
    message = str(caught.value)
    assert f"checkpoint {step_4} is corrupt: {bad}" in message, message
    assert not (tmp_path / "out" / LOCK).read_text(), "the refused run still holds its folder"


@pytest.mark.parametrize("kind", sorted(FOUND_WITHOUT_MANIFEST))
def test_checkpoint_without_manifest_is_still_parsed(saved_run, tmp_path, kind):
    """A checkpoint saved before manifests existed: what a resume parses is still checked, by name."""
    run, bad = _corrupt_copy(saved_run, tmp_path, kind, manifest=False)
    step_4 = run / "checkpoints" / "step_4"
    with pytest.raises(CorruptCheckpoint, match=f"checkpoint {step_4} is corrupt: {bad}"):
        Checkpointer(checkpoint=CheckpointConfig(resume=str(step_4)), output_dir=str(tmp_path / "out"),
                     total_steps=6, rank_table=TABLE)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_auto_resume_falls_back_past_a_corrupt_checkpoint(saved_run, tmp_path, kind, caplog):
    run, bad = _corrupt_copy(saved_run, tmp_path, kind)
    ckpt = Checkpointer(checkpoint=CheckpointConfig(), output_dir=str(run), total_steps=6, rank_table=TABLE)
    ckpt.close()
    assert ckpt.source == run / "checkpoints" / "step_2" and ckpt.start_step == 2
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert f"skipping the corrupt checkpoint {run / 'checkpoints' / 'step_4'}: {bad}" in warnings, warnings
    assert "resuming from step_2, an older checkpoint" in warnings, warnings


def test_auto_resume_with_no_checkpoint_verifying_refuses(saved_run, tmp_path):
    run, _ = _corrupt_copy(saved_run, tmp_path, "zero-byte shard")
    _zero(run / "checkpoints" / "step_2")
    with pytest.raises(CorruptCheckpoint, match=r"no checkpoint in .* verifies: step_4 \(__0_0.distcp: 0 bytes.*"
                                                r"step_2 \(__0_0.distcp.*--checkpoint.resume never"):
        Checkpointer(checkpoint=CheckpointConfig(), output_dir=str(run), total_steps=6, rank_table=TABLE)


def test_torchrun_auto_resume_skips_a_corrupt_checkpoint_and_loads_an_unverified_one(saved_run, tmp_path):
    """The real entry point on 2 processes: step_4 has bytes overwritten inside rank 0's shard (which
    DCP loads silently), step_2 predates manifests. The run warns about both, resumes at step 2 and
    trains steps 3 and 4."""
    run, bad = _corrupt_copy(saved_run, tmp_path, "bytes overwritten in a shard")
    (run / "checkpoints" / "step_2" / MANIFEST).unlink()
    proc = torchrun(run, "--trainer.total-steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2")
    _ok(proc)
    assert f"skipping the corrupt checkpoint {run / 'checkpoints' / 'step_4'}: {bad}: its bytes changed" in proc.stderr
    assert f"{run / 'checkpoints' / 'step_2'} has no {MANIFEST}" in proc.stderr, proc.stderr[-4000:]
    assert "step_2 at step 2" in proc.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step_4" / MANIFEST).is_file()  # re-saved, verified next time


# --------------------------------------------------------------------------- holes: pointer, last save, total steps


def _holes_body(rank: int, world_size: int, tmp: str) -> dict:
    import spmd_rl.checkpoint as checkpoint_module

    table, out = TABLE * world_size, {}
    # 1. the run's last save finds the disk full and there is no earlier checkpoint
    first = Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/first", total_steps=2, rank_table=table)
    first.track(actor=_Component())
    real_write_file = checkpoint_module.write_file

    def no_space(path, text):
        if path.name == "rank_1.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_file(path, text)

    if rank == 1:
        checkpoint_module.write_file = no_space
    out["final"] = _outcome(lambda: first.save(2))
    checkpoint_module.write_file = real_write_file
    first.close()
    # 2. a complete step_4 whose `latest` pointer holds bytes that are no name (not UTF-8, a NUL)
    saver = Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/second", total_steps=4, rank_table=table)
    saver.track(actor=_Component())
    saver.save(4)
    saver.close()
    if rank == 0:
        (Path(tmp) / "second" / "checkpoints" / "latest").write_bytes(b"\xff\xfestep_4\x00\n")
    torch.distributed.barrier()
    try:
        resumed = Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/second", total_steps=6,
                               rank_table=table)
        out["pointer"] = ("ok", str(resumed.source))
        resumed.close()
    except BaseException as e:  # noqa: BLE001
        out["pointer"] = (type(e).__name__, str(e))
    # 3. resuming step_4 with trainer.total_steps 3: refused on every rank, the folder's lock released
    out["below"] = _outcome(lambda: Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/second",
                                                 total_steps=3, rank_table=table))
    torch.distributed.barrier()
    out["relocked"] = _outcome(lambda: Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/second",
                                                    total_steps=4, rank_table=table).close())
    return out


def test_checkpoint_holes_pointer_last_save_and_total_steps(tmp_path, caplog):
    """A full disk at the last save with no earlier checkpoint does not promise a resume from one; a
    ``latest`` pointer of non-UTF-8 bytes is a corrupt pointer (the newest complete step_N is taken,
    a warning says so), not a UnicodeDecodeError; a checkpoint past ``trainer.total_steps`` is refused
    naming both steps and the flags (before: the run exited 0 without a word)."""
    ranks = run_distributed(_holes_body, 2, str(tmp_path))
    for out in ranks:
        kind, message = out["final"]
        assert kind == "OSError", out["final"]
        assert "there is no earlier checkpoint in it" in message, message
        assert "there is no checkpoint to resume from, so it starts over at step 0" in message, message
        assert "resumes from the kept checkpoint" not in message, message
        assert out["pointer"] == ("ok", str(tmp_path / "second" / "checkpoints" / "step_4")), out["pointer"]
        kind, message = out["below"]
        assert kind == "ValueError", out["below"]
        assert f"checkpoint {tmp_path / 'second' / 'checkpoints' / 'step_4'} is at step 4, past " \
               "trainer.total_steps=3: give --trainer.total-steps above 4 to train on, or --checkpoint.resume never" \
               in message, message
        assert out["relocked"] == ("ok", "None"), out["relocked"]


def test_metrics_line_on_a_full_disk_is_not_cut(tmp_path):
    """The disk fills while rank 0 appends a step's line to metrics.jsonl (a file size limit stands in
    for it): the file keeps whole lines only, and the error says which step and what to do."""
    script = f"""
import json, os, resource, signal, sys
sys.path[:0] = [{REPO!r}]
from spmd_rl.config import LoggingConfig
from spmd_rl.metrics import RunSink
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
sink = RunSink(logging_cfg=LoggingConfig(console=False, wandb="off"), output_dir={str(tmp_path)!r}, total_steps=3,
               start_step=0, config_dict={{}})
sink.log({{"a": 1.0}}, 1)
size = os.path.getsize(os.path.join({str(tmp_path)!r}, "metrics.jsonl"))
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))
try:
    sink.log({{f"metric/{{i}}": float(i) for i in range(20)}}, 2)
except OSError as e:
    print("ERROR", e)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=cpu_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" in proc.stdout and "metrics.jsonl: cannot append the line of step 2" in proc.stdout, proc.stdout
    assert "run the same command again" in proc.stdout
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [1] and lines[-1].endswith("\n"), lines


# --------------------------------------------------------------------------- one line per user error


def _one_line(proc) -> str:
    """The run's report: status 2, one ``spmd_rl.train: error:`` line, no traceback."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-5000:]}"
    lines = [line for line in proc.stderr.splitlines() if "spmd_rl.train: error:" in line]
    assert len(lines) == 1, proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    return lines[0]


def test_a_bad_data_file_is_one_line(tmp_path):
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": \n')
    line = _one_line(torchrun(tmp_path / "run", "--data.task", "file", "--data.path", str(bad)))
    assert f"data.jsonl:2: invalid JSON" in line, line


def test_a_used_output_folder_is_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock_output_dir(out)
    try:
        line = _one_line(torchrun(out, "--trainer.total-steps", "1"))
    finally:
        unlock_output_dir(out)
    assert "is in use by another run" in line and f"pid {os.getpid()}" in line, line


def test_a_failing_reward_function_is_one_line(tmp_path):
    line = _one_line(torchrun(tmp_path / "run", "--trainer.total-steps", "2", "--reward.fn",
                              "support.rewards:raises_on_seven"))
    assert "reward.fn=support.rewards:raises_on_seven failed on sample" in line, line


def test_a_corrupt_checkpoint_is_one_line_and_debug_adds_the_traceback(saved_run, tmp_path):
    run, bad = _corrupt_copy(saved_run, tmp_path, "truncated shard")
    line = _one_line(torchrun(run, "--trainer.total-steps", "6", "--checkpoint.resume",
                              str(run / "checkpoints" / "step_4")))
    assert "CorruptCheckpoint" in line and bad in line, line
    proc = torchrun(run, "--trainer.total-steps", "6", "--checkpoint.resume", str(run / "checkpoints" / "step_4"),
                    "--logging.debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr, proc.stderr[-3000:]


def test_total_steps_below_the_checkpoint_is_one_line(saved_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(saved_run, run, ignore=shutil.ignore_patterns(LOCK))
    line = _one_line(torchrun(run, "--trainer.total-steps", "3"))
    assert "is at step 4, past trainer.total_steps=3" in line, line
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_checkpoint_of_another_run_is_one_line(saved_run, tmp_path):
    """Resuming with other prompt data, or with a critic the checkpoint has no state for: one line naming
    what differs and what to do, status 2, on every rank."""
    run = tmp_path / "copy"
    shutil.copytree(saved_run, run, ignore=shutil.ignore_patterns(LOCK))
    line = _one_line(torchrun(run, "--trainer.total-steps", "6", "--data.val-size", "5"))
    assert "CheckpointMismatch" in line and "the prompt data" in line and "--checkpoint.resume never" in line, line
    line = _one_line(torchrun(run, "--trainer.total-steps", "6", "--algo.adv-estimator", "gae"))
    assert "CheckpointMismatch" in line and "has no state for ['critic']" in line, line
