"""Run a function on N CPU processes joined by gloo: the backbone of the distributed tests.

    def body(rank, world_size, x):
        ...  # torch.distributed is initialised here; return a picklable result
    results = run_distributed(body, 4, 3.0)   # list of the 4 return values, by rank

    proc = run_program("spmd_rl.train", [*flags], nproc=2)   # a program's ranks: a CompletedProcess

Each process gets the caller's environment plus the torchrun-style variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT), so product code that reads the environment behaves as under
``torchrun``. An exception on any rank fails the call with that rank's traceback instead of hanging
the others.

:func:`run_program` runs an entry point's ``main(argv)`` (``spmd_rl.train``, ``spmd_rl.evaluate``)
the same way on N ranks and returns what ``torchrun`` would have printed and returned, for the
end-to-end tests that are about the program and not about its launcher (those keep ``torchrun``).

The processes are forked from a server that imported torch, transformers and the trainer once
(``forkserver`` with those modules preloaded), not spawned: a spawned process spends seconds
importing them again, and a test suite starts hundreds. Forking that server is safe where forking
the caller is not: it has run no tensor operation, so it has no OpenMP or gloo threads.

Devices: these ranks are CPU processes whatever the machine has. The server and every rank run with
``CUDA_VISIBLE_DEVICES=""`` (:func:`cpu_env`), so a rank on a GPU host picks the CPU and gloo as on a
machine without one, and nothing the server imports can initialise CUDA before it forks (a forked
child cannot use a CUDA driver its parent initialised). ``run_distributed(..., cuda=True)`` (with
``backend="nccl"``) is the CUDA case: its ranks are spawned (never forked) and see the GPUs; :func:`cuda_devices`
counts them without initialising CUDA, for a test's skip condition. Subprocesses that a CPU test
starts itself (``torchrun``, scripts) take ``env=cpu_env(...)``.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import pickle
import queue as queue_lib
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
"""What makes a process a CPU process on any machine: it sees no GPU, so ``trainer.device auto``
picks the CPU, the world's backend is gloo, and megatron's CPU test shims apply."""


def cpu_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a CPU test process: ``base`` (default: this process's environment) plus
    ``extra``, with the GPUs hidden."""
    return {**(os.environ if base is None else base), **extra, **CPU_ENV}


def cuda_devices() -> int:
    """How many CUDA devices this process could use, counted through NVML where torch can (which
    leaves CUDA uninitialised, as ``torch.cuda.is_available()`` does not); 0 on a CPU-only torch."""
    return torch.cuda.device_count()


PORTS_FILE = os.path.join(tempfile.gettempdir(), "spmd_rl-test-ports")
"""The ports :func:`free_port` handed out lately, one ``port time`` line each, shared by every test
process of this machine (pytest-xdist workers, concurrent suites)."""
PORT_HOLD_S = 1800.0
"""How long a handed-out port stays reserved: longer than any one test keeps its rendezvous."""


