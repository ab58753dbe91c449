"""A run's plan: every parallel layout and batch-size rule, validated together before any process
group exists.

    p = plan(cfg, world_size=16, nproc_per_node=8)      # ValueError naming the flags and numbers
    p = plan(cfg, 2, model_shape=read_model_shape(cfg.model.path))   # + tp / pp / sp against the model's heads
    p = plan(cfg, 8, model_shape=shape, device_bytes=141 * 2**30)    # + each rank's memory against its GPU
    p.fsdp.groups(), p.rollout.coords(3), p.pool("reward"), p.dp_rank(5), p.counts_in_sums(5)

:func:`plan` is the one judge of a run's configuration: every rule that spans config sections or
depends on the world size is checked here, before any process group exists (a section's own rules
live in its ``__post_init__``). Given the model's shape (``model_shape``, read from its ``config.json``
or GGUF header by :func:`spmd_rl.models.shape.read_model_shape`; the trainer and the layout tool pass
it), it also refuses a tp / pp / sp degree that does not divide the model's heads or layers, through
the engine's and the backend's ``model_rules``; the engines check the same again once the model is
loaded. With the shape it also estimates each rank's memory (``Plan.memory``, :mod:`spmd_rl.memory`)
and, given the GPU's memory (``device_bytes``, from ``spmd_rl.train``), refuses a run whose estimate
exceeds it. ``python -m spmd_rl.train``, the trainer and the layout tool (``python -m spmd_rl.layout``)
all call it. The layouts live in :mod:`spmd_rl.distributed.dims`;
what differs between training engines and rollout backends comes from their registries
(:mod:`spmd_rl.engine`, :mod:`spmd_rl.rollout`), so nothing here branches on their names. It sits
above :mod:`spmd_rl.distributed` (which it reads, and which imports nothing of it) and those registries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spmd_rl.distributed.dims import ActorLayout, FsdpLayout, MegatronLayout, RolloutLayout, UlyssesLayout
from spmd_rl.distributed.pools import (
    GLOBAL, REWARD, ROLLOUT, TEACHER, PoolSpec, get_spec, gpu_of, gpus_per_node, member_of, plan_pools,
)
from spmd_rl.engine import ENGINES, engine_spec
from spmd_rl.memory import check_memory, estimate_memory
from spmd_rl.plan_rules import (
    check_backend, check_dapo, check_engine, check_episodes, check_in_flight, check_router_replay, check_sections,
    check_teacher, critic_warnings, rollout_warnings, staleness_warnings,
)
from spmd_rl.rollout import backend_spec

if TYPE_CHECKING:
    from spmd_rl.config import Config
    from spmd_rl.memory import MemoryEstimate
    from spmd_rl.models.shape import ModelShape


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
    """The rollout engine's layout over its pool (``rollout_pool``)."""
    reward_fsdp: FsdpLayout | None
    teacher_fsdp: FsdpLayout | None
    """The teacher's FSDP layout over its own pool (``pools.teacher_ranks`` > 0), else None."""
    rollout_prompts_per_replica: int
    """data.train_batch_size / rollout dp size: prompts each rollout model replica generates for."""
    actor_prompts_per_mini_batch: int
    """actor.ppo_mini_batch_size / actor dp size: prompts per actor dp rank in one mini-batch."""
    colocate: int = 1
    """Processes per GPU (``pools.colocate``)."""
    rollout_backend: str = "native"
    """``rollout.backend``: ``build_run_groups`` builds the groups its registry entry asks for."""
    memory_fractions: dict[str, float] = field(default_factory=dict, hash=False)
    """Per pool: the share of its GPU's memory each of its processes may allocate (only with
    ``pools.colocate`` > 1; empty otherwise: no cap)."""
    unavailable: dict[str, str] = field(default_factory=dict, hash=False)
    warnings: tuple[str, ...] = ()
    """What is valid now but will fail where the run starts (e.g. a missing library)."""
    model: ModelShape | None = None
    """The model's shape the layouts were checked against (None: not known, those checks not made)."""
    memory: MemoryEstimate | None = field(default=None, hash=False)
    """Each pool's per-rank memory estimate (:mod:`spmd_rl.memory`; None without the model's shape)."""

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
    def rollout_pool(self) -> PoolSpec:
        """The pool the rollout runs on: its own (``pools.rollout_ranks`` > 0) or the global one."""
        return self.pool_optional(ROLLOUT) or self.global_pool

    @property
    def rollout_separate(self) -> bool:
        return self.pool_optional(ROLLOUT) is not None

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
        """Rank within its node, None when nproc_per_node is unknown."""
        return None if self.nproc_per_node is None else rank % self.nproc_per_node

    def gpu(self, rank: int) -> int | None:
        """The GPU index on its node of global ``rank`` (``pools.colocate`` processes per GPU), None
        when nproc_per_node is unknown."""
        local = self.local_rank(rank)
        return None if local is None else gpu_of(local, self.nproc_per_node, self.colocate)  # type: ignore[arg-type]

    def layouts(self) -> dict[str, tuple[PoolSpec, Any]]:
        """Available layouts by mesh name (``fsdp``, ``ulysses``, ``megatron``, ``rollout``,
        ``reward.fsdp``) with the pool each lives in."""
        g = self.global_pool
        out: dict[str, tuple[PoolSpec, Any]] = {}
        for name, lay in self.layouts_by_name.items():
            if lay is not None:
                out[name] = (g, lay)
        out["rollout"] = (self.rollout_pool, self.rollout)
        if self.teacher_fsdp is not None:
            out[f"{TEACHER}.fsdp"] = (self.pool(TEACHER), self.teacher_fsdp)
        if self.reward_fsdp is not None:
            out[f"{REWARD}.fsdp"] = (self.pool(REWARD), self.reward_fsdp)
        return out


