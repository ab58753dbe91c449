"""Stall watchdog: a stopped or hung rank ends the run with a message naming it, in seconds, not hours.

    wd = start_watchdog(env, stall_timeout_s=600)      # after env.init(); a no-op watchdog when off
    install(wd)                                        # current() is what the trainer's stages use
    with current().stage("gen", step):                 # every stage of the loop (StageTimer)
        ...
    wd.stop()

Without it, a rank that stops (SIGSTOP, a frozen node, a process stuck in the kernel) leaves every
other rank blocked in its next collective until ``trainer.dist_timeout_s`` (1800 s) and then ends
with gloo's ``Timed out waiting ... for send``, which names neither the rank nor what it was doing.

How. Every rank publishes through the c10d store of the default process group, a side channel that
needs none of the (stuck) collectives; the watchdog clones the store's client, so that its own
connection is never blocked behind the main thread's store calls. Two keys per rank:

* ``stage/<rank>``: step, stage, its sequence number (stage changes so far), wall time it began,
  pid, host. Set by the main thread at each stage change (one store ``set``; a stage that ends
  leaves ``after <stage>``).
* ``alive/<rank>``: a counter the watchdog's daemon thread bumps every ``poll_s`` (1 to 5 s). A
  stopped, frozen or dead process stops bumping it, whatever its main thread was doing.
* ``detail/<rank>``: what the rank waits on, when a part of it said (:meth:`Watchdog.describe`: the
  episode runner names its oldest environment call, its row and for how long), set by the thread
  when it changes; every report names it beside the rank.

The thread also watches its own rank: once the current stage has lasted ``stall_timeout_s``, it
reads every rank's keys twice, ``2 poll_s + 1`` s apart (so no clocks are compared across hosts).
A rank whose counter did not move is *silent*; a lockstep rank (a trainer rank: all of them
change stages in the same order) alive at an earlier step or stage is *behind*; a rank whose stage
is ``exited`` has left. Any of them: the thread logs ONE message naming them, their step and stage
(the first reporting rank logs it in full, the others a line), writes it to torchrun's error file
(so torchrun's summary shows it as the root cause), and ends the process with status 1; torchrun
(or srun) ends the others. A silent rank that is a sibling on this host (same launcher agent) is
SIGKILLed first: a stopped process cannot act on the launcher's SIGTERM, and torchrun would wait its
30 s grace before killing it. Otherwise the stage is just long: on every rank alike (or it hangs on
every rank alike), or ranks *ahead* wait for this one, which is still working (they will judge it
behind if it hangs). The thread then logs a warning once per stage and the run goes on.

So ``stall_timeout_s`` must exceed the longest stage and the longest time one rank may work while
the others wait (a checkpoint save, rank 0's logging), and stay below ``dist_timeout_s``. Reward
pool ranks publish with ``lockstep=False`` (a server has no steps): they are checked for silence
only, and do not check themselves.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

log = logging.getLogger("spmd_rl")

PREFIX = "spmd_rl/watchdog"
EXITED = "exited"
STORE_TIMEOUT_S = 30.0
"""Timeout of the watchdog's own store calls: a dead store must not hang the watchdog for long."""


def poll_interval(stall_timeout_s: float) -> float:
    """Seconds between alive beats and own-stage checks: a tenth of the timeout, within 1..5 s."""
    return min(5.0, max(1.0, stall_timeout_s / 10))


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``ranks 0-2, 5``; ``[3]`` -> ``rank 3``."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


class NullWatchdog:
    """The watchdog when it is off (``trainer.stall_timeout_s`` 0, or a world of one)."""

    def beat(self, step: int, stage: str, *, lockstep: bool | None = None) -> None:
        pass

    @contextmanager
    def stage(self, name: str, step: int) -> Iterator[None]:
        yield

    def describe(self, fn: Callable[[], str] | None) -> None:
        """``fn()``: what this rank waits on now ("" for nothing), named in stall reports; None: nothing."""

    def stop(self) -> None:
        pass


