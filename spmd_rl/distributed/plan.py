"""A run's plan: every parallel layout and batch-size rule, validated together before any process
group exists.

    p = plan(cfg, world_size=16, nproc_per_node=8)      # ValueError naming the flags and numbers
    p.fsdp.groups(), p.rollout.coords(3), p.pool("reward"), p.dp_rank(5), p.counts_in_sums(5)

:func:`plan` is the one judge of a run's configuration: every rule that spans config sections or
depends on the world size is checked here, before any process group exists (a section's own rules
live in its ``__post_init__``; an engine checks only what it alone can know, such as a model's head
count against tp). ``python -m spmd_rl.train``, the trainer and the layout tool
(``python -m spmd_rl.layout``) all call it. The layouts live in :mod:`spmd_rl.distributed.dims`;
what differs between training engines and rollout backends comes from their registries
(:mod:`spmd_rl.engine`, :mod:`spmd_rl.rollout`), so nothing here branches on their names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spmd_rl.distributed.dims import ActorLayout, FsdpLayout, MegatronLayout, RolloutLayout, UlyssesLayout
from spmd_rl.distributed.pools import REWARD, PoolSpec, get_spec, member_of, plan_pools
from spmd_rl.engine import ENGINES, engine_spec
from spmd_rl.rollout import backend_spec

if TYPE_CHECKING:
    from spmd_rl.config import Config


@dataclass(frozen=True)
class Plan:
    """Every layout of a run, validated together by :func:`plan` before any process group exists.

    Layouts are over pool-local ranks of the pool they live in (``global`` for the actor,
    reference and rollout; ``reward`` for a separate reward pool). ``actor`` is the engine's batch
    view; the layouts of every registered engine that is valid for this pool are kept too (the
    layout tool lists them), those that are not are ``None`` with the reason in ``unavailable``.
    """

    world_size: int
    nproc_per_node: int | None
    engine: str
    pools: tuple[PoolSpec, ...]
    actor: ActorLayout
    """The actor's data-parallel ("batch") layout over the global pool, whatever the engine."""
    actor_meshes: tuple[str, ...]
    """Names of the layouts that belong to the engine in use (``("fsdp", "ulysses")`` / ``("megatron",)``)."""
    layouts_by_name: dict[str, Any] = field(hash=False, repr=False)
    rollout: RolloutLayout
    reward_fsdp: FsdpLayout | None
    rollout_prompts_per_replica: int
    """data.train_batch_size / rollout dp size: prompts each rollout model replica generates for."""
    actor_prompts_per_mini_batch: int
    """actor.ppo_mini_batch_size / actor dp size: prompts per actor dp rank in one mini-batch."""
    unavailable: dict[str, str] = field(default_factory=dict, hash=False)
    warnings: tuple[str, ...] = ()
    """What is valid now but will fail where the run starts (e.g. a missing library)."""

    # ---- the actor's batch view: the trainer asks these, never the engine's name
    @property
    def dp_size(self) -> int:
        """Data-parallel size of the actor."""
        return self.actor.dp_size

    def dp_rank(self, rank: int) -> int:
        """Actor data-parallel ("batch") index of a global-pool-local rank."""
        return self.actor.dp_rank(rank)

    def counts_in_sums(self, rank: int) -> bool:
        """Whether global-pool-local ``rank`` adds its rows to sums over the pool (one rank per dp group)."""
        return self.actor.counts_in_sums(rank)

    # ---- every layout by mesh name
    @property
    def fsdp(self) -> FsdpLayout | None:
        return self.layouts_by_name.get("fsdp")

    @property
    def ulysses(self) -> UlyssesLayout | None:
        return self.layouts_by_name.get("ulysses")

    @property
    def megatron(self) -> MegatronLayout | None:
        return self.layouts_by_name.get("megatron")

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

    def layouts(self) -> dict[str, tuple[PoolSpec, Any]]:
        """Available layouts by mesh name (``fsdp``, ``ulysses``, ``megatron``, ``rollout``,
        ``reward.fsdp``) with the pool each lives in."""
        g = self.global_pool
        out: dict[str, tuple[PoolSpec, Any]] = {}
        for name, lay in (*self.layouts_by_name.items(), ("rollout", self.rollout)):
            if lay is not None:
                out[name] = (g, lay)
        if self.reward_fsdp is not None:
            out[f"{REWARD}.fsdp"] = (self.pool(REWARD), self.reward_fsdp)
        return out


