"""The run's process groups, built once on every rank of the world before the pools part ways.

    run_plan = plan(cfg, env.world_size, env.local_world_size)     # spmd_rl.plan
    groups = build_run_groups(run_plan, env, close_timeout_s=60)   # collective over the whole world
    groups.role       # "trainer" (global pool), "rollout", "teacher" or "reward": spmd_rl.train dispatches
    Trainer(cfg, env, groups=groups)                               # on the global pool

Creating a process group or a DeviceMesh is collective over the WHOLE world, even for a pool that
is a subset of it, so every rank creates every pool's groups and meshes here, in one order, before
the pools run different loops: the actor's meshes, the reward and teacher pools' FSDP meshes, the
weight bridges from the actor to a rollout pool, the rollout backend's own groups over its pool
when that pool is not the whole world (vLLM's, :mod:`spmd_rl.rollout.vllm_groups`), and the links
between the actor pool and each serving pool. The rank table is gathered here too (every rank
contributes its host and device), so it covers every pool. It sits above :mod:`spmd_rl.distributed`,
the engines and the roles whose links it builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spmd_rl.distributed.bridge import WeightBridge
from spmd_rl.distributed.env import DistEnv, gather_rank_table
from spmd_rl.distributed.pools import GLOBAL, REWARD, ROLLOUT, TEACHER, Pools

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from spmd_rl.distill import TeacherLink
    from spmd_rl.distributed.service import ServiceLink
    from spmd_rl.plan import Plan
    from spmd_rl.reward.server import RewardLink
    from spmd_rl.rollout.pool import RolloutLink


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
    exchange: RewardLink | None
    """Global pool (clients) <-> reward pool (servers); None without a reward pool."""
    sp_group: ProcessGroup | None = None
    """This rank's Ulysses sequence-parallel group (``actor.fsdp.ulysses_size`` > 1), else None."""
    weight_bridge: WeightBridge | None = None
    """This rank's end of the actor -> rollout weight transfer (separate rollout pool): on the
    rollout ranks and the actor ranks that send; None elsewhere."""
    teacher_mesh: DeviceMesh | None = None
    """The teacher's FSDP mesh over the teacher pool (``pools.teacher_ranks`` > 0), on its ranks."""
    rollout_link: RolloutLink | None = None
    """The actor pool <-> rollout pool link (separate rollout pool), on the ranks of both; else None."""
    teacher_link: TeacherLink | None = None
    """The actor pool <-> teacher pool link (``pools.teacher_ranks`` > 0), on the ranks of both; else None."""
    rollout_pool_groups: Any = None
    """The rollout backend's process groups over the rollout's pool (``BackendSpec.pool_groups``), on
    that pool's ranks when it is not the whole world; else None."""

    @property
    def links(self) -> dict[str, ServiceLink]:
        """This rank's ends of the links to the serving pools, by role (each on the service protocol,
        :mod:`spmd_rl.distributed.service`)."""
        links = {REWARD: self.exchange, ROLLOUT: self.rollout_link, TEACHER: self.teacher_link}
        return {role: link for role, link in links.items() if link is not None}

    def _member(self, name: str) -> bool:
        pool = self.pools.get_optional(name)
        return pool is not None and pool.is_member

    @property
    def in_reward_pool(self) -> bool:
        return self._member(REWARD)

    @property
    def in_rollout_pool(self) -> bool:
        return self._member(ROLLOUT)

    @property
    def in_teacher_pool(self) -> bool:
        return self._member(TEACHER)

    @property
    def role(self) -> str:
        """The loop this rank runs: ``trainer`` (global pool), ``rollout``, ``teacher`` or ``reward``."""
        for name in (ROLLOUT, TEACHER, REWARD):
            if self._member(name):
                return name
        return "trainer"