def plan(cfg: Config, world_size: int, nproc_per_node: int | None = None, *,
         model_shape: ModelShape | None = None, device_bytes: int | None = None) -> Plan:
    """Validate a run's layouts, batch sizes and cross-section rules for ``world_size`` processes;
    no process group needed. ``model_shape``: the model's heads and layers, checked against the
    engine's and the rollout's degrees, and each rank's memory estimated (None: neither).
    ``device_bytes``: one GPU's memory (None: a CPU run, or not known), which no rank's estimate may
    exceed unless ``--plan.no-memory-check`` (:func:`spmd_rl.memory.check_memory`).

    Raises ``ValueError`` naming the flags and numbers of the first rule broken.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if nproc_per_node is not None and (nproc_per_node < 1 or world_size % nproc_per_node):
        raise ValueError(
            f"nproc_per_node ({nproc_per_node}) must be >= 1 and divide the world size ({world_size})"
        )
    check_sections(cfg)
    check_dapo(cfg)
    pools = cfg.pools
    specs = plan_pools(world_size, rollout_ranks=pools.rollout_ranks, teacher_ranks=pools.teacher_ranks,
                       reward_ranks=pools.reward_ranks)
    g = specs[0]
    engine, backend = engine_spec(cfg.actor.engine), backend_spec(cfg.rollout.backend)
    layouts, unavailable = _engine_layouts(cfg, g.size, engine)
    actor: ActorLayout = layouts[engine.batch_layout]
    by_name = {s.name: s for s in specs}
    rollout_pool = by_name.get(ROLLOUT, g)
    rollout = RolloutLayout(rollout_pool.size, cfg.rollout.tp, cfg.rollout.pp, pool=rollout_pool.name)
    reward, teacher = by_name.get(REWARD), by_name.get(TEACHER)
    reward_fsdp = FsdpLayout(reward.size, -1, pool=REWARD) if reward else None
    teacher_fsdp = FsdpLayout(teacher.size, -1, pool=TEACHER) if teacher else None

    _check_pools(cfg, by_name)
    check_teacher(cfg, separate=teacher is not None, engine_meshes=engine.meshes)
    warnings = list(engine.warnings(cfg.actor)) + critic_warnings(cfg, engine_builds_critic=engine.critic)
    warnings += staleness_warnings(cfg, rollout_pool=ROLLOUT in by_name) + rollout_warnings(cfg)
    check_in_flight(cfg, rollout_pool=ROLLOUT in by_name, backend=backend)
    fractions = _memory_fractions(cfg, specs, world_size, nproc_per_node)
    check_engine(cfg, engine)
    check_backend(cfg, backend, rollout)
    check_episodes(cfg, backend, rollout_pool=ROLLOUT in by_name)
    check_router_replay(cfg, engine, backend, model_shape)
    if model_shape is not None:  # the model's heads and layers against tp / pp / sp
        engine.model_rules(cfg.actor, model_shape)
        backend.model_rules(cfg.rollout, model_shape)
    _check_batch_sizes(cfg, rollout, rollout_pool, actor)
    tb, mb = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    p = Plan(
        world_size=world_size, nproc_per_node=nproc_per_node, engine=cfg.actor.engine, pools=tuple(specs),
        actor=actor, actor_meshes=engine.meshes, layouts_by_name=layouts, rollout=rollout,
        reward_fsdp=reward_fsdp, teacher_fsdp=teacher_fsdp, rollout_prompts_per_replica=tb // rollout.dp_size,
        actor_prompts_per_mini_batch=mb // actor.dp_size, colocate=pools.colocate, memory_fractions=fractions,
        rollout_backend=cfg.rollout.backend,
        unavailable=unavailable, warnings=tuple(warnings), model=model_shape,
    )
    if model_shape is None:
        return p
    models = dict(engine=engine.memory, rollout=backend.memory, device_bytes=device_bytes)
    p = dataclasses.replace(p, memory=estimate_memory(cfg, p, model_shape, **models))
    if cfg.plan.memory_check:
        check_memory(cfg, p, model_shape, **models)
    return p


def _engine_layouts(cfg: Config, size: int, engine: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """Every registered engine's layouts over the global pool (``size`` ranks), by mesh name; those of
    an engine other than ``engine`` that are invalid here are None, with the reason in the second map.
    The engine in use must be valid (its ValueError propagates)."""
    unavailable: dict[str, str] = {}
    layouts: dict[str, Any] = {}
    for spec in ENGINES.values():
        try:
            layouts.update(spec.layouts(cfg.actor, size))
        except ValueError as e:
            if spec is engine:
                raise
            layouts.update({mesh: None for mesh in spec.meshes})
            unavailable.update({mesh: str(e) for mesh in spec.meshes})
    return layouts, unavailable


def _check_batch_sizes(cfg: Config, rollout: RolloutLayout, rollout_pool: PoolSpec, actor: ActorLayout) -> None:
    """The step's prompts split evenly over the rollout replicas, the actor's data-parallel ranks and
    the ranks of one rollout replica."""
    tb, mb = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    rdp = rollout.dp_size
    if tb % rdp:
        raise ValueError(
            f"data.train_batch_size ({tb}) must be divisible by the rollout data-parallel size ({rdp}) = "
            f"{rollout_pool.name} pool size ({rollout_pool.size}) / (rollout.tp ({rollout.tp}) * rollout.pp ({rollout.pp})), "
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


def _check_pools(cfg: Config, pools: dict[str, PoolSpec]) -> None:
    """Which roles may have pools of their own."""
    own = {name: spec for name, spec in pools.items() if name != GLOBAL}
    if REWARD in own and cfg.reward.model.path is None:
        raise ValueError(f"pools.reward_ranks={cfg.pools.reward_ranks} makes a reward pool, but reward.model.path "
                         "is not set, so it would serve nothing: set --reward.model.path or --pools.reward_ranks 0")
    if TEACHER in own and cfg.teacher.model.path is None:
        raise ValueError(f"pools.teacher_ranks={cfg.pools.teacher_ranks} makes a teacher pool, but teacher.model.path "
                         "is not set, so it would serve nothing: set --teacher.model.path or --pools.teacher-ranks 0")


def _memory_fractions(cfg: Config, specs: list[PoolSpec], world_size: int,
                      nproc_per_node: int | None) -> dict[str, float]:
    """Each pool's share of a GPU with ``pools.colocate`` > 1, checked so that the processes of one
    GPU never need more than all of it, and so that no two ranks of one pool share a GPU (NCCL
    puts one rank per device in a communicator)."""
    k = cfg.pools.colocate
    per_node = nproc_per_node if nproc_per_node is not None else world_size
    gpus = gpus_per_node(per_node, k)
    if k == 1:
        return {}
    rollout_share = cfg.rollout.gpu_memory_fraction  # < 1 (its own check): the others keep a share
    fractions: dict[str, float] = {}
    users: dict[tuple[int, int], list[tuple[str, int]]] = {}  # (node, gpu) -> [(pool, rank)]
    for spec in specs:
        for r in spec.ranks:
            users.setdefault((r // per_node, gpu_of(r % per_node, per_node, k)), []).append((spec.name, r))
    for (node, gpu), procs in users.items():
        seen: dict[str, int] = {}
        for name, r in procs:
            if name in seen:
                raise ValueError(
                    f"pool {name!r} has global ranks {seen[name]} and {r} on GPU {gpu} of node {node}: with "
                    f"pools.colocate={k} ({gpus} GPUs per node), a pool's ranks must sit on different GPUs, so make "
                    f"each pool's size (and where it starts) a multiple of {gpus}")
            seen[name] = r
        if ROLLOUT in seen and GLOBAL not in seen:
            raise ValueError(
                f"rollout rank {seen[ROLLOUT]} is on GPU {gpu} of node {node}, where no actor rank runs: with "
                f"pools.colocate={k} a rollout process takes its weights from the actor process on its GPU "
                f"(CUDA IPC), so the global pool must cover the rollout pool's GPUs")
    for procs in users.values():  # every GPU runs k processes, at most one per pool
        names = [name for name, _ in procs]
        if rollout_share > 0 and ROLLOUT in names and len(names) > 1:
            shares = {n: rollout_share if n == ROLLOUT else (1.0 - rollout_share) / (len(names) - 1) for n in names}
        else:
            shares = {n: 1.0 / len(names) for n in names}
        for name, share in shares.items():
            fractions[name] = min(fractions.get(name, 1.0), share)
    return fractions


__all__ = ["Plan", "plan"]
