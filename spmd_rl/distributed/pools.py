"""Resource pools: named, contiguous ranges of global ranks, each with its own process group.

The pure part plans the pools for any world size, with no process group::

    specs = plan_pools(world_size=8, rollout_ranks=4, reward_ranks=1)
    # [PoolSpec('global', start=0, size=3), PoolSpec('rollout', 3, 4), PoolSpec('reward', 7, 1)]
    specs[1].local_rank(3)   # 0: pool-local ranks run 0..size-1

After ``torch.distributed`` is initialised, every rank of the world builds all pools together
(group creation is collective over the world)::

    pools = Pools.build(specs)
    pool = pools.get("global")          # raises, listing valid names, for an unknown name
    pool.group, pool.rank, pool.size    # this process's group and pool-local rank (None if outside)
    pools.get_optional("reward")        # None when the run has no reward pool

By default there is one ``global`` pool holding every rank, shared (colocated) by actor,
reference, rollout and teacher. ``pools.rollout_ranks``, ``pools.teacher_ranks`` and
``pools.reward_ranks`` give those roles ranks of their own, in that order after the global pool.
Pools never overlap. Which GPU a rank uses (several processes per GPU with ``pools.colocate``) is
:func:`gpu_of`.

``build_mesh`` / ``build_groups`` create a DeviceMesh or process groups over a range of global
ranks; the layouts of :mod:`spmd_rl.distributed.dims` use them in their ``build()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

GLOBAL = "global"
ROLLOUT = "rollout"
TEACHER = "teacher"
REWARD = "reward"
POOL_ORDER = (GLOBAL, ROLLOUT, TEACHER, REWARD)
"""Pools in world order: each is a contiguous range of global ranks after the one before."""


@dataclass(frozen=True)
class PoolSpec:
    """Global ranks ``start .. start + size - 1``; pool-local rank = global rank - start."""

    name: str
    start: int
    size: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.size < 1:
            raise ValueError(f"pool {self.name!r}: start ({self.start}) must be >= 0 and size ({self.size}) >= 1")

    @property
    def end(self) -> int:
        """One past the last global rank of the pool."""
        return self.start + self.size

    @property
    def ranks(self) -> list[int]:
        """The pool's global ranks, ascending."""
        return list(range(self.start, self.end))

    def contains(self, rank: int) -> bool:
        return self.start <= rank < self.end

    def local_rank(self, rank: int) -> int:
        """Pool-local rank of global ``rank``; ValueError when the pool does not hold it."""
        if not self.contains(rank):
            raise ValueError(
                f"global rank {rank} is not in pool {self.name!r} (global ranks {self.start}..{self.end - 1})"
            )
        return rank - self.start

    def global_rank(self, local_rank: int) -> int:
        """Global rank of pool-local ``local_rank``."""
        if not 0 <= local_rank < self.size:
            raise ValueError(f"pool-local rank {local_rank} is outside pool {self.name!r} of size {self.size}")
        return self.start + local_rank


def pool_size(value: int | float, world_size: int, name: str) -> int:
    """Ranks of a pool given as ``pools.<name>_ranks``: a whole number is a count; a fraction in (0, 1)
    a share of the world, ``floor(value x world_size)`` ranks and at least 1, so that the same flag
    plans every world an elastic run restarts at."""
    if value < 0 or (value != int(value) and value > 1):
        raise ValueError(f"pools.{name}_ranks must be a count (0, 1, 2, ...) or a fraction of the world in "
                         f"(0, 1), got {value}")
    if value == int(value):
        return int(value)
    return max(1, int(value * world_size))


