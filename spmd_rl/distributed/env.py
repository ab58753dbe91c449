"""Who am I in the world: read the launcher's environment, pick the device, join the process group.

    env = DistEnv.from_environ()          # torchrun, else Slurm (srun), else one process
    env.init(device="auto", timeout_s=1800)
    ...
    env.shutdown()

torchrun sets RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / GROUP_RANK / MASTER_ADDR /
MASTER_PORT. Under ``srun`` with one task per GPU the project reads SLURM_PROCID / SLURM_LOCALID /
SLURM_NTASKS / SLURM_NODEID and takes the master address from the first host of the job's node
list (:func:`expand_slurm_nodelist` expands ``node[01-04,07]``) and the port from the job id, so
two jobs on one node need no configuration. Without either, the process is a world of one. The
device is ``cuda:LOCAL_RANK`` on GPU machines, else the CPU. The backend is ``cpu:gloo,cuda:nccl``
on GPU (gloo carries Python objects, NCCL tensors) and ``gloo`` on CPU. :func:`gather_rank_table` /
:func:`format_rank_table` give every rank's host, device and pool places, logged at start-up.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from spmd_rl.distributed.pools import gpu_of

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``gpu[01-03,07],login1`` into host names, in order."""
    hosts: list[str] = []
    # Split on commas that are not inside brackets.
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    for part in parts:
        m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


