"""Fault injection for the crash-recovery tests, as a user reward function (no product hook).

    KILL_AT_CALL=3 KILL_RANK=1 KILL_MARKER=/tmp/m torchrun --max-restarts 1 -m spmd_rl.train \\
        --reward.fn support.faults:digit_fraction_killed_once ...

Rank ``$KILL_RANK`` SIGKILLs itself on its ``$KILL_AT_CALL``-th scoring call (the step number
when validation is off), unless the marker file ``$KILL_MARKER`` exists; it writes the marker
first, so the job that torchrun restarts runs through. Simulates a crashed process or node.
``digit_fraction_paused_once`` holds a run alive at its first scoring call until a file appears.
``digit_fraction_stopped`` SIGSTOPs a rank mid-step (a frozen process: the stall watchdog), and
``digit_fraction_late_gloo_work`` leaves gloo work for the process's exit (the exit abort).
"""

from __future__ import annotations

import os
import signal

from support.rewards import digit_fraction

_calls = 0


def digit_fraction_killed_once(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    global _calls
    _calls += 1
    marker = os.environ["KILL_MARKER"]
    if (os.environ.get("RANK") == os.environ.get("KILL_RANK", "1") and _calls == int(os.environ["KILL_AT_CALL"])
            and not os.path.exists(marker)):
        with open(marker, "w") as f:
            f.write(f"killed rank {os.environ.get('RANK')} at scoring call {_calls}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_fraction(prompts, completions, **columns)


def digit_fraction_paused_once(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Holds the run at its first scoring call: writes ``$PAUSE_STARTED`` (the run is alive and holds
    its output folder), then waits until ``$PAUSE_GO`` exists (at most 300 s). Run with
    ``--reward.timeout-s 0``. Keeps a run alive while a test starts a second one beside it."""
    import time

    global _calls
    _calls += 1
    if _calls == 1:
        with open(os.environ["PAUSE_STARTED"], "w") as f:
            f.write(f"rank {os.environ.get('RANK')} pid {os.getpid()}\n")
        deadline = time.monotonic() + 300
        while not os.path.exists(os.environ["PAUSE_GO"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    return digit_fraction(prompts, completions, **columns)


def digit_fraction_stopped(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Rank ``$STOP_RANK`` SIGSTOPs itself at its ``$STOP_AT_CALL``-th scoring call (the reward
    stage of that step), after writing its pid to ``$STOP_MARKER``: a frozen process or node."""
    global _calls
    _calls += 1
    if os.environ.get("RANK") == os.environ.get("STOP_RANK", "1") and _calls == int(os.environ["STOP_AT_CALL"]):
        with open(os.environ["STOP_MARKER"], "w") as f:
            f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    return digit_fraction(prompts, completions, **columns)


_KEEP: list = []


class _SlowFinalizer:
    """Keeps the interpreter's finalization going for a while (its ``__del__`` runs when the
    module's globals are cleared, after Python has marked itself finalizing)."""

    def __del__(self, sleep=__import__("time").sleep) -> None:
        sleep(10)


def digit_fraction_late_gloo_work(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """At its ``$FAULT_AT_CALL``-th scoring call (the last step), leaves gloo work for the process's
    exit, as the trainer's own async work can: rank 0 starts an async all_reduce with a Python
    callback held only by gloo's worker thread; rank 1 joins it once rank 0 has run its exit
    handlers (a store key set by an ``atexit`` handler). If rank 0 then finalizes its interpreter
    (kept at it by ``_SlowFinalizer``), the worker thread runs the callback, takes the GIL, is
    ended by ``pthread_exit`` and the process aborts (``terminate called without an active
    exception``, or SIGSEGV): issue 20's exit abort, made deterministic. A process that ends with
    ``os._exit`` after its exit handlers never finalizes."""
    global _calls
    _calls += 1
    if _calls == int(os.environ["FAULT_AT_CALL"]):
        import atexit
        import threading
        import time
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store().clone()  # its own connection
        key = "support.faults/rank0_exiting"
        # A gloo group that destroy_process_group() does not know (it would end the pending work),
        # as a group still referenced after it is; every rank scores as often: all make it here.
        group = dist.ProcessGroupGloo(dist.PrefixStore("support.faults/late", store), dist.get_rank(),
                                      dist.get_world_size(), timedelta(seconds=60))
        _KEEP.append(group)  # its destructor would wait for the pending work
        if dist.get_rank() == 0:
            group.allreduce([torch.zeros(1)]).get_future().then(lambda f: f.value())
            atexit.register(store.set, key, "1")
            _KEEP.append(_SlowFinalizer())
        else:
            def late() -> None:
                try:
                    store.wait([key], timedelta(seconds=120))
                    time.sleep(1.0)
                    group.allreduce([torch.ones(1)]).wait()
                except RuntimeError:  # rank 0 has gone already
                    pass

            # not a daemon (scoring runs in a daemon thread, whose threads are daemons by default): the exit waits
            threading.Thread(target=late, name="late all_reduce", daemon=False).start()
    return digit_fraction(prompts, completions, **columns)


def digit_fraction_signalled(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Rank 0, at its ``$SIGNAL_AT_CALL``-th scoring call (the reward stage of that step, validation
    off), sends ``$SIGNAL_NAME`` (default SIGTERM) to ``$SIGNAL_TARGET``: ``launcher`` (the torchrun
    agent, which forwards it to every worker, as Slurm's stop does), ``group`` (the launcher's process
    group: a Ctrl-C in the terminal), ``slurm`` (``scancel --batch --signal``: the job's batch script)
    or ``self``; once (not when the marker exists); then writes ``$SIGNAL_MARKER``. With ``$SIGNAL_AGAIN_AT_SAVE``
    set, the signal is sent once more from the checkpoint save (a second signal during the save)."""
    global _calls
    _calls += 1
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))  # torchrun's, else srun's
    if (rank == "0" and _calls == int(os.environ["SIGNAL_AT_CALL"])
            and not os.path.exists(os.environ["SIGNAL_MARKER"])):  # once: not again in the resumed run
        _send_signal()
        if os.environ.get("SIGNAL_AGAIN_AT_SAVE"):
            _signal_again_in_the_save()
        with open(os.environ["SIGNAL_MARKER"], "w") as f:
            f.write(f"rank 0 sent {os.environ.get('SIGNAL_NAME', 'SIGTERM')} at scoring call {_calls}\n")
    return digit_fraction(prompts, completions, **columns)


def _send_signal() -> None:
    sig = getattr(signal, os.environ.get("SIGNAL_NAME", "SIGTERM"))
    target = os.environ.get("SIGNAL_TARGET", "launcher")
    if target == "slurm":  # Slurm's early warning to the batch script (as --signal=B:USR1@180 sends it)
        import subprocess

        subprocess.run(["scancel", "--batch", f"--signal={signal.Signals(sig).name[3:]}", os.environ["SLURM_JOB_ID"]],
                       check=True)
    elif target == "group":  # the launcher's process group: what a terminal's Ctrl-C reaches (torchrun's
        os.killpg(os.getpgid(os.getppid()), sig)  # workers have sessions of their own; it forwards the signal)
    else:
        os.kill(os.getppid() if target == "launcher" else os.getpid(), sig)


def _signal_again_in_the_save() -> None:
    """Send the signal again from inside the next checkpoint save, after its DCP files are written
    and before it is published (the save's ``rng_state`` call), at least ``REPEAT_S`` later."""
    import time

    from spmd_rl import checkpoint
    from spmd_rl.distributed.process import REPEAT_S

    original = checkpoint.rng_state

    def rng_state(device):
        time.sleep(REPEAT_S + 0.5)
        _send_signal()
        time.sleep(30)  # ended by the second signal before this returns
        return original(device)

    checkpoint.rng_state = rng_state
