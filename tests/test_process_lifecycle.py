"""Nothing lost, nothing hangs (issue 20): how a run's processes end.

* The stall watchdog (spmd_rl/distributed/watchdog.py) in-process over a HashStore: a silent rank,
  a rank alive elsewhere, a rank that has exited, and a long stage on every rank (no stall).
* Under torchrun (2 CPU processes, the tiny model):
  - exit: gloo work left for the process's exit (``support.faults:digit_fraction_late_gloo_work``)
    used to abort rank 0 in interpreter finalization (SIGABRT / SIGSEGV); the run exits 0;
  - stall: rank 1 SIGSTOPped in the reward stage: every process ends within seconds of the stall
    timeout (the watchdog SIGKILLs the stopped sibling: torchrun's 30 s SIGTERM grace is not waited
    for) and the output names rank 1 and its stage and step;
  - a ``kill -9`` of the torchrun agent ends its workers (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from conftest import HERE, REPO
from spmd_rl.distributed.testing import cpu_env, free_port
from spmd_rl.distributed.watchdog import Watchdog, format_ranks
from test_train_e2e import TINY


# --------------------------------------------------------------------------- the watchdog, in-process


class Ranks:
    """Watchdogs of a world over one HashStore; each records the message that would end its run."""

    def __init__(self, world: int, stall_timeout_s: float = 0.6) -> None:
        self.store = dist.HashStore()
        self.messages: dict[int, str] = {}
        self.wds = [Watchdog(self.store, r, world, stall_timeout_s, poll_s=0.1, host="h",
                             on_stall=lambda m, r=r: self.messages.setdefault(r, m)) for r in range(world)]
        for wd in self.wds:
            wd.start()

    def freeze(self, rank: int) -> None:
        """As SIGSTOP would: the rank's thread stops beating; its keys stay as they were."""
        wd = self.wds[rank]
        wd._stopped.set()
        wd._thread.join()

    def wait(self, rank: int, timeout: float = 10.0) -> str | None:
        deadline = time.monotonic() + timeout
        while rank not in self.messages and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.messages.get(rank)

    def close(self) -> None:
        for wd in self.wds:
            wd._stopped.set()


def test_watchdog_names_a_silent_rank_and_its_stage():
    ranks = Ranks(3)
    try:
        for wd in ranks.wds:
            wd.beat(4, "gen")
        ranks.freeze(2)
        ranks.wds[0].beat(4, "update")
        ranks.wds[1].beat(4, "update")
        message = ranks.wait(0)
        assert message is not None, "no stall reported"
        assert message.startswith("stall: rank 0 has been in stage 'update' of step 4 for "), message
        assert "rank 2's last heartbeat was " in message and "in stage 'gen' of step 4" in message, message
        assert "it stopped, froze or died (pid" in message and "rank 1" not in message, message
        assert ranks.wait(1) is not None  # every live rank ends its run
        assert 2 not in ranks.messages
    finally:
        ranks.close()


def test_watchdog_names_a_rank_alive_behind_and_one_that_left():
    ranks = Ranks(3)
    try:
        for wd in ranks.wds[:2]:
            wd.beat(7, "reward")
        ranks.wds[0].beat(7, "relayout")  # waits for rank 1, which hangs in (or is slow at) the reward stage
        ranks.wds[2].stop()  # its loop ended
        message = ranks.wait(0)
        assert message is not None
        assert "rank 1 is alive but still in stage 'reward' of step 7" in message, message
        assert "rank 2 has exited" in message, message
    finally:
        ranks.close()


def test_watchdog_names_what_a_rank_waits_on(caplog):
    """A rank hung in an environment's step: the report of the rank that waits for it names the call
    and its row (Watchdog.describe), and so does the hung rank's own warning."""
    ranks = Ranks(2, stall_timeout_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="spmd_rl"):
            ranks.wds[1].describe(lambda: "waits for Hangs.step on the row {'id': 3} (running 9 s)")
            for wd in ranks.wds:
                wd.beat(5, "gen")
            ranks.wds[0].beat(5, "old_logprob")
            message = ranks.wait(0)
            wait_for_log(caplog, "slow stage: rank 1")
        assert message is not None
        assert "rank 1 is alive but still in stage 'gen' of step 5" in message, message
        assert "rank 1 waits for Hangs.step on the row {'id': 3} (running 9 s)" in message, message
        assert "slow stage: rank 1 has been in stage 'gen' of step 5 for " in caplog.text
        assert "(waits for Hangs.step on the row {'id': 3} (running 9 s))" in caplog.text
    finally:
        ranks.close()


