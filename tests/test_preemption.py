"""Stop signals and checkpoints by time: the run saves where it is and stops, and goes on when started again.

* SIGTERM to torchrun (what Slurm sends at a preemption or the time limit) reaches every worker; the
  step in progress ends, every rank saves that step together, rank 0 logs one line, and the run
  started again resumes there with the metrics of an uninterrupted run;
* a signal that reaches one rank only is decided by all ranks together (the checkpointer's all-reduce
  at the step boundary): all save, all stop with status 75;
* a second signal during the save ends the run at once: the half-written folder is never published,
  the newest complete checkpoint stays the one a resume takes;
* SIGINT to the process group (Ctrl-C in the terminal): one line, no traceback from the workers;
* ``checkpoint.every_s``: rank 0's clock decides, every rank saves the same step.

Waits are on files and exit statuses with generous timeouts; no duration is asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.checkpoint import Checkpointer
from spmd_rl.checkpoint_files import LATEST, latest_checkpoint, list_checkpoints
from spmd_rl.config import CheckpointConfig
from spmd_rl.distributed.process import PREEMPTED, Preempted
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed, run_program
from test_checkpoint import UNTIMED
from test_train_e2e import TINY

FAULT = ["--reward.fn", "support.faults:digit_fraction_signalled", "--trainer.total-steps", "4"]
OUR_FRAMES = f'File "{REPO}/spmd_rl'


def torchrun(out_dir: Path, *flags: str, env: dict, timeout: int = 420,
             launcher: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    """torchrun (or ``spmd_rl.torchrun``) with 2 CPU workers in a session of its own, as a terminal
    starts it (SIGNAL_TARGET=group: its process group)."""
    environ = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **env)
    cmd = [sys.executable, "-m", launcher, "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", str(out_dir), *flags]
    proc = subprocess.Popen(cmd, env=environ, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, out)


def metrics(out_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def never(tmp_path: Path) -> dict:
    return {"SIGNAL_AT_CALL": "0", "SIGNAL_MARKER": str(tmp_path / "never")}


def test_sigterm_mid_step_saves_that_step_and_the_resumed_run_matches(tmp_path):
    """SIGTERM to torchrun in step 2's reward stage: step 2 ends, step_2 is saved on both ranks, one
    line says so; the same command started again resumes at step 2 and ends with the metrics of a run
    that was never stopped."""
    reference = torchrun(tmp_path / "reference", *FAULT, env=never(tmp_path))
    assert reference.returncode == 0, reference.stdout[-5000:]
    run, marker = tmp_path / "run", tmp_path / "marker"
    stopped = torchrun(run, *FAULT, env={"SIGNAL_AT_CALL": "2", "SIGNAL_MARKER": str(marker)})
    text = stopped.stdout
    assert marker.is_file(), text[-5000:]
    assert stopped.returncode != 0, text[-5000:]  # torchrun's own status after a signal; the workers' is 75
    root = run / "checkpoints"
    line = f"stopped by SIGTERM after step 2/4: saved {root / 'step_2'}; run the same command again to resume " \
           f"(exit status {PREEMPTED})"
    assert text.count(line) == 1, text[-5000:]
    assert OUR_FRAMES not in text, text[-5000:]  # no worker traceback
    assert [p.name for p in list_checkpoints(root)] == ["step_2"]
    assert (root / LATEST).read_text().strip() == "step_2"
    assert [m["step"] for m in metrics(run)] == [1, 2]
    resumed = torchrun(run, *FAULT, env=never(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"resumed from {root / 'step_2'} at step 2" in resumed.stdout
    assert metrics(run) == metrics(tmp_path / "reference")


def test_second_signal_during_the_save_ends_at_once_and_publishes_nothing(tmp_path):
    """With step_2 saved, SIGTERM in step 3, then SIGTERM again while step 3 is being saved (its DCP
    files written, not yet published): the run ends at once saying so; step_3 never appears,
    ``latest`` still names step_2 and a resume takes it."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    proc = torchrun(run, *FAULT, "--checkpoint.every", "2", "--checkpoint.keep", "3",
                    env={"SIGNAL_AT_CALL": "3", "SIGNAL_AGAIN_AT_SAVE": "1", "SIGNAL_MARKER": str(marker)})
    text = proc.stdout
    assert marker.is_file() and proc.returncode != 0, text[-5000:]
    assert "SIGTERM (a second stop signal): ending now" in text, text[-5000:]
    assert "stopped by SIGTERM after step 3" not in text, text[-5000:]
    root = run / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_2"]
    assert not (root / "step_3").exists()
    assert (root / LATEST).read_text().strip() == "step_2"
    assert latest_checkpoint(root) == root / "step_2"


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "spmd_rl.torchrun"])
def test_sigint_to_the_process_group_saves_with_one_line(tmp_path, launcher):
    """Ctrl-C in a terminal: SIGINT to torchrun's process group; torchrun forwards it to its workers
    (sessions of their own): the step ends, step_2 is saved, one line, no KeyboardInterrupt traceback.
    torchrun adds a traceback of its own; ``spmd_rl.torchrun`` one line instead, status 128 + 2."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    proc = torchrun(run, *FAULT, launcher=launcher, env={"SIGNAL_AT_CALL": "2", "SIGNAL_TARGET": "group",
                                                          "SIGNAL_NAME": "SIGINT", "SIGNAL_MARKER": str(marker)})
    text = proc.stdout
    assert marker.is_file() and proc.returncode != 0, text[-5000:]
    assert text.count("stopped by SIGINT after step 2/4: saved") == 1, text[-5000:]
    assert "KeyboardInterrupt" not in text and OUR_FRAMES not in text, text[-5000:]
    assert "a second stop signal" not in text, text[-5000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_2"]
    if launcher == "spmd_rl.torchrun":
        assert "Traceback" not in text, text[-5000:]
        assert proc.returncode == 128 + signal.SIGINT, text[-5000:]
        assert text.count("spmd_rl.torchrun: SIGINT: forwarded to the workers") == 1, text[-5000:]


def test_a_signal_on_one_rank_stops_every_rank_with_status_75(tmp_path):
    """Only rank 0 receives the signal (ranks forked from this process, no launcher): the ranks decide
    together at the step boundary, both save step 2 and end with status 75."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    proc = run_program("spmd_rl.train", [*TINY, "--trainer.output-dir", str(run), *FAULT], nproc=2, cwd=REPO,
                       env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", SIGNAL_AT_CALL="2",
                                SIGNAL_TARGET="self", SIGNAL_MARKER=str(marker)), timeout=420)
    assert marker.is_file()
    assert proc.returncode == PREEMPTED, proc.stderr[-5000:]
    assert proc.stderr.count("stopped by SIGTERM after step 2/4: saved") == 1, proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_2"]
    assert [m["step"] for m in metrics(run)] == [1, 2]


