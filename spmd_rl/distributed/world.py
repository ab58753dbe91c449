"""The run's process groups, built once on every rank of the world before the pools part ways.

    run_plan = plan(cfg, env.world_size, env.local_world_size)     # spmd_rl.distributed.plan
    groups = build_run_groups(run_plan, env, close_timeout_s=60)   # collective over the whole world
    if groups.in_reward_pool: ... RewardServer ...           # spmd_rl.train dispatches here
    else: Trainer(cfg, env, groups=groups)

Creating a process group or a DeviceMesh is collective over the WHOLE world, even for a pool that
is a subset of it, so every rank creates every pool's groups and meshes here, in one order, before
the global and reward ranks run different loops. The rank table is gathered here too (every rank
contributes its host and device), so it covers the reward ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spmd_rl.distributed.comm import PoolExchange
from spmd_rl.distributed.env import DistEnv, gather_rank_table
from spmd_rl.distributed.pools import GLOBAL, REWARD, Pools

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from spmd_rl.distributed.plan import Plan


@dataclass
class RunGroups:
    """Pools, meshes, rank table and the cross-pool exchange of one run, as this rank sees them."""

    plan: Plan
    pools: Pools
    rank_table: list[dict[str, object]]
    """Every rank's row (rank, node, host, local rank, device, pools with pool-local ranks)."""
    actor_mesh: DeviceMesh | None
    """The actor's FSDP mesh over the global pool (None on reward ranks, or for the megatron engine)."""
    reward_mesh: DeviceMesh | None
    """The reward model's FSDP mesh over the reward pool (None without one, and on global ranks)."""
    exchange: PoolExchange | None
    """Global pool (clients) <-> reward pool (servers); None without a reward pool."""
    sp_group: ProcessGroup | None = None
    """This rank's Ulysses sequence-parallel group (``actor.fsdp.ulysses_size`` > 1), else None."""

    @property
    def in_reward_pool(self) -> bool:
        pool = self.pools.get_optional(REWARD)
        return pool is not None and pool.is_member


def build_run_groups(plan: Plan, env: DistEnv, *, close_timeout_s: float = 60.0) -> RunGroups:
    """Create every pool, mesh and the exchange (collective over the world; see the module docstring)."""
    pools = Pools.build(plan.pools)
    pool_ranks = {r: {spec.name: spec.local_rank(r) for spec in plan.pools if spec.contains(r)}
                  for r in range(env.world_size)}
    rows = gather_rank_table(env, pool_ranks)
    device_type = env.device.type
    actor_mesh = plan.fsdp.build(device_type, start=plan.pool(GLOBAL).start) if plan.fsdp is not None else None
    sp_group = None
    if "ulysses" in plan.actor_meshes and plan.ulysses is not None and plan.ulysses.sp_enabled:
        sp_mesh = plan.ulysses.build(device_type, start=plan.pool(GLOBAL).start)  # [dp, sp]
        sp_group = sp_mesh["sp"].get_group() if sp_mesh is not None else None
    reward = plan.pool_optional(REWARD)
    reward_mesh, exchange = None, None
    if reward is not None:
        assert plan.reward_fsdp is not None
        reward_mesh = plan.reward_fsdp.build(device_type, start=reward.start)
        exchange = PoolExchange(clients=plan.pool(GLOBAL).ranks, servers=reward.ranks, close_timeout_s=close_timeout_s)
    return RunGroups(plan=plan, pools=pools, rank_table=rows, actor_mesh=actor_mesh, reward_mesh=reward_mesh,
                     exchange=exchange, sp_group=sp_group)


__all__ = ["RunGroups", "build_run_groups"]