def wait_for_log(caplog, text: str, timeout_s: float = 10.0) -> None:
    """Until ``text`` is logged (the watchdog's thread logs it), at most ``timeout_s``; the caller asserts."""
    deadline = time.monotonic() + timeout_s
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)


def test_watchdog_lets_the_rank_behind_work(caplog):
    """A rank still at a long stage while the others went on: a warning on it, no stall."""
    ranks = Ranks(2, stall_timeout_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="spmd_rl"):
            for wd in ranks.wds:
                wd.beat(2, "gen")
            ranks.wds[1].beat(2, "reward")
            wait_for_log(caplog, "went on and wait for this rank")
        assert "slow stage: rank 0 has been in stage 'gen' of step 2" in caplog.text
        assert "rank 1 went on and wait for this rank" in caplog.text
        assert 0 not in ranks.messages
    finally:
        ranks.close()


def test_watchdog_lets_a_long_stage_run(caplog):
    """Every rank alive in the same stage: a warning, the run goes on."""
    ranks = Ranks(2, stall_timeout_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="spmd_rl"):
            for wd in ranks.wds:
                wd.beat(1, "gen")
            wait_for_log(caplog, "every rank is alive")
        assert ranks.messages == {}
        assert "every rank is alive and in this stage" in caplog.text
        with ranks.wds[0].stage("update", 1):  # a stage ends: "after update", the clock restarts
            pass
        assert ranks.wds[0]._state[1] == "after update"
    finally:
        ranks.close()


def test_kill_sibling_ends_only_a_worker_of_the_same_parent():
    """What the watchdog does to a silent rank on its host: SIGKILL, only where the pid is a child of
    its own parent (a worker of the same launcher agent), never a reused pid or another's process."""
    from spmd_rl.distributed.watchdog import _kill_sibling

    sibling = subprocess.Popen(["sleep", "60"])  # a child of this process, as a rank is of torchrun
    try:
        assert not _kill_sibling(sibling.pid)  # not a sibling of this process: left alone
        assert sibling.poll() is None
        child = os.fork()
        if child == 0:  # a sibling of `sleep`: the same parent
            os._exit(0 if _kill_sibling(sibling.pid) else 1)
        assert os.waitpid(child, 0)[1] == 0
        assert sibling.wait(timeout=10) == -signal.SIGKILL
    finally:
        if sibling.poll() is None:
            sibling.kill()


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"


# --------------------------------------------------------------------------- exit status, torchrun's error file


def test_run_entry_status_and_error_file(tmp_path, monkeypatch, capsys):
    """main's status; an exception: traceback printed, status 1, torchrun's error file written, and
    dated a second later when the rank only failed because another one did (RankFailure)."""
    import faulthandler
    import json

    from spmd_rl.distributed.comm import RankFailure
    from spmd_rl.distributed.process import run_entry

    monkeypatch.setattr(faulthandler, "enable", lambda **kw: None)  # record() would re-point pytest's
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    def fails(exc: BaseException):
        def main(argv):
            raise exc
        return main

    assert run_entry(lambda argv: 2) == 2
    assert run_entry(lambda argv: None) == 0
    assert run_entry(fails(SystemExit(0))) == 0
    assert run_entry(fails(SystemExit(3))) == 3
    assert not error_file.exists()
    assert run_entry(fails(ArithmeticError("scorer exploded"))) == 1
    assert "ArithmeticError: scorer exploded" in capsys.readouterr().err
    own = json.loads(error_file.read_text())["message"]
    assert own["message"] == "ArithmeticError: scorer exploded" and "Traceback" in own["extraInfo"]["py_callstack"]
    error_file.unlink()
    now = int(time.time())
    assert run_entry(fails(RankFailure("reward scoring failed on 1 rank(s): ..."))) == 1
    later = int(json.loads(error_file.read_text())["message"]["extraInfo"]["timestamp"])
    assert now + 1 <= later <= int(time.time()) + 1


# --------------------------------------------------------------------------- under torchrun

ONE_STEP = ["--trainer.total-steps", "1", "--data.val-size", "0", "--checkpoint.no-save-final"]


