"""Run a function on N CPU processes joined by gloo: the backbone of the distributed tests.

    def body(rank, world_size, x):
        ...  # torch.distributed is initialised here; return a picklable result
    results = run_distributed(body, 4, 3.0)   # list of the 4 return values, by rank

Each process gets the torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT)
so product code that reads the environment behaves as under ``torchrun``. An exception on any rank
fails the call with that rank's traceback instead of hanging the others.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_lib
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any],
            args: tuple, queue: Any, timeout_s: float) -> None:
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


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises ``RuntimeError`` with
    the first failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, timeout_s))
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
