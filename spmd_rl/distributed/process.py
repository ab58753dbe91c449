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
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn

PR_SET_PDEATHSIG = 1


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
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException as e:  # noqa: BLE001 - printed as Python would, then the process ends with 1
        traceback.print_exc()
        code = 1
        from spmd_rl.distributed.comm import RankFailure

        if isinstance(e, RankFailure):
            _date_error_file_later()
    # The exception and its frames (trainer, groups) are released here; nothing is collected on
    # purpose: see the module docstring.
    return 0 if code is None else int(code)


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
