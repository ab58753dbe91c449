"""A run's plan: every parallel layout and batch-size rule, validated together before any process
group exists.

    p = plan(cfg, world_size=16, nproc_per_node=8)      # ValueError naming the flags and numbers
    p.fsdp.groups(), p.rollout.coords(3), p.pool("reward"), p.actor_dp_rank(5)

The trainer, ``python -m spmd_rl.train`` (before the first group) and the layout tool
(``python -m spmd_rl.layout``) all call :func:`plan`; the layouts themselves live in
:mod:`spmd_rl.distributed.dims`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spmd_rl.distributed.dims import FsdpLayout, MegatronLayout, RolloutLayout, UlyssesLayout
from spmd_rl.distributed.pools import REWARD, PoolSpec, get_spec, member_of, plan_pools

if TYPE_CHECKING:
    from spmd_rl.config import Config


@dataclass(frozen=True)
class Plan:
    """Every layout of a run, validated together by :func:`plan` before any process group exists.

    Layouts are over pool-local ranks of the pool they live in (``global`` for the actor,
    reference and rollout; ``reward`` for a separate reward pool). A layout of the engine not in
    use is ``None`` when invalid, with the reason in ``unavailable``.
    """

    world_size: int
    nproc_per_node: int | None
    engine: str
    pools: tuple[PoolSpec, ...]
    fsdp: FsdpLayout | None
    ulysses: UlyssesLayout | None
    megatron: MegatronLayout | None
    rollout: RolloutLayout
    reward_fsdp: FsdpLayout | None
    actor_dp_size: int
    """Data-parallel size of the actor: pool size / ulysses_size (fsdp) or megatron dp."""
    rollout_prompts_per_replica: int
    """data.train_batch_size / rollout dp size: prompts each rollout model replica generates for."""
    actor_prompts_per_mini_batch: int
    """actor.ppo_mini_batch_size / actor dp size: prompts per actor dp rank in one mini-batch."""
    unavailable: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def rollout_dp_size(self) -> int:
        return self.rollout.dp_size

    @property
    def global_pool(self) -> PoolSpec:
        return self.pools[0]

    def pool(self, name: str) -> PoolSpec:
        """The pool called ``name``; ValueError listing the valid names otherwise."""
        return get_spec(self.pools, name)

    def pool_optional(self, name: str) -> PoolSpec | None:
        return next((p for p in self.pools if p.name == name), None)

    def member_of(self, rank: int) -> list[str]:
        return member_of(self.pools, rank)

    @property
    def num_nodes(self) -> int | None:
        return None if self.nproc_per_node is None else self.world_size // self.nproc_per_node

    def node(self, rank: int) -> int | None:
        """Node index of global ``rank`` (``rank // nproc_per_node``), None when unknown."""
        return None if self.nproc_per_node is None else rank // self.nproc_per_node

    def local_rank(self, rank: int) -> int | None:
        """Rank within its node (the GPU index), None when nproc_per_node is unknown."""
        return None if self.nproc_per_node is None else rank % self.nproc_per_node

    def actor_dp_rank(self, local_rank: int) -> int:
        """Actor data-parallel ("batch") index of a global-pool-local rank."""
        if self.engine == "megatron":
            return self.megatron.coords(local_rank)["dp"]  # type: ignore[union-attr]
        return self.ulysses.coords(local_rank)["dp"]  # type: ignore[union-attr]

    def rollout_dp_rank(self, local_rank: int) -> int:
        """Rollout replica index of a global-pool-local rank."""
        return self.rollout.coords(local_rank)["dp"]

    def layouts(self) -> dict[str, tuple[PoolSpec, Any]]:
        """Available layouts by mesh name (``fsdp``, ``ulysses``, ``megatron``, ``rollout``,
        ``reward.fsdp``) with the pool each lives in."""
        g = self.global_pool
        out: dict[str, tuple[PoolSpec, Any]] = {}
        for name, lay in (("fsdp", self.fsdp), ("ulysses", self.ulysses), ("megatron", self.megatron), ("rollout", self.rollout)):
            if lay is not None:
                out[name] = (g, lay)
        if self.reward_fsdp is not None:
            out[f"{REWARD}.fsdp"] = (self.pool(REWARD), self.reward_fsdp)
        return out


def plan(cfg: Config, world_size: int, nproc_per_node: int | None = None) -> Plan:
    """Validate a run's layouts and batch sizes for ``world_size`` processes; no process group needed.

    Raises ``ValueError`` naming the flags and numbers of the first rule broken.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if nproc_per_node is not None and (nproc_per_node < 1 or world_size % nproc_per_node):
        raise ValueError(
            f"nproc_per_node ({nproc_per_node}) must be >= 1 and divide the world size ({world_size})"
        )
    specs = plan_pools(world_size, cfg.pools.reward_ranks)
    g = specs[0]
    engine = cfg.actor.engine
    unavailable: dict[str, str] = {}

    def make(name: str, required: bool, factory: Any) -> Any:
        try:
            return factory()
        except ValueError as e:
            if required:
                raise
            unavailable[name] = str(e)
            return None

    fc, mc = cfg.actor.fsdp, cfg.actor.megatron
    fsdp = make("fsdp", engine == "fsdp", lambda: FsdpLayout(g.size, fc.fsdp_size))
    ulysses = make("ulysses", engine == "fsdp", lambda: UlyssesLayout(g.size, fc.ulysses_size))
    megatron = make("megatron", engine == "megatron", lambda: MegatronLayout(
        g.size, tp=mc.tp, pp=mc.pp, cp=mc.cp, ep=mc.ep, etp=mc.etp, vpp=mc.vpp, order=mc.order))
    rollout = RolloutLayout(g.size, cfg.rollout.tp, cfg.rollout.pp)
    reward = specs[1] if len(specs) > 1 else None
    reward_fsdp = FsdpLayout(reward.size, -1, pool=REWARD) if reward else None

    tb, mb = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    rdp = rollout.dp_size
    if tb % rdp:
        raise ValueError(
            f"data.train_batch_size ({tb}) must be divisible by the rollout data-parallel size ({rdp}) = "
            f"global pool size ({g.size}) / (rollout.tp ({rollout.tp}) * rollout.pp ({rollout.pp})), "
            f"so every rollout replica gets the same number of prompts"
        )
    if engine == "megatron":
        adp = megatron.dp_size
        why = (f"global pool size ({g.size}) / (actor.megatron.tp ({mc.tp}) * actor.megatron.pp ({mc.pp}) * "
               f"actor.megatron.cp ({mc.cp}))")
    else:
        adp = ulysses.dp_size
        why = f"global pool size ({g.size}) / actor.fsdp.ulysses_size ({fc.ulysses_size})"
    if tb % adp:
        raise ValueError(f"data.train_batch_size ({tb}) must be divisible by the actor data-parallel size ({adp}) = {why}")
    if mb % adp:
        raise ValueError(
            f"actor.ppo_mini_batch_size ({mb}) must be divisible by the actor data-parallel size ({adp}) = {why}, "
            f"so that all rollout.n ({cfg.rollout.n}) responses of a prompt stay on one rank"
        )
    mp = rollout.tp * rollout.pp
    if (tb // rdp) * cfg.rollout.n % mp:
        raise ValueError(
            f"data.train_batch_size ({tb}) / rollout data-parallel size ({rdp}) * rollout.n ({cfg.rollout.n}) = "
            f"{tb // rdp * cfg.rollout.n} responses per rollout replica must be divisible by rollout.tp ({rollout.tp}) "
            f"* rollout.pp ({rollout.pp}), so that every rank of a replica keeps the same share"
        )
    if cfg.rollout.backend == "vllm" and reward is not None:
        raise ValueError(
            f"rollout.backend=vllm lays its groups over the whole world, so every rank must be in the global pool: "
            f"set --pools.reward-ranks 0 (got {cfg.pools.reward_ranks}) or use --rollout.backend native"
        )
    return Plan(
        world_size=world_size, nproc_per_node=nproc_per_node, engine=engine, pools=tuple(specs),
        fsdp=fsdp, ulysses=ulysses, megatron=megatron, rollout=rollout, reward_fsdp=reward_fsdp,
        actor_dp_size=adp, rollout_prompts_per_replica=tb // rdp, actor_prompts_per_mini_batch=mb // adp,
        unavailable=unavailable,
    )


__all__ = ["Plan", "plan"]