def plan_pools(world_size: int, *, rollout_ranks: int | float = 0, teacher_ranks: int | float = 0,
               reward_ranks: int | float = 0) -> list[PoolSpec]:
    """Carve the world into contiguous pools, in the order ``global``, ``rollout``, ``teacher``,
    ``reward``: each named role with a positive size gets that many ranks (a fraction: that share of
    the world, :func:`pool_size`), ``global`` the rest."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    given = {ROLLOUT: rollout_ranks, TEACHER: teacher_ranks, REWARD: reward_ranks}
    sizes = {name: pool_size(v, world_size, name) for name, v in given.items()}
    own = sum(sizes.values())
    if own >= world_size:
        terms = [f"pools.{name}_ranks ({given[name]}{'' if given[name] == n else f': {n} of {world_size}'})"
                 for name, n in sizes.items() if n]
        parts = terms[0] if len(terms) == 1 else f"{' + '.join(terms)} = {own}"
        raise ValueError(f"{parts} must be smaller than the world size ({world_size}): the global pool "
                         f"(actor and reference) needs at least one rank")
    specs = [PoolSpec(GLOBAL, 0, world_size - own)]
    for name, n in sizes.items():
        if n:
            specs.append(PoolSpec(name, specs[-1].end, n))
    return specs


def gpus_per_node(nproc_per_node: int, colocate: int) -> int:
    """GPUs a node uses when it runs ``nproc_per_node`` processes, ``colocate`` per GPU."""
    if colocate < 1 or nproc_per_node % colocate:
        raise ValueError(f"pools.colocate ({colocate}) must divide the processes per node ({nproc_per_node}): "
                         f"each GPU runs colocate processes")
    return nproc_per_node // colocate


def gpu_of(local_rank: int, nproc_per_node: int, colocate: int = 1) -> int:
    """The GPU index of a process on its node: local ranks ``0..G-1`` use GPUs ``0..G-1``, the next
    G ranks GPUs ``0..G-1`` again, and so on (``G = nproc_per_node / colocate``), so that pools that
    follow each other in the world share GPUs."""
    return local_rank % gpus_per_node(nproc_per_node, colocate)


def member_of(specs: Sequence[PoolSpec], rank: int) -> list[str]:
    """Names of the pools that hold global ``rank``, in plan order."""
    return [s.name for s in specs if s.contains(rank)]


def get_spec(specs: Sequence[PoolSpec], name: str) -> PoolSpec:
    """The spec called ``name``; ValueError listing the valid names otherwise."""
    for s in specs:
        if s.name == name:
            return s
    raise ValueError(f"no pool named {name!r}; pools of this run: {', '.join(s.name for s in specs)}")


@dataclass(frozen=True)
class Pool:
    """One pool as seen by this process: its spec and, when this process is a member, its group."""

    spec: PoolSpec
    group: ProcessGroup | None
    """The pool's process group; None on processes outside the pool."""
    rank: int | None
    """This process's pool-local rank; None outside the pool."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def is_member(self) -> bool:
        return self.rank is not None


class Pools:
    """All pools of the run, built on every rank of the world (see :meth:`build`)."""

    def __init__(self, pools: Sequence[Pool], global_rank: int) -> None:
        self._pools = {p.name: p for p in pools}
        self.global_rank = global_rank

    @classmethod
    def build(cls, specs: Sequence[PoolSpec], *, timeout: timedelta | None = None) -> "Pools":
        """Create one process group per pool. Collective: every rank of the world calls it with
        the same specs; groups are created in spec order. A pool equal to the whole world uses
        the default group."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        for s in specs:
            if s.end > world:
                raise ValueError(
                    f"pool {s.name!r} (global ranks {s.start}..{s.end - 1}) does not fit in the world size ({world})"
                )
        pools = []
        for s in specs:
            if s.start == 0 and s.size == world:
                group = dist.group.WORLD
            else:
                group = dist.new_group(ranks=s.ranks, timeout=timeout)
            member = s.contains(rank)
            pools.append(Pool(spec=s, group=group if member else None, rank=s.local_rank(rank) if member else None))
        return cls(pools, rank)

    @property
    def names(self) -> list[str]:
        return list(self._pools)

    @property
    def specs(self) -> list[PoolSpec]:
        return [p.spec for p in self._pools.values()]

    def get(self, name: str) -> Pool:
        """The pool called ``name``; ValueError listing the valid names otherwise."""
        if name not in self._pools:
            raise ValueError(f"no pool named {name!r}; pools of this run: {', '.join(self._pools)}")
        return self._pools[name]

    def get_optional(self, name: str) -> Pool | None:
        """The pool called ``name``, or None when the run has none."""
        return self._pools.get(name)

    def member_of(self, rank: int | None = None) -> list[str]:
        """Names of the pools holding global ``rank`` (default: this process)."""
        return member_of(self.specs, self.global_rank if rank is None else rank)

    def mine(self) -> list[Pool]:
        """The pools this process belongs to."""
        return [p for p in self._pools.values() if p.is_member]


# --------------------------------------------------------------------------- groups over a rank range


def build_mesh(device_type: str, start: int, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh | None:
    """A DeviceMesh over global ranks ``start..start+prod(shape)-1`` (C order), or None on ranks
    outside it. Collective: every rank of the world calls it.

    ``init_device_mesh`` always takes global ranks ``0..N-1``, so a pool that does not start at
    rank 0 needs ``DeviceMesh(device_type, mesh=<tensor of global ranks>)``. Its constructor
    creates the groups of every mesh axis with ``new_group`` (or ``split_group`` on an eagerly
    initialised NCCL world), which is collective over the whole world, so ranks outside the mesh
    must construct it too; they get a non-participating mesh (``get_coordinate() is None``).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    n, world = math.prod(shape), dist.get_world_size()
    if start < 0 or start + n > world:
        raise ValueError(f"a mesh of {n} ranks starting at global rank {start} does not fit in the world size ({world})")
    ranks = torch.arange(start, start + n, dtype=torch.int).reshape(shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
    return mesh if mesh.get_coordinate() is not None else None


def build_groups(groups: dict[str, list[list[int]]], start: int, timeout: timedelta | None) -> dict[str, ProcessGroup]:
    """Create every group (shifted to global ranks by ``start``) on every rank of the world, in the
    same order; return this rank's group per axis. Identical rank lists share one process group,
    and a group equal to the whole world is the default group."""
    import torch.distributed as dist

    world, me = dist.get_world_size(), dist.get_rank()
    made: dict[tuple[int, ...], Any] = {}
    mine: dict[str, ProcessGroup] = {}
    for axis, axis_groups in groups.items():
        for g in axis_groups:
            ranks = tuple(start + r for r in g)
            if ranks[0] < 0 or ranks[-1] >= world:
                raise ValueError(f"group {list(ranks)} of axis {axis!r} does not fit in the world size ({world})")
            if ranks not in made:
                whole = ranks == tuple(range(world))
                made[ranks] = dist.group.WORLD if whole else dist.new_group(list(ranks), timeout=timeout)
            if me in ranks:
                mine[axis] = made[ranks]
    return mine


__all__ = [
    "GLOBAL", "POOL_ORDER", "REWARD", "ROLLOUT", "TEACHER", "Pool", "PoolSpec", "Pools", "build_groups", "build_mesh", "get_spec", "gpu_of", "gpus_per_node", "member_of", "plan_pools", "pool_size",
]
