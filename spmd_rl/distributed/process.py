"""How a trainer process starts and ends under a launcher (torchrun, srun).

    parent = os.getppid()                    # first thing the entry module does
    die_with_parent(parent)                  # torchrun's agent killed -9: the workers get SIGTERM
    exit_now(run_entry(main, argv))          # main's status; torchrun's error file on an exception

**Why the process ends with ``os._exit``.** A gloo process group runs worker threads
(``ProcessGroupGloo::runLoop``). ``destroy_process_group()`` unregisters the groups, but a group's
threads are only joined when its C++ object is destroyed, i.e. when Python drops its last
reference, and the trainer, the pools, the meshes, module-level caches and any traceback keep
them. Such a thread can drop the last reference to a Python tensor (a finished work's outputs)
while the main thread finalizes the interpreter; it then takes the GIL, CPython ends it with
``pthread_exit``, the unwind meets a ``noexcept`` frame and the process aborts (``terminate called
without an active exception``, SIGABRT, in some runs under load, successful ones included), and
torchrun reports the abort as the root cause. Dropping every reference and joining the threads
is not robust: references hide (caches, DeviceMesh registries, frames), and on an error path a
group's destructor waits for its in-flight collective, which a dead peer never completes. So the
process never finalizes: :func:`exit_now` does what the interpreter's exit does that matters
(``threading._shutdown``: run ``threading`` exit hooks and join non-daemon Python threads;
``atexit`` handlers: logging, wandb, multiprocessing children, compile workers; flush stdout and
stderr), then ``os._exit(code)``, which ends every thread at once with the status unchanged.

**torchrun's root cause.** :func:`run_entry` runs ``main`` under torchrun's ``record`` decorator:
an exception writes ``$TORCHELASTIC_ERROR_FILE`` (message, traceback, time), and torchrun's summary
shows the first failure by that time, so the rank's real error is the root cause rather than a
rank torchrun stopped. A rank that only fails because another one did (``RankFailure`` from
``fail_together``) dates its file a second later (the times are whole seconds), so that the rank
where the error happened is the root cause. The traceback is printed as Python would, status 1.

**Stop signals.** :func:`catch_stop_signals` turns SIGTERM, SIGINT (and e.g. SIGUSR1, Slurm's early
warning) into a request: the process goes on to the next step boundary, where the checkpointer
decides with the other ranks to save and stop (:class:`Preempted`, exit status :data:`PREEMPTED`).
The signals are read by a daemon thread through Python's wakeup fd, so they are seen even while the
main thread blocks in a collective. Copies of one signal that arrive together (SIGINT from the
terminal reaches every process of the group, and torchrun forwards its own copy) count once; a
signal :data:`REPEAT_S` or more after the first ends the process at once (status 128 + signal),
which leaves at most a ``.tmp-`` folder that no resume reads. A signal after the launcher died
(``die_with_parent``'s SIGTERM) ends the process at once too.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn

PR_SET_PDEATHSIG = 1
PREEMPTED = 75
"""Exit status of a run stopped by a signal after it saved its checkpoint (sysexits' EX_TEMPFAIL:
run the same command again and it resumes); slurm/*.sbatch requeue the job on it."""
USER_ERROR = 2
"""Exit status of an expected user error (configuration, data, reward function, output folder,
checkpoint): one line, no traceback unless ``logging.debug``."""
REPEAT_S = 1.0
"""A stop signal this long after the first is a second request, which ends the process at once."""


class Preempted(Exception):
    """The run stopped on a signal at a step boundary, after saving (``checkpoint`` None: nothing
    to save). Every rank raises it together; the entry point ends with :data:`PREEMPTED`."""

    def __init__(self, message: str, *, signum: int, step: int, checkpoint: str | None) -> None:
        super().__init__(message)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class _StopSignals:
    """The process's stop requests (see the module docstring): the first signal and when it came."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.first_at = 0.0
        self.parent_pid: int | None = None
        self.signals: tuple[int, ...] = ()
        self.reader: socket.socket | None = None
        self.pid = 0  # the process whose watcher thread reads ``reader`` (a forked child starts its own)

    def received(self, signum: int) -> None:
        now = time.monotonic()
        if self.parent_pid is not None and os.getppid() != self.parent_pid:  # the launcher is gone
            _end_at_once(signum, "its launcher died")
        if self.signum is None:
            self.signum, self.first_at = signum, now
        elif now - self.first_at >= REPEAT_S:
            _end_at_once(signum, "a second stop signal")

    def watch(self) -> None:
        while True:
            try:
                data = self.reader.recv(64)  # type: ignore[union-attr]
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.signals:
                    self.received(signum)


_STOP = _StopSignals()


def _end_at_once(signum: int, why: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        name = signal.Signals(signum).name
        os.write(2, f"spmd_rl: {name} ({why}): ending now; a checkpoint being written is left unpublished and "
                    "the newest complete one is kept\n".encode())
    exit_now(128 + signum, run_exit_handlers=False)


def signal_number(name: str | int) -> int:
    """``"SIGUSR1"``, ``"USR1"`` or ``10`` -> the signal's number; ValueError naming the choices."""
    if isinstance(name, int) or str(name).isdigit():
        return int(name)
    text = str(name).upper()
    text = text if text.startswith("SIG") else "SIG" + text
    try:
        return int(signal.Signals[text])
    except KeyError:
        raise ValueError(f"unknown signal {name!r}; e.g. SIGUSR1, SIGUSR2, SIGHUP") from None


def catch_stop_signals(names: tuple[str, ...] = ("SIGTERM", "SIGINT"), *, parent_pid: int | None = None) -> bool:
    """From now on the signals ``names`` request a stop at the next step boundary instead of ending
    the process (module docstring). Main thread only; ``parent_pid``: the launcher, whose death makes
    a signal end the process at once. False when not in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _STOP.parent_pid = parent_pid
    _STOP.signals = tuple(sorted({signal_number(n) for n in names}))
    if _STOP.reader is None or _STOP.pid != os.getpid():
        _STOP.pid, _STOP.signum = os.getpid(), None
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        _STOP.reader, _STOP._writer = reader, writer  # type: ignore[attr-defined]
        threading.Thread(target=_STOP.watch, name="spmd_rl stop signals", daemon=True).start()
    for signum in _STOP.signals:
        signal.signal(signum, _on_signal)
    return True


def _on_signal(signum: int, frame: object) -> None:
    """The Python-level handler (main thread, late when it is blocked): the watcher thread acts on
    the signal through the wakeup fd; only if a library replaced that fd does the handler record it."""
    ours = _STOP._writer.fileno()  # type: ignore[attr-defined]
    current = signal.set_wakeup_fd(ours, warn_on_full_buffer=False)
    if current != ours:
        signal.set_wakeup_fd(current)  # theirs stays; this signal never reached the watcher
        _STOP.received(signum)


def stop_signal() -> int | None:
    """The first stop signal this process received, or None."""
    return _STOP.signum


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux ``prctl``).

    Under torchrun the parent is the agent; a ``kill -9`` of it would otherwise leave the workers
    running unsupervised (holding GPUs, blocked in collectives). ``parent_pid``: the parent seen
    at start; if it is gone already (it died between the fork and this call, and the process was
    reparented), ``sig`` comes now. The signal follows the death of the *thread* that forked us,
    which is the agent's main thread under torchrun. True when set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def write_error_file(message: str, callstack: str = "") -> None:
    """torchrun's error file (``$TORCHELASTIC_ERROR_FILE``), in the format of its ``record``
    decorator, unless one was written already (the first error is the root cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack or message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def run_entry(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """``main(argv)``'s exit status: its return value (None = 0), a ``SystemExit``'s code, or 1
    after an exception, whose traceback is printed and (under torchrun) written to the error file."""
    entry = main
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under torchrun: the error file names the root cause
        from torch.distributed.elastic.multiprocessing.errors import record

        entry = record(main)
    try:
        code = entry(argv)
    except SystemExit as e:
        code = e.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    except Preempted:
        code = PREEMPTED  # its one line was logged where it was decided
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException as e:  # noqa: BLE001 - printed as Python would, then the process ends with 1
        if _STOP.signum is not None:  # told to stop (by the launcher: another rank failed, or the job ends)
            _stopped_by_signal(e)
            return 128 + _STOP.signum
        traceback.print_exc()
        code = 1
        from spmd_rl.distributed.comm import RankFailure

        if isinstance(e, RankFailure):
            _date_error_file_later()
    # The exception and its frames (trainer, groups) are released here; nothing is collected on
    # purpose: see the module docstring.
    return 0 if code is None else int(code)


def _stopped_by_signal(error: BaseException) -> None:
    """A rank that failed after a stop signal (its peers ended, or the launcher stops the job): one line
    from rank 0, no traceback; the rank whose failure made the launcher stop the job printed its own."""
    if os.environ.get("RANK", "0") == "0":
        first = (str(error).strip().splitlines() or [""])[0][:300]
        print(f"spmd_rl: stopped by {signal.Signals(_STOP.signum).name} (the job is stopping) while running: "  # type: ignore[arg-type]
              f"{type(error).__name__}: {first}", file=sys.stderr, flush=True)


def _date_error_file_later(seconds: int = 1) -> None:
    """Move the error file's time ``seconds`` later: this rank's failure is a consequence."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    try:
        with open(path) as f:  # type: ignore[arg-type]
            data = json.load(f)
        info = data["message"]["extraInfo"]
        info["timestamp"] = str(int(info["timestamp"]) + seconds)
        with open(path, "w") as f:  # type: ignore[arg-type]
            json.dump(data, f)
    except (TypeError, OSError, ValueError, KeyError):
        pass


def exit_now(code: int, *, run_exit_handlers: bool = True) -> NoReturn:
    """End the process with ``code`` without finalizing the interpreter (module docstring).

    ``run_exit_handlers``: first join non-daemon Python threads and run the ``atexit`` handlers,
    as a normal exit would; False from a thread other than the main one (the watchdog ends a
    process whose main thread is stuck), which only flushes the logs."""
    if run_exit_handlers:
        shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize runs first
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            try:
                shutdown()
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
        atexit._run_exitfuncs()  # prints, and does not raise, a handler's exception
    else:
        for logger in (logging.getLogger(), logging.getLogger("spmd_rl")):
            for handler in logger.handlers:
                try:
                    handler.flush()
                except Exception:  # noqa: BLE001
                    pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
