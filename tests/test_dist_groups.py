"""Real process groups on 4 and 8 gloo CPU processes match the pure layouts.

Every rank builds the pools, FSDP/HSDP and Ulysses DeviceMeshes (also over pools that are a
subset of the world), rollout and Megatron-layout groups (our own ``new_group`` build), then
all-reduces its global rank over each of its groups: the sum must equal the sum of the pure
layout's group. One ``run_distributed`` call per world size checks many layouts (spawning is slow).

Run: ``python -m pytest tests/test_dist_groups.py -q``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from spmd_rl.distributed.dims import FsdpLayout, MegatronLayout, RolloutLayout, UlyssesLayout
from spmd_rl.distributed.pools import Pools, plan_pools
from spmd_rl.distributed.testing import run_distributed


def _check_group(what: str, group: Any, expected: list[int], rank: int) -> None:
    """``group`` must hold exactly the global ranks ``expected`` with this rank at its index."""
    t = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    assert t.item() == sum(expected), f"{what}: all-reduce gave {t.item()}, expected sum of {expected}"
    assert dist.get_world_size(group) == len(expected), f"{what}: size {dist.get_world_size(group)} vs {expected}"
    assert dist.get_rank(group) == expected.index(rank), f"{what}: group rank {dist.get_rank(group)} vs {expected}"


def _my_group(groups: list[list[int]], start: int, rank: int) -> list[int]:
    """The pure group (pool-local ranks) holding global ``rank``, in global ranks."""
    return next([start + x for x in g] for g in groups if rank - start in g)


def check_mesh(name: str, lay: FsdpLayout | UlyssesLayout, start: int, rank: int) -> int:
    mesh = lay.build("cpu", start=start)
    inside = start <= rank < start + lay.size
    assert (mesh is not None) == inside, f"{name}: mesh on rank {rank} inside={inside}"
    if mesh is None:
        return 0
    coords = lay.coords(rank - start)
    assert mesh.mesh_dim_names == lay.mesh_dim_names
    assert mesh.get_coordinate() == tuple(coords[a] for a in lay.mesh_dim_names), name
    pure = lay.groups()
    for axis in lay.mesh_dim_names:
        _check_group(f"{name}.{axis}", mesh.get_group(axis), _my_group(pure[axis], start, rank), rank)
        assert mesh.get_local_rank(axis) == coords[axis]
    return len(lay.mesh_dim_names)


def check_groups(name: str, lay: RolloutLayout | MegatronLayout, start: int, rank: int) -> int:
    real = lay.build(start=start)
    inside = start <= rank < start + lay.size
    if not inside:
        assert real == {}, f"{name}: rank {rank} outside the pool got groups {list(real)}"
        return 0
    pure = lay.groups()
    assert set(real) == set(pure), name
    for axis, groups in pure.items():
        _check_group(f"{name}.{axis}", real[axis], _my_group(groups, start, rank), rank)
    return len(pure)


def check_pools(world_size: int, reward_ranks: int, rank: int) -> Pools:
    specs = plan_pools(world_size, reward_ranks=reward_ranks)
    pools = Pools.build(specs)
    assert pools.names == [s.name for s in specs]
    for s in specs:
        pool = pools.get(s.name)
        if s.contains(rank):
            assert pool.rank == rank - s.start and pool.size == s.size and pool.is_member
            _check_group(f"pool {s.name}", pool.group, s.ranks, rank)
        else:
            assert pool.group is None and pool.rank is None
    assert pools.member_of() == [s.name for s in specs if s.contains(rank)]
    assert [p.name for p in pools.mine()] == pools.member_of()
    assert (pools.get_optional("reward") is None) == (reward_ranks == 0)
    try:
        pools.get("actor")
    except ValueError as e:
        assert "pools of this run: global" in str(e)
    else:
        raise AssertionError("Pools.get('actor') did not raise")
    return pools


def body_4(rank: int, world_size: int) -> int:
    checked = 0
    pools = check_pools(world_size, 0, rank)
    assert pools.get("global").group is dist.group.WORLD
    for lay in (FsdpLayout(4), FsdpLayout(4, 2), UlyssesLayout(4, 2), UlyssesLayout(4, 1)):
        checked += check_mesh(repr(lay), lay, 0, rank)
    for lay in (RolloutLayout(4, 2), RolloutLayout(4, 1, 2), RolloutLayout(4, 2, 2), MegatronLayout(4, tp=2),
                MegatronLayout(4, pp=2, vpp=2), MegatronLayout(4, tp=2, pp=2), MegatronLayout(4, cp=2),
                MegatronLayout(4, ep=2), MegatronLayout(4, tp=2, ep=4, etp=1)):
        checked += check_groups(repr(lay), lay, 0, rank)
    # 3 global + 1 reward: meshes over a subset of the world, including one not starting at 0
    pools = check_pools(world_size, 1, rank)
    g, r = pools.get("global").spec, pools.get("reward").spec
    checked += check_mesh("global fsdp", FsdpLayout(g.size), g.start, rank)
    checked += check_mesh("global ulysses", UlyssesLayout(g.size, 3), g.start, rank)
    checked += check_groups("global rollout", RolloutLayout(g.size, 3), g.start, rank)
    checked += check_mesh("reward fsdp", FsdpLayout(r.size, pool="reward"), r.start, rank)
    checked += check_groups("reward rollout", RolloutLayout(r.size, pool="reward"), r.start, rank)
    dist.barrier()
    return checked


def body_8(rank: int, world_size: int) -> int:
    checked = 0
    check_pools(world_size, 0, rank)
    for lay in (FsdpLayout(8), FsdpLayout(8, 4), FsdpLayout(8, 2), UlyssesLayout(8, 2), UlyssesLayout(8, 4)):
        checked += check_mesh(repr(lay), lay, 0, rank)
    for lay in (RolloutLayout(8, 2, 2), RolloutLayout(8, 4), MegatronLayout(8, tp=2), MegatronLayout(8, tp=2, pp=2),
                MegatronLayout(8, tp=2, cp=2), MegatronLayout(8, tp=2, ep=2), MegatronLayout(8, tp=2, ep=4, etp=1),
                MegatronLayout(8, tp=2, pp=2, order="tp-cp-ep-pp-dp")):
        checked += check_groups(repr(lay), lay, 0, rank)
    # 6 global + 2 reward: HSDP and Ulysses on the global pool together, FSDP on the reward pool
    pools = check_pools(world_size, 2, rank)
    g, r = pools.get("global").spec, pools.get("reward").spec
    checked += check_mesh("global hsdp", FsdpLayout(g.size, 3), g.start, rank)
    checked += check_mesh("global ulysses", UlyssesLayout(g.size, 2), g.start, rank)
    checked += check_groups("global megatron", MegatronLayout(g.size, tp=3), g.start, rank)
    checked += check_mesh("reward fsdp", FsdpLayout(r.size, pool="reward"), r.start, rank)
    checked += check_mesh("reward hsdp", FsdpLayout(r.size, 1, pool="reward"), r.start, rank)
    dist.barrier()
    return checked


def test_groups_on_4_processes() -> None:
    checked = run_distributed(body_4, 4)
    assert all(c > 40 for c in checked), checked


def test_groups_on_8_processes() -> None:
    checked = run_distributed(body_8, 8)
    assert all(c > 40 for c in checked), checked