def start(out_dir: str, *flags: str, env: dict | None = None, log_path: str) -> subprocess.Popen:
    environ = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", out_dir, *flags]
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=environ, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    finally:
        log.close()


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def kill_all(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(path, proc: subprocess.Popen, log_path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path}:\n" + open(log_path).read()[-5000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.2)


def test_gloo_work_left_at_exit_does_not_abort(tmp_path):
    """Gloo work that completes while the process exits: before, rank 0 finalized its interpreter
    and the worker thread aborted it (SIGABRT or SIGSEGV, torchrun: FAILED); now the run exits 0."""
    log_path = str(tmp_path / "log")
    proc = start(str(tmp_path / "run"), *ONE_STEP, "--reward.fn", "support.faults:digit_fraction_late_gloo_work",
                 env={"FAULT_AT_CALL": "1"}, log_path=log_path)
    try:
        proc.wait(timeout=300)
    finally:
        kill_all(proc, [])
    text = open(log_path).read()
    assert "terminate called" not in text and "SIGABRT" not in text and "SIGSEGV" not in text, text[-5000:]
    assert proc.returncode == 0, text[-5000:]


def test_stopped_rank_ends_the_run_naming_it(tmp_path):
    """Rank 1 SIGSTOPs itself in the reward stage of step 2; with a 10 s stall timeout rank 0's
    watchdog kills the stopped rank (no waiting out torchrun's 30 s SIGTERM grace), every process is
    gone, and the output says which rank stopped, where."""
    marker, log_path = tmp_path / "stopped", str(tmp_path / "log")
    proc = start(str(tmp_path / "run"), "--trainer.total-steps", "4", "--trainer.stall-timeout-s", "10",
                 "--reward.fn", "support.faults:digit_fraction_stopped", log_path=log_path,
                 env={"STOP_AT_CALL": "2", "STOP_RANK": "1", "STOP_MARKER": str(marker)})
    stopped = []
    try:
        wait_for(marker, proc, log_path)
        stopped.append(int(marker.read_text()))
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("still running 120 s after rank 1 stopped:\n" + open(log_path).read()[-5000:])
        text = open(log_path).read()
        assert proc.returncode != 0
        # the watchdog ends the silent rank itself (SIGKILL), rather than leaving it to torchrun's
        # SIGTERM-then-30-s-SIGKILL: read from the log, not from the clock
        assert "sent SIGKILL to silent rank 1" in text, text[-5000:]
        assert not alive(stopped[0]), "the stopped rank outlived the run"
        assert "stall: rank 0 has been in stage " in text and "of step 2" in text, text[-5000:]
        assert "rank 1's last heartbeat was" in text and "in stage 'reward' of step 2" in text, text[-5000:]
        assert "Timed out waiting" not in text
    finally:
        kill_all(proc, stopped)


def test_killed_launcher_ends_its_workers(tmp_path):
    """``kill -9`` of the torchrun agent: its workers (held at their first scoring call) end too."""
    started, go, log_path = tmp_path / "started", tmp_path / "go", str(tmp_path / "log")
    proc = start(str(tmp_path / "run"), *ONE_STEP, "--reward.fn", "support.faults:digit_fraction_paused_once",
                 "--reward.timeout-s", "0", log_path=log_path, env={"PAUSE_STARTED": str(started), "PAUSE_GO": str(go)})
    workers: list[int] = []
    try:
        wait_for(started, proc, log_path)
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [w for w in workers if alive(w)]
        assert not left, f"workers {left} still run 10 s after their torchrun agent was killed"
    finally:
        go.write_text("go")
        kill_all(proc, workers)


# --------------------------------------------------------------------------- stop signals


STOP_SCRIPT = """
import os, signal, socket, sys, time
sys.path.insert(0, {repo!r})
from spmd_rl.distributed import process
process.catch_stop_signals(("SIGTERM", "SIGINT", "SIGUSR1"))
if {replace_fd!r}:  # a library takes the wakeup fd: the handler records the signal itself
    a, b = socket.socketpair(); b.setblocking(False); signal.set_wakeup_fd(b.fileno())
process.REPEAT_S = 5.0  # the copy below comes within it, however late a busy machine runs the watcher
os.kill(os.getpid(), signal.SIGUSR1)
deadline = time.monotonic() + 30
while process.stop_signal() is None and time.monotonic() < deadline:
    time.sleep(0.01)
print("first", process.stop_signal(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # a copy within REPEAT_S: the same request
time.sleep(0.3)
print("after a copy", process.stop_signal(), flush=True)
time.sleep(process.REPEAT_S)
os.kill(os.getpid(), signal.SIGTERM)  # a second request: ends the process at once
time.sleep(30)
print("still running", flush=True)
"""


@pytest.mark.parametrize("replace_fd", [False, True])
def test_stop_signals_are_recorded_once_and_a_second_one_ends_the_process(replace_fd):
    proc = subprocess.run([sys.executable, "-c", STOP_SCRIPT.format(repo=REPO, replace_fd=replace_fd)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == [f"first {int(signal.SIGUSR1)}", f"after a copy {int(signal.SIGUSR1)}"], \
        proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.strip() == ("spmd_rl: SIGTERM (a second stop signal): ending now; a checkpoint being written "
                                   "is left unpublished and the newest complete one is kept"), proc.stderr