# --------------------------------------------------------------------------- the checkpointer's decision


class _Component:
    def __init__(self) -> None:
        self.x = torch.arange(4.0)

    def state_dict(self) -> dict:
        return {"x": self.x}

    def load_state_dict(self, state: dict) -> None:
        self.x.copy_(state["x"])


def _every_s_body(rank: int, world_size: int, tmp: str) -> dict:
    """Rank 0's clock runs 10 s per step, the others' stands still; every_s=25: steps 3 and 6 save
    on every rank. Then rank 1 alone gets a stop signal: both save step 7 and raise Preempted."""
    from spmd_rl.distributed import process

    now = [0.0]
    ckpt = Checkpointer(checkpoint=CheckpointConfig(every_s=25.0, keep=10, save_final=False), output_dir=tmp,
                        total_steps=10, rank_table=[{"rank": r} for r in range(world_size)])
    ckpt.clock = lambda: now[0]
    ckpt._last_save_at = 0.0
    ckpt.track(actor=_Component())
    saved = []
    for step in range(1, 7):
        if rank == 0:
            now[0] += 10.0
        if ckpt.maybe_save(step) is not None:
            saved.append(step)
    timing = ckpt.pop_timing()
    if rank == 1:
        process._STOP.signum = signal.SIGUSR1  # as the watcher thread records it
    try:
        ckpt.maybe_save(7)
        stopped = None
    except Preempted as e:
        stopped = (e.step, e.checkpoint, str(e))
    ckpt.close()
    return {"saved": saved, "timing": sorted(timing), "stopped": stopped}