class Watchdog(NullWatchdog):
    """One rank's heartbeat and stall check (see the module docstring).

    ``on_stall(message)`` ends the run; the default writes torchrun's error file, flushes the logs
    and ends the process with status 1 (tests pass a function that records the message)."""

    def __init__(self, store, rank: int, world_size: int, stall_timeout_s: float, *, poll_s: float | None = None,
                 lockstep: bool = True, on_stall: Callable[[str], None] | None = None,
                 host: str | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.stall_timeout_s = float(stall_timeout_s)
        self.poll_s = poll_interval(stall_timeout_s) if poll_s is None else poll_s
        self.lockstep = lockstep
        self.on_stall = on_stall or self.end_process
        self.host = host or socket.gethostname()
        self._stage_store = _own_client(store)  # the main thread's stage beats
        self._thread_store = _own_client(store)  # the thread's alive beats and reads
        self._state = (0, "setup", time.time(), time.monotonic())  # step, stage, wall start, monotonic start
        self._seq = 0  # stage changes so far: lockstep ranks share the order, so it says who is behind
        self._alive = 0
        self._stopped = threading.Event()
        self._warned: tuple[int, str] | None = None
        self._next_check = 0.0
        self._store_errors = 0
        self._silent_pids: dict[int, int] = {}  # rank -> pid, of the silent ranks on this host (last check)
        self._describe: Callable[[], str] | None = None  # what this rank waits on (describe())
        self._detail: str | None = None  # as last published
        self._thread = threading.Thread(target=self._run, name="spmd_rl stall watchdog", daemon=True)

    # ------------------------------------------------------------------ the main thread's side
    def start(self) -> "Watchdog":
        self._publish_stage()
        self._publish_detail()
        self._beat_alive()
        self._thread.start()
        return self

    def beat(self, step: int, stage: str, *, lockstep: bool | None = None) -> None:
        """This rank is now at ``stage`` of ``step`` (one store ``set``); nothing once stopped."""
        if self._stopped.is_set():
            return
        if lockstep is not None:
            self.lockstep = lockstep
        self._seq += 1
        self._state = (int(step), str(stage), time.time(), time.monotonic())
        self._publish_stage()

    @contextmanager
    def stage(self, name: str, step: int) -> Iterator[None]:
        self.beat(step, name)
        try:
            yield
        finally:
            self.beat(step, f"after {name}")

    def describe(self, fn: Callable[[], str] | None) -> None:
        """``fn()``, called by the watchdog's thread at each beat: what this rank waits on now ("" for
        nothing; e.g. an environment's step and its row), published beside its stage and named in the
        stall reports of every rank; None: nothing any more."""
        self._describe = fn

    def stop(self, stage: str = EXITED) -> None:
        """Ends the thread; the rank's last stage reads ``exited``, so that no rank takes it for silent."""
        if self._stopped.is_set():
            return
        self._state = (self._state[0], stage, time.time(), time.monotonic())
        self._publish_stage()
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + STORE_TIMEOUT_S)

    # ------------------------------------------------------------------ the thread's side
    def _run(self) -> None:
        reported = False
        while not self._stopped.wait(self.poll_s):
            self._beat_alive()
            self._publish_detail()
            if not self.lockstep or reported:
                continue
            step, stage, _, began = self._state
            now = time.monotonic()
            if now - began < self.stall_timeout_s or now < self._next_check:
                continue
            try:
                message = self.check()
            except Exception as e:  # noqa: BLE001 - the watchdog must never end a healthy run
                self._store_error(e)
                continue
            if message is not None and not self._stopped.is_set():
                self.on_stall(message)  # ends the process; an on_stall that returns: beat on, report once
                reported = True

    def check(self) -> str | None:
        """Read every rank's keys twice and judge (blocks ``2 poll_s + 1`` s). The message that ends
        the run, or None (the stage moved on meanwhile, or every rank is alive in it)."""
        step, stage, _, began = mine = self._state
        seq = self._seq
        first = self._read()
        until = time.monotonic() + 2 * self.poll_s + 1.0
        while time.monotonic() < until:  # beating on: the other ranks are checking too
            if self._stopped.wait(min(self.poll_s, max(until - time.monotonic(), 0.0))):
                return None
            self._beat_alive()
        if self._state is not mine:
            return None
        second = self._read()
        now_wall, waited = time.time(), time.monotonic() - began
        silent, left, behind, ahead = [], [], {}, []  # behind: (step, stage) -> [(rank, since)]
        self._silent_pids = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            info, (count, at) = second[r]
            if info is not None and info.get("stage") == EXITED:
                left.append(f"rank {r} has exited (after step {info.get('step')})")
            elif count is None or count == first[r][1][0]:
                silent.append(_silent_line(r, info, at, now_wall))
                if info is not None and count is not None and info.get("host") == self.host and info.get("pid"):
                    self._silent_pids[r] = int(info["pid"])
            elif info is not None and info.get("lockstep", True) and (info.get("step"), info.get("stage")) != (step, stage):
                if (info.get("step", 0), info.get("seq", 0)) < (step, seq):
                    behind.setdefault((info.get("step"), info.get("stage")), []).append((r, info.get("since", now_wall)))
                else:  # ahead (or off the common order): waiting for this rank, not the cause
                    ahead.append(r)
        head = (f"stall: rank {self.rank} has been in stage '{stage}' of step {step} for {waited:.0f} s "
                f"(trainer.stall_timeout_s={self.stall_timeout_s:g}){_detail({'detail': self._detail})}")
        waiting = [f"rank {r} {info['detail']}" for r, (info, _) in second.items()
                   if r != self.rank and info is not None and info.get("detail")]
        if not (silent or left or behind):
            if self._warned != (step, stage):
                self._warned = (step, stage)
                why = (f"{format_ranks(ahead)} went on and wait for this rank, which is still at it: slow here, "
                       "or they will name it if it hangs" if ahead else
                       "every rank is alive and in this stage: a long stage (raise trainer.stall_timeout_s if it is "
                       "expected) or a hang inside it on every rank")
                log.warning("%s; %s; not ending the run", head.replace("stall: ", "slow stage: ", 1),
                            "; ".join([why, *waiting]))
            self._next_check = time.monotonic() + max(30.0, self.stall_timeout_s / 2)
            return None
        lines = silent + left + [
            f"{format_ranks([r for r, _ in where])} {'is' if len(where) == 1 else 'are'} alive but still in stage "
            f"'{st}' of step {sp} (for {max(now_wall - min(t for _, t in where), 0):.0f} s): hanging there or slow"
            for (sp, st), where in sorted(behind.items(), key=lambda kv: kv[1][0][0])] + waiting
        if len(lines) > 8:
            lines = lines[:8] + [f"and {len(lines) - 8} more"]
        return f"{head}; " + "; ".join(lines) + ". Ending the run."

    def end_process(self, message: str) -> None:
        """The default ``on_stall``, in the watchdog's thread (the main thread is stuck in a
        collective): log the message (in full on the first rank to report, else one line), hand it
        to torchrun as the root cause with the main thread's stack, flush, end with status 1."""
        from spmd_rl.distributed.process import exit_now, write_error_file

        try:
            first = int(self._thread_store.add(f"{PREFIX}/reports", 1)) == 1
        except Exception:  # noqa: BLE001
            first = True
        if first:
            log.error("%s", message)
        else:
            log.error("rank %d ends too: %s (the full report is another rank's)", self.rank, message.split("; ", 1)[0])
        main = sys._current_frames().get(threading.main_thread().ident)
        where = "".join(traceback.format_stack(main)) if main is not None else ""
        write_error_file(message, f"Where rank {self.rank}'s main thread waits (most recent call last):\n{where}{message}")
        for rank, pid in self._silent_pids.items():
            if _kill_sibling(pid):
                log.error("rank %d: sent SIGKILL to silent rank %d (pid %d on this host)", self.rank, rank, pid)
        # No exit handlers: they run in this thread while the main thread holds whatever it holds.
        exit_now(1, run_exit_handlers=False)

    # ------------------------------------------------------------------ store
    def _publish_stage(self) -> None:
        step, stage, since, _ = self._state
        value = json.dumps({"step": step, "stage": stage, "seq": self._seq, "since": since, "pid": os.getpid(),
                            "host": self.host, "lockstep": self.lockstep})
        try:
            self._stage_store.set(f"{PREFIX}/stage/{self.rank}", value)
        except Exception as e:  # noqa: BLE001
            self._store_error(e)

    def _publish_detail(self) -> None:
        """What this rank waits on (:meth:`describe`), when it changed (the watchdog's thread)."""
        try:
            detail = self._describe() if self._describe is not None else ""
        except Exception as e:  # noqa: BLE001 - a describer that fails says so, the watchdog goes on
            detail = f"(its description failed: {type(e).__name__}: {e})"
        if detail == self._detail:
            return
        try:
            self._thread_store.set(f"{PREFIX}/detail/{self.rank}", detail)
            self._detail = detail
        except Exception as e:  # noqa: BLE001
            self._store_error(e)

    def _beat_alive(self) -> None:
        self._alive += 1
        try:
            self._thread_store.set(f"{PREFIX}/alive/{self.rank}", f"{self._alive} {time.time()}")
        except Exception as e:  # noqa: BLE001
            self._store_error(e)

    def _read(self) -> dict[int, tuple[dict | None, tuple[int | None, float | None]]]:
        """Every rank's (stage info, (alive counter, time of that beat)); None where a key is missing."""
        store = self._thread_store
        keys = [f"{PREFIX}/{kind}/{r}" for r in range(self.world_size) for kind in ("stage", "alive", "detail")]
        if store.check(keys):  # get() would wait for a missing key
            values = dict(zip(keys, store.multi_get(keys)))
        else:
            values = {k: store.get(k) for k in keys if store.check([k])}
        out = {}
        for r in range(self.world_size):
            stage, alive = values.get(f"{PREFIX}/stage/{r}"), values.get(f"{PREFIX}/alive/{r}")
            info = json.loads(_text(stage)) if stage is not None else None
            detail = values.get(f"{PREFIX}/detail/{r}")
            if info is not None and detail is not None:
                info["detail"] = _text(detail)
            count, at = (_text(alive).split() if alive is not None else (None, None))
            out[r] = (info, (None if count is None else int(count), None if at is None else float(at)))
        return out

    def _store_error(self, e: BaseException) -> None:
        self._store_errors += 1
        if self._store_errors == 1:
            log.warning("rank %d: the stall watchdog cannot reach the store (%s: %s); it keeps trying",
                        self.rank, type(e).__name__, e)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _detail(info: dict | None) -> str:
    """`` (waiting on ...)`` from a rank's published description, or nothing."""
    detail = (info or {}).get("detail")
    return f" ({detail})" if detail else ""