def free_port() -> int:
    """A TCP port for a test's rendezvous (``MASTER_PORT``, ``--rdzv-endpoint``) that no socket holds
    and that nothing else will take between this call and the test's first listen.

    A port the kernel picks (``bind(port 0)``) is an ephemeral one: any outgoing connection on the
    machine (gloo's full mesh of every other test) may take it as its source port in the seconds before
    the test's rank 0 listens, and the rendezvous then fails with EADDRINUSE. This one is taken below
    the kernel's ephemeral range (``ip_local_port_range``), where no outgoing connection goes, and
    recorded in :data:`PORTS_FILE` under a lock, so two test processes never get the same one. Off
    Linux (no such range to read) it falls back to the kernel's pick."""
    span = _below_ephemeral_range()
    if span is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    with open(PORTS_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        now, recent = time.time(), {}
        for line in f.read().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit() and now - float(fields[1]) < PORT_HOLD_S:
                recent[int(fields[0])] = fields[1]
        candidates = [p for p in range(*span) if p not in recent]
        random.shuffle(candidates)
        port = next((p for p in candidates if _bindable(p)), None)
        if port is None:
            raise RuntimeError(f"no free TCP port in {span[0]}..{span[1] - 1} ({len(recent)} handed out "
                               f"in the last {PORT_HOLD_S:.0f} s, listed in {PORTS_FILE})")
        recent[port] = f"{now:.0f}"
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {t}\n" for p, t in recent.items()))
    return port


def _below_ephemeral_range(width: int = 8192) -> tuple[int, int] | None:
    """``[start, stop)``: the ``width`` ports just below the kernel's ephemeral range, None where that
    range cannot be read or leaves no room above the privileged ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(1024, low - width)
    return (start, low) if low - start >= 256 else None


def _bindable(port: int) -> bool:
    """Whether a listening socket could bind ``port`` on every address now (as the TCP store does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor", "megatron.core", "tyro",
           "transformers", "transformers.modeling_utils", "transformers.generation",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
           "spmd_rl.train", "spmd_rl.trainer", "spmd_rl.evaluate", "spmd_rl.critic", "spmd_rl.models.tokenizer",
           "spmd_rl.engine.fsdp", "spmd_rl.engine.value", "spmd_rl.rollout.native", "spmd_rl.rollout.fast",
           "spmd_rl.engine.megatron.engine"]
"""Imported once by the fork server (a module that is not installed is skipped). The product imports
most of these lazily, where a run first needs them (the layout tool imports no torch): listed here,
each rank finds them imported instead of spending seconds on them."""


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any],
            args: tuple, queue: Any, timeout_s: float, environ: dict[str, str], cuda: bool = False) -> None:
    os.environ.clear()  # the server's environment is from when it started; the caller's is now
    os.environ.update(environ)
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        # Plain pickle: tensors travel as bytes, not as shared memory that dies with the worker.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure, including SystemExit from product code
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """The fork server's context, the server started (once per process) with the GPUs hidden: it
    imports torch and megatron, and whatever they ask of CUDA there must leave its children free."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    from multiprocessing import forkserver

    saved = {k: os.environ.get(k) for k in CPU_ENV}
    os.environ.update(CPU_ENV)  # the server inherits this process's environment when it starts
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def _program_worker(module: str, argv: list[str], environ: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for path in reversed(environ.get("PYTHONPATH", "").split(os.pathsep)):  # as a new interpreter would
        if path and path not in sys.path:
            sys.path.insert(0, path)
    for fd, path in ((1, out), (2, err)):  # as a torchrun worker's: its own stdout and stderr
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    from spmd_rl.distributed.process import exit_now, run_entry

    exit_now(run_entry(importlib.import_module(module).main, argv))


def _read(path: str, missing: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return missing


def run_program(module: str, argv: list[str], *, nproc: int, env: dict[str, str] | None = None,
                cwd: str | None = None, timeout: float = 600.0, grace_s: float = 10.0) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module *argv``, without torchrun: ``module.main(argv)`` on
    ``nproc`` forked CPU ranks (:func:`cpu_env`) with a torchrun-style environment (plus ``env``). Returns a
    ``CompletedProcess`` whose stdout / stderr are the ranks' own, rank by rank, and whose
    ``returncode`` is the first failing rank's status (0 when all succeed). As torchrun does, the
    other ranks are killed ``grace_s`` after the first fails; ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds (every rank killed)."""
    ctx = _context()
    port = free_port()
    cwd = cwd or os.getcwd()
    with tempfile.TemporaryDirectory(prefix="spmd_rl_run_") as logs:
        procs = []
        for r in range(nproc):
            environ = cpu_env(**(env or {}), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                           LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            files = (os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err"))
            procs.append(ctx.Process(target=_program_worker, args=(module, argv, environ, cwd, *files)))
            procs[-1].start()
        deadline, failed_at, code = time.monotonic() + timeout, None, 0
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + grace_s):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                if now > deadline:
                    for p in procs:
                        p.join()
                    raise subprocess.TimeoutExpired([module, *argv], timeout)
            for p in procs:
                if p.exitcode not in (None, 0) and failed_at is None:
                    failed_at, code = now, p.exitcode
            time.sleep(0.05)
        if code == 0:
            code = next((p.exitcode for p in procs if p.exitcode), 0)
        # a rank that died before it took its files over (e.g. unpicklable arguments) left none
        text = [[_read(os.path.join(logs, f"{r}.{kind}"), f"rank {r} exited with code {procs[r].exitcode} "
                       "before it started\n" if kind == "err" else "") for r in range(nproc)] for kind in ("out", "err")]
    return subprocess.CompletedProcess([module, *argv], code, "".join(text[0]), "".join(text[1]))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 300.0, cuda: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises ``RuntimeError`` with
    the first failing rank's traceback. The ranks are forked CPU processes (:func:`cpu_env`), or with
    ``cuda`` spawned ones, rank ``r`` on GPU ``r % cuda_devices()`` (the caller skips when it has too
    few: ``support.devices.needs_gpus``).
    """
    if cuda:
        ctx, environ = mp.get_context("spawn"), dict(os.environ)
    else:
        ctx, environ = _context(), cpu_env()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, timeout_s, environ, cuda))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s + 120
    while len(results) < world_size and not failures:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_lib.Empty:
            # A worker that died before reporting (killed, or fn could not be unpickled) would
            # otherwise leave us waiting forever.
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead or time.monotonic() > deadline:
                failures.append((dead[0][0] if dead else -1,
                                 f"worker exited with code {dead[0][1]} without reporting" if dead
                                 else f"no result within {timeout_s + 120:.0f} s"))
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures.append((rank, payload))  # others may be blocked in a collective with it
    if failures:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        rank, tb = failures[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    for p in procs:
        p.join()
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"processes exited with non-zero codes (rank, code): {bad}")
    return [results[r] for r in range(world_size)]