def test_every_s_saves_the_same_step_on_every_rank_and_a_signal_on_one_rank_stops_all(tmp_path):
    ranks = run_distributed(_every_s_body, 2, str(tmp_path / "run"))
    root = tmp_path / "run" / "checkpoints"
    for out in ranks:
        assert out["saved"] == [3, 6], ranks  # 30 s and 60 s on rank 0's clock
        step, folder, message = out["stopped"]
        assert step == 7 and folder == str(root / "step_7"), out
        assert "stopped by SIGUSR1 after step 7/10" in message and f"exit status {PREEMPTED}" in message
    assert ranks[0]["timing"] == ["timing_s/checkpoint"]
    assert [p.name for p in list_checkpoints(root)] == ["step_3", "step_6", "step_7"]


def test_every_s_run_saves_by_time_and_logs_the_save_time(tmp_path):
    """The real program with a tiny interval: every step is saved (same step on both ranks: one
    folder per step, each complete), and the step after a save logs ``timing_s/checkpoint``."""
    run = tmp_path / "run"
    proc = run_program("spmd_rl.train", [*TINY, "--trainer.output-dir", str(run), "--trainer.total-steps", "3",
                                         "--checkpoint.every-s", "0.001", "--checkpoint.keep", "5",
                                         "--checkpoint.no-save-final"],
                       nproc=2, cwd=REPO, env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1"),
                       timeout=420)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_1", "step_2", "step_3"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "timing_s/checkpoint" not in rows[0] and all(row["timing_s/checkpoint"] > 0 for row in rows[1:]), rows


# --------------------------------------------------------------------------- the sbatch scripts' requeue


@pytest.mark.parametrize("script", ["grpo.sbatch", "grpo_srun.sbatch"])
def test_sbatch_forwards_the_early_warning_and_requeues(tmp_path, script):
    """The batch script gets Slurm's USR1 (``--signal=B:USR1@180``): it forwards it to srun and, when
    srun ends, requeues the job. ``srun`` and ``scontrol`` are stand-ins here (tests/test_slurm.py runs
    the scripts on a real Slurm); the stand-in srun ends with 75 on USR1, as the trainer does."""
    bin_dir, log, started = tmp_path / "bin", tmp_path / "calls", tmp_path / "started"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"""#!/usr/bin/env bash
trap 'echo "srun got USR1" >> {log}; exit {PREEMPTED}' USR1
echo "srun $*" >> {log}
touch {started}
for _ in $(seq 3000); do sleep 0.1; done
exit 1
""")
    (bin_dir / "scontrol").write_text(f"""#!/usr/bin/env bash
if [[ $1 == show ]]; then echo localhost; else echo "scontrol $*" >> {log}; fi
""")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_CPUS_ON_NODE": "2",
           "NPROC_PER_NODE": "2"}
    proc = subprocess.Popen(["bash", os.path.join(REPO, "slurm", script), "--trainer.total-steps", "3"], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    calls = log.read_text()
    assert "srun got USR1" in calls and "scontrol requeue 4242" in calls, calls + out
    assert proc.returncode == PREEMPTED, out
    assert "requeued, it resumes from it" in out, out
    if script == "grpo.sbatch":
        assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 170" in calls, calls


def test_spmd_rl_torchrun_passes_a_user_error_status_through(tmp_path):
    """Under ``spmd_rl.torchrun`` a user error is the trainer's one line, torchrun's one line and status 2
    (plain torchrun: 1 and its ChildFailedError traceback)."""
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": \n')
    proc = torchrun(tmp_path / "run", "--data.task", "file", "--data.path", str(bad), env={},
                    launcher="spmd_rl.torchrun")
    assert proc.returncode == 2, proc.stdout[-5000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-5000:]
    assert proc.stdout.count("spmd_rl.train: error: ") == 1, proc.stdout[-5000:]
    assert "spmd_rl.torchrun: worker rank" in proc.stdout and "exited with status 2 (a user error" in proc.stdout