def plan(cfg: Config, world_size: int, nproc_per_node: int | None = None) -> Plan:
    """Validate a run's layouts, batch sizes and cross-section rules for ``world_size`` processes;
    no process group needed.

    Raises ``ValueError`` naming the flags and numbers of the first rule broken.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if nproc_per_node is not None and (nproc_per_node < 1 or world_size % nproc_per_node):
        raise ValueError(
            f"nproc_per_node ({nproc_per_node}) must be >= 1 and divide the world size ({world_size})"
        )
    _check_sections(cfg)
    specs = plan_pools(world_size, cfg.pools.reward_ranks)
    g = specs[0]
    engine, backend = engine_spec(cfg.actor.engine), backend_spec(cfg.rollout.backend)
    unavailable: dict[str, str] = {}
    layouts: dict[str, Any] = {}
    for name, spec in ENGINES.items():  # the engine in use must be valid; the others are shown when they are
        try:
            layouts.update(spec.layouts(cfg.actor, g.size))
        except ValueError as e:
            if spec is engine:
                raise
            layouts.update({mesh: None for mesh in spec.meshes})
            unavailable.update({mesh: str(e) for mesh in spec.meshes})
    actor: ActorLayout = layouts[engine.batch_layout]
    rollout = RolloutLayout(g.size, cfg.rollout.tp, cfg.rollout.pp)
    reward = specs[1] if len(specs) > 1 else None
    reward_fsdp = FsdpLayout(reward.size, -1, pool=REWARD) if reward else None

    _check_pools(cfg, reward=reward, engine_whole_world=engine.whole_world, backend_whole_world=backend.whole_world)
    ignored = engine.ignored_flags(cfg.actor)
    if ignored:
        raise ValueError(f"{', '.join(ignored)} apply to actor.engine=fsdp only; unset them for "
                         f"actor.engine={cfg.actor.engine} (which uses actor.micro_batch_size)")
    if not backend.model_parallel and rollout.tp * rollout.pp > 1:
        raise ValueError(
            f"rollout.tp ({rollout.tp}) * rollout.pp ({rollout.pp}) > 1 needs a sharded rollout engine; "
            f"rollout.backend={cfg.rollout.backend} holds a whole model per rank: use --rollout.tp 1 "
            f"--rollout.pp 1 or --rollout.backend vllm")
    backend.check(cfg.rollout)

    tb, mb = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    rdp = rollout.dp_size
    if tb % rdp:
        raise ValueError(
            f"data.train_batch_size ({tb}) must be divisible by the rollout data-parallel size ({rdp}) = "
            f"global pool size ({g.size}) / (rollout.tp ({rollout.tp}) * rollout.pp ({rollout.pp})), "
            f"so every rollout replica gets the same number of prompts"
        )
    adp = actor.dp_size
    if tb % adp:
        raise ValueError(f"data.train_batch_size ({tb}) must be divisible by the actor data-parallel size ({adp}) = "
                         f"{actor.dp_formula}")
    if mb % adp:
        raise ValueError(
            f"actor.ppo_mini_batch_size ({mb}) must be divisible by the actor data-parallel size ({adp}) = "
            f"{actor.dp_formula}, so that all rollout.n ({cfg.rollout.n}) responses of a prompt stay on one rank"
        )
    mp = rollout.tp * rollout.pp
    if (tb // rdp) * cfg.rollout.n % mp:
        raise ValueError(
            f"data.train_batch_size ({tb}) / rollout data-parallel size ({rdp}) * rollout.n ({cfg.rollout.n}) = "
            f"{tb // rdp * cfg.rollout.n} responses per rollout replica must be divisible by rollout.tp ({rollout.tp}) "
            f"* rollout.pp ({rollout.pp}), so that every rank of a replica keeps the same share"
        )
    return Plan(
        world_size=world_size, nproc_per_node=nproc_per_node, engine=cfg.actor.engine, pools=tuple(specs),
        actor=actor, actor_meshes=engine.meshes, layouts_by_name=layouts, rollout=rollout,
        reward_fsdp=reward_fsdp, rollout_prompts_per_replica=tb // rdp, actor_prompts_per_mini_batch=mb // adp,
        unavailable=unavailable, warnings=tuple(engine.warnings(cfg.actor)),
    )


def _check_sections(cfg: Config) -> None:
    """Rules between config sections that need no world size."""
    tb, mb = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if mb > tb:
        raise ValueError(f"actor.ppo_mini_batch_size ({mb}) must be <= data.train_batch_size ({tb})")
    if tb % mb:
        raise ValueError(f"actor.ppo_mini_batch_size ({mb}) must divide data.train_batch_size ({tb})")
    if cfg.rollout.n == 1 and cfg.algo.adv_estimator in ("grpo", "rloo"):
        # A group of one has no baseline (spmd_rl.algo.advantages): its advantage is the raw score.
        raise ValueError(
            f"rollout.n=1 makes every prompt's group a single response, so algo.adv_estimator="
            f"{cfg.algo.adv_estimator} has nothing to compare it with: its advantage is the raw score, with no "
            f"baseline; use --rollout.n 2 or more, or --algo.adv-estimator reinforce_pp_baseline (whose baseline "
            f"is then the batch's mean)")
    budget, longest = cfg.actor.max_tokens_per_gpu, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    sp = cfg.actor.fsdp.ulysses_size
    if budget is not None and budget * sp < longest:
        raise ValueError(
            f"actor.max_tokens_per_gpu ({budget}) * actor.fsdp.ulysses_size ({sp}) must be >= "
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) = {longest}, the longest sequence")


def _check_pools(cfg: Config, *, reward: PoolSpec | None, engine_whole_world: bool, backend_whole_world: bool) -> None:
    """Which roles may have pools of their own."""
    if reward is None:
        return
    if cfg.reward.model.path is None:
        raise ValueError(f"pools.reward_ranks={cfg.pools.reward_ranks} makes a reward pool, but reward.model.path "
                         "is not set, so it would serve nothing: set --reward.model.path or --pools.reward_ranks 0")
    if engine_whole_world:
        raise ValueError(
            f"actor.engine={cfg.actor.engine} builds its groups over the whole world, so it cannot run with a "
            f"separate reward pool (pools.reward_ranks={cfg.pools.reward_ranks}): set --pools.reward-ranks 0 "
            f"(the reward model then runs colocated)")
    if backend_whole_world:
        raise ValueError(
            f"rollout.backend={cfg.rollout.backend} lays its groups over the whole world, so every rank must be in "
            f"the global pool: set --pools.reward-ranks 0 (got {cfg.pools.reward_ranks}) or use --rollout.backend native")


__all__ = ["Plan", "plan"]