def _silent_line(r: int, info: dict | None, at: float | None, now: float) -> str:
    if info is None or at is None:
        return f"rank {r} never sent a heartbeat: it did not start, or died early"
    where = f"in stage '{info.get('stage')}' of step {info.get('step')}"
    return (f"rank {r}'s last heartbeat was {max(now - at, 0):.0f} s ago, {where} (entered "
            f"{max(now - info.get('since', now), 0):.0f} s ago): it stopped, froze or died "
            f"(pid {info.get('pid')} on {info.get('host')})")


def _kill_sibling(pid: int) -> bool:
    """SIGKILL ``pid`` if it is a child of this process's parent (a worker of the same launcher
    agent, not a reused pid or someone else's process); whether a signal was sent."""
    parent = os.getppid()
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if parent <= 1 or ppid != parent or pid == os.getpid():
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (OSError, ValueError, IndexError):  # gone meanwhile, or no /proc (not Linux)
        return False


def _own_client(store):
    """A client of the same store with its own connection (``clone``), else the store itself."""
    try:
        store = store.clone()
    except Exception:  # noqa: BLE001 - HashStore and older stores: share it
        pass
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:  # noqa: BLE001
        pass
    return store


# ---------------------------------------------------------------------- the run's watchdog

_current: NullWatchdog = NullWatchdog()


def current() -> NullWatchdog:
    """The watchdog of this process (a no-op one unless :func:`install` was called)."""
    return _current


def install(watchdog: NullWatchdog | None) -> None:
    global _current
    _current = watchdog if watchdog is not None else NullWatchdog()


def start_watchdog(env, stall_timeout_s: float, *, lockstep: bool = True) -> NullWatchdog:
    """The run's watchdog over the default process group's store (after ``env.init()``); a no-op
    one when ``stall_timeout_s`` is 0 or the world has one rank."""
    if stall_timeout_s <= 0 or env.world_size <= 1:
        return NullWatchdog()
    from torch.distributed.distributed_c10d import _get_default_store

    return Watchdog(_get_default_store(), env.rank, env.world_size, stall_timeout_s, lockstep=lockstep,
                    host=env.hostname).start()