def build_run_groups(plan: Plan, env: DistEnv, *, close_timeout_s: float = 60.0) -> RunGroups:
    """Create every pool, mesh and the exchange (collective over the world; see the module docstring)."""
    pools = Pools.build(plan.pools)
    pool_ranks = {r: {spec.name: spec.local_rank(r) for spec in plan.pools if spec.contains(r)}
                  for r in range(env.world_size)}
    rows = gather_rank_table(env, pool_ranks)
    device_type = env.device.type
    actor_mesh = plan.fsdp.build(device_type, start=plan.pool(GLOBAL).start) if plan.fsdp is not None else None
    if "megatron" in plan.actor_meshes and plan.pool(GLOBAL).size < env.world_size:
        # megatron-core's groups over the global pool (ranks 0..size-1), created on every rank of the world
        from spmd_rl.engine.megatron.groups import create_model_parallel_groups

        create_model_parallel_groups(plan.megatron)
    sp_group = None
    if "ulysses" in plan.actor_meshes and plan.ulysses is not None and plan.ulysses.sp_enabled:
        sp_mesh = plan.ulysses.build(device_type, start=plan.pool(GLOBAL).start)  # [dp, sp]
        sp_group = sp_mesh["sp"].get_group() if sp_mesh is not None else None
    reward = plan.pool_optional(REWARD)
    reward_mesh, exchange = None, None
    if reward is not None:
        assert plan.reward_fsdp is not None
        reward_mesh = plan.reward_fsdp.build(device_type, start=reward.start)
        from spmd_rl.reward.server import RewardLink

        exchange = RewardLink(clients=plan.pool(GLOBAL).ranks, servers=reward.ranks, close_timeout_s=close_timeout_s)
    bridge, link = _weight_bridge(plan, env), None
    if plan.rollout_separate and (plan.pool(GLOBAL).contains(env.rank) or plan.pool(ROLLOUT).contains(env.rank)):
        from spmd_rl.rollout.pool import RolloutLink, routes_of

        link = RolloutLink(routes=routes_of(plan), bridge=bridge, close_timeout_s=close_timeout_s)
    teacher = plan.pool_optional(TEACHER)
    teacher_mesh, teacher_link = None, None
    if teacher is not None:
        assert plan.teacher_fsdp is not None
        teacher_mesh = plan.teacher_fsdp.build(device_type, start=teacher.start)
        if plan.pool(GLOBAL).contains(env.rank) or teacher.contains(env.rank):
            from spmd_rl.distill import TeacherLink, TeacherRoutes

            actor = plan.pool(GLOBAL)
            routes = TeacherRoutes(actor_pool=actor, teacher_pool=teacher,
                                   actor_dp=tuple(plan.dp_rank(k) for k in range(actor.size)))
            teacher_link = TeacherLink(routes=routes, close_timeout_s=close_timeout_s)
    return RunGroups(plan=plan, pools=pools, rank_table=rows, actor_mesh=actor_mesh, reward_mesh=reward_mesh,
                     exchange=exchange, sp_group=sp_group, weight_bridge=bridge, rollout_link=link,
                     teacher_mesh=teacher_mesh, teacher_link=teacher_link,
                     rollout_pool_groups=_rollout_pool_groups(plan, env))


def _rollout_pool_groups(plan: Plan, env: DistEnv) -> Any:
    """The rollout backend's groups over its pool (collective over the world), this rank's share if it
    is in that pool; None when the backend needs none or its pool is the whole world."""
    from spmd_rl.rollout import backend_spec

    build, pool = backend_spec(plan.rollout_backend).pool_groups, plan.rollout_pool
    if build is None or pool.size == env.world_size:
        return None
    made = build(pool_ranks=pool.ranks, tp=plan.rollout.tp, pp=plan.rollout.pp, device_type=env.device.type)
    return made if pool.contains(env.rank) else None


def _weight_bridge(plan: Plan, env: DistEnv) -> WeightBridge | None:
    """The actor -> rollout weight bridges (collective over the world: every rank creates every group).

    One process per GPU: one group, actor rank 0 and every rollout rank, broadcasting over the
    device backend. Several per GPU (``pools.colocate`` > 1): one gloo group per rollout rank with
    the actor rank on the same GPU (CUDA IPC on GPUs; NCCL cannot hold two ranks of one device).
    """
    import torch.distributed as dist

    rollout = plan.pool_optional(ROLLOUT)
    if rollout is None:
        return None
    actor = plan.pool(GLOBAL)
    me = env.rank
    if plan.colocate == 1:
        ranks = [actor.start, *rollout.ranks]
        group = dist.new_group(ranks)
        return WeightBridge(group=group, sender=actor.start, device=env.device) if me in ranks else None
    mine = None
    for r in rollout.ranks:
        place = (plan.node(r), plan.gpu(r))
        sender = next((a for a in actor.ranks if (plan.node(a), plan.gpu(a)) == place), None)
        if sender is None:
            raise ValueError(f"rollout rank {r} (node {place[0]}, GPU {place[1]}) shares its GPU with no actor rank: with "
                             f"pools.colocate={plan.colocate} the actor pool must cover the rollout pool's GPUs")
        group = dist.new_group([sender, r], backend="gloo")
        if me in (sender, r):
            mode = "ipc" if env.device.type == "cuda" else "broadcast"
            if mine is not None:  # an actor rank paired with several rollout ranks: not a layout plan() allows
                raise ValueError(f"actor rank {me} would send weights to two rollout ranks")
            mine = WeightBridge(group=group, sender=sender, device=env.device, mode=mode)
    return mine


__all__ = ["RunGroups", "build_run_groups"]