@dataclass
class DistEnv:
    """This process's place in the world, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "single"
    """`torchrun`, `slurm` or `single`."""
    hostname: str = field(default_factory=socket.gethostname)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    colocate: int = 1
    """Processes per GPU (``pools.colocate``), set by :meth:`init`."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            local_world = int(env.get("LOCAL_WORLD_SIZE", world))
            rank = int(env["RANK"])
            return cls(
                rank=rank,
                local_rank=int(env.get("LOCAL_RANK", rank % max(local_world, 1))),
                world_size=world,
                local_world_size=local_world,
                node_rank=int(env.get("GROUP_RANK", rank // max(local_world, 1))),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
                launcher="torchrun",
            )
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            world = int(env["SLURM_NTASKS"])
            nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
            per_node = env.get("SLURM_NTASKS_PER_NODE", "")
            m = re.match(r"(\d+)", per_node)
            local_world = int(m.group(1)) if m else max(world // max(nodes, 1), 1)
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
            hosts = expand_slurm_nodelist(nodelist) if nodelist else []
            master = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
            # A port derived from the job id lets two jobs on one node coexist without configuration;
            # 20000..31999 lies below Linux's ephemeral range (32768 on), where any outgoing connection
            # of the node could hold it as its source port when rank 0 listens
            job_id = env.get("SLURM_JOB_ID", "0")
            port = int(env.get("MASTER_PORT", 20000 + int(job_id) % 12000 if job_id.isdigit() else DEFAULT_PORT))
            return cls(
                rank=int(env["SLURM_PROCID"]),
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                world_size=world,
                local_world_size=local_world,
                node_rank=int(env.get("SLURM_NODEID", "0")),
                master_addr=master,
                master_port=port,
                launcher="slurm",
            )
        return cls()

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def pick_device(self, device: str = "auto", colocate: int = 1) -> torch.device:
        """``cuda:<gpu>`` with ``gpu = local_rank % (local world size / colocate)`` (``colocate``
        processes per GPU, :func:`spmd_rl.distributed.pools.gpu_of`) on GPU machines, else the CPU."""
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but torch sees no CUDA device; use --trainer.device cpu")
        if device in ("auto", "cuda") and torch.cuda.is_available():
            count = torch.cuda.device_count()
            gpu = gpu_of(self.local_rank, self.local_world_size, colocate)
            if gpu >= count:
                raise ValueError(
                    f"LOCAL_RANK {self.local_rank} has no GPU: this node shows {count} CUDA device(s); start at "
                    f"most {count} x pools.colocate ({colocate}) processes per node (--nproc-per-node)"
                )
            torch.cuda.set_device(gpu)
            return torch.device("cuda", gpu)
        return torch.device("cpu")

    def init(self, *, device: str = "auto", timeout_s: int = 1800, colocate: int = 1) -> "DistEnv":
        """Pick the device and join the world's default process group (also for a world of one).

        With ``colocate`` > 1 several processes share a GPU, which one NCCL communicator cannot
        hold: the world's NCCL side is then never initialised eagerly, and only groups whose ranks
        sit on different GPUs (each pool's own) carry device tensors."""
        self.colocate = colocate
        self.device = self.pick_device(device, colocate)
        use_host_threads(self.device)
        if dist.is_initialized():
            return self
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        os.environ.setdefault("MASTER_ADDR", self.master_addr)
        os.environ.setdefault("MASTER_PORT", str(self.master_port))
        timeout = timedelta(seconds=timeout_s)
        store = _restart_safe_store(self, timeout)
        if store is None and self.launcher == "single":
            # a world of one: its own store on a port the kernel picks as it listens (never one another
            # process could take between a pick and the listen)
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        dist.init_process_group(
            backend=backend,
            init_method="env://" if store is None else None,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
            device_id=self.device if self.device.type == "cuda" and colocate == 1 else None,
        )
        return self

    def shutdown(self) -> None:
        """Shut down and unregister every process group (the ``new_group`` ones, then the default).
        A gloo group's worker threads live on while Python still references the group: the
        process then ends with ``os._exit`` (:mod:`spmd_rl.distributed.process` says why)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def describe(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "node": self.node_rank,
            "host": self.hostname,
            "local_rank": self.local_rank,
            "device": str(self.device),
        }


def host_threads(device: torch.device, environ: Mapping[str, str]) -> int | None:
    """The torch intra-op threads of a process on ``device``, None to keep torch's choice.

    A GPU rank's host side is small tensor ops (packing, staging); a thread pool as wide as the machine
    beside the CUDA and autograd threads oversubscribes it, and each op then waits for a descheduled
    worker (~8 ms): one thread, as torchrun sets for several processes per node (an MoE update of one
    process on an H200 host: 1.82 s a step with 16 threads, 0.83 s with one; docs/PERF.md). A CPU run's
    threads are its compute, and ``OMP_NUM_THREADS`` when set is the user's choice."""
    if device.type != "cuda" or "OMP_NUM_THREADS" in environ:
        return None
    return 1


def use_host_threads(device: torch.device) -> None:
    """Set this process's torch intra-op threads as :func:`host_threads` says for ``device`` (what every
    process of ``spmd_rl.train`` does in :meth:`DistEnv.init`; the benchmarks that build engines
    themselves call it so that they run as the trainer does)."""
    threads = host_threads(device, os.environ)
    if threads is not None:
        torch.set_num_threads(threads)


def _restart_safe_store(env: "DistEnv", timeout: timedelta) -> dist.Store | None:
    """Under torchrun the workers share the agent's TCP store across restarts (``--max-restarts``).

    Keys written by the processes of a crashed attempt (gloo/NCCL peer addresses) are still there
    when the restarted processes rendezvous, and they can connect to dead peers and hang. A
    prefix per restart attempt gives every attempt its own namespace in the same store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                         timeout=timeout)
    return dist.PrefixStore(f"spmd_rl/attempt_{attempt}", base)


def gather_rank_table(env: DistEnv, pool_names_by_rank: Mapping[int, Mapping[str, int]]) -> list[dict[str, object]]:
    """Every rank's description, gathered to all ranks (a collective: call on every rank)."""
    mine = env.describe()
    rows: list[dict[str, object]] = [dict() for _ in range(env.world_size)]
    if env.world_size > 1:
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    for row in rows:
        row["pools"] = dict(pool_names_by_rank.get(int(row["rank"]), {}))  # type: ignore[arg-type]
    return rows


def format_rank_table(rows: list[dict[str, object]]) -> str:
    """The rank table rank 0 prints at start: rank, node, host, local rank, device, pools."""
    def pools(row: dict[str, object]) -> str:
        p = row.get("pools") or {}
        return ", ".join(f"{name}:{local}" for name, local in p.items())  # type: ignore[union-attr]

    header = ("rank", "node", "host", "local_rank", "device", "pools (name:pool rank)")
    table = [header] + [
        (str(r["rank"]), str(r["node"]), str(r["host"]), str(r["local_rank"]), str(r["device"]), pools(r))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
