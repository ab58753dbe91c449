"""Rank 0's status line: what a run is doing from its first second, on a clock that ticks.

    status = console.start()                      # spmd_rl.train, before torch is imported
    console.phase("loading the model")            # from anywhere; a no-op where no line is shown
    bar = status.steps(total=40, initial=0)       # the step bar (RunSink), the same line
    console.close()

One line on stderr, a tqdm bar: ``grpo: loading the model [00:03]`` while the run starts (the clock
counts from the process's start), then ``grpo: 3/40 |███| 00:41, reward=... eta=0:02:10`` per
step. A thread redraws it every second on a terminal, so the clock ticks while a phase takes long
(every ``PIPE_INTERVAL_S`` seconds into a file or a pipe until the first step ends, then only on
news, so logs do not fill up). Log lines go above it (:class:`spmd_rl.metrics.BarSafeHandler`).
Phases come from ``spmd_rl.train`` (importing torch, joining the world), the models (resolving,
dequantising, loading weights) and the trainer (engines, the first validation, the first step).
Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

NAME = "grpo"
"""The line's name (the step bar's description)."""
PIPE_INTERVAL_S = 10.0
"""How often the clock is redrawn when stderr is not a terminal (until the first step ends)."""
STARTUP_FORMAT = NAME + ": {desc} [{elapsed}]"
STEPS_FORMAT = NAME + ": {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}"


def process_start_time() -> float:
    """When this process started (Linux: from ``/proc/self/stat``), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class Status:
    """The status line (see the module docstring). ``interval``: seconds between redraws (None: 1 s on a
    terminal, :data:`PIPE_INTERVAL_S` otherwise)."""

    def __init__(self, *, file: TextIO | None = None, interval: float | None = None,
                 start_time: float | None = None) -> None:
        from tqdm import tqdm

        self.file = file or sys.stderr
        tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (1.0 if tty else PIPE_INTERVAL_S)
        self.tick_after_first_step = tty
        self.bar: Any = tqdm(total=None, desc="starting", bar_format=STARTUP_FORMAT, file=self.file,
                             dynamic_ncols=True, mininterval=0, leave=True, delay=1e-9)  # drawn below, clock set
        self.bar.start_t = process_start_time() if start_time is None else start_time
        self.bar.refresh()
        self.stepping = False
        self._stop = threading.Event()
        self._ticking = True
        self._thread = threading.Thread(target=self._tick, name="spmd_rl-status", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            if self._ticking:
                try:
                    self.bar.refresh()
                except Exception:  # a closed stream at exit: nothing left to show
                    return

    def phase(self, text: str) -> None:
        """Say what the run is doing now (before the steps: the line's text; during them: after the count)."""
        if self.stepping:
            self.bar.set_postfix_str(text, refresh=True)
        else:
            self.bar.set_description_str(text, refresh=True)

    def steps(self, total: int, initial: int) -> Any:
        """Turn the line into the step bar (``initial`` of ``total`` done); returns the tqdm bar."""
        if not self.stepping:  # not tqdm's reset(): its clock would restart at 0 (it counts from the process's start)
            self.bar.total = total
            self.bar.bar_format = STEPS_FORMAT
            self.bar.set_description_str(NAME, refresh=False)
            self.bar.set_postfix_str("", refresh=False)
            self.bar.n = self.bar.last_print_n = initial
            self.stepping = True
            self.bar.refresh()
        return self.bar

    def first_step_done(self) -> None:
        """Into a file or a pipe the clock is redrawn only until the first step ends."""
        self._ticking = self.tick_after_first_step

    def close(self, *, clear: bool = False) -> None:
        """Stop the clock; ``clear`` erases the line (``logging.console`` off) instead of leaving its last frame."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self.bar.leave = not clear
        self.bar.close()


_current: Status | None = None


def start(**kwargs: Any) -> Status:
    """Show the status line of this process (rank 0's) on ``file`` (default: stderr), or return the one
    shown there already; the one :func:`phase` reports to. One left on another stream (a run that
    ended without closing it, stderr replaced since) is closed first."""
    global _current
    if _current is not None and _current.file is not (kwargs.get("file") or sys.stderr):
        close()
    if _current is None:
        _current = Status(**kwargs)
    return _current


def current() -> Status | None:
    return _current


def phase(text: str) -> None:
    """Report what the run is doing now to the status line, if this process shows one."""
    if _current is not None:
        _current.phase(text)


def close(*, clear: bool = False) -> None:
    """End the status line (at the end of the run, or before an error is printed; ``clear``: erase it)."""
    global _current
    if _current is not None:
        status, _current = _current, None
        status.close(clear=clear)


def main_rank() -> bool:
    """Whether this process is rank 0 of its launch, from the launcher's variables (before any import
    of torch): torchrun's ``RANK``, Slurm's ``SLURM_PROCID``, else a single process."""
    rank = os.environ.get("RANK") or (os.environ.get("SLURM_PROCID") if os.environ.get("SLURM_NTASKS") else None)
    return rank in (None, "", "0")


__all__ = ["NAME", "Status", "close", "current", "main_rank", "phase", "process_start_time", "start"]
