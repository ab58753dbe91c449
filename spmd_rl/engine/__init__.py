"""Training engines and their registry: ``actor.engine`` → layouts over the actor pool and a builder.

    spec = engine_spec(cfg.actor.engine)
    layouts = spec.layouts(cfg.actor, pool_size)      # pure, for plan(): {"fsdp": ..., "ulysses": ...}
    actor = build_engine("actor", actor=cfg.actor, ref=cfg.ref, model=cfg.model, seed=0, groups=groups,
                         model_folder=folder, device=device, pad_token_id=0, total_updates=40)
    critic = build_engine("critic", ..., critic=cfg.critic)   # the value model, where spec.critic
    ref = build_reference(actor, actor=cfg.actor, ref=cfg.ref, ...)   # the LoRA actor's base, or an engine

Every engine implements :class:`~spmd_rl.engine.base.TrainEngine`. This table is the only place
that tells the engines apart: :func:`spmd_rl.plan.plan` reads their layouts and rules
from it, the trainer builds the actor, the reference and the critic through :func:`build_engine`. The engine
modules are imported only when built, so planning a layout needs neither FSDP nor megatron-core.

* ``fsdp`` (:mod:`.fsdp`): FSDP2 over ``[fsdp]`` / ``[ddp, fsdp]``, Ulysses ``[dp, sp]`` for the batch.
* ``megatron`` (:mod:`.megatron`): megatron-core tp / pp / vpp / cp / ep over the global pool (the
  actor's), next to rollout, teacher and reward pools.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from spmd_rl.distributed.dims import ActorLayout, FsdpLayout, MegatronLayout, UlyssesLayout
from spmd_rl.memory.parts import FSDP_MEMORY, MEGATRON_MEMORY, EngineMemory

if TYPE_CHECKING:
    import torch

    from spmd_rl.engine.base import TrainEngine

    from spmd_rl.config import ActorConfig, CriticConfig, ModelConfig, RefConfig, TeacherConfig
    from spmd_rl.models.shape import ModelShape

Role = Literal["actor", "ref", "critic"]


@dataclass(frozen=True)
class EngineSpec:
    """One training engine: its layouts, what plan() must know about it, and its builder."""

    layouts: Callable[[ActorConfig, int], dict[str, Any]]
    """The engine's pure layouts over an actor pool of the given size, by mesh name (raise ValueError)."""
    meshes: tuple[str, ...]
    """The names :attr:`layouts` returns."""
    batch_layout: str
    """Which of them is the actor's batch view (an :class:`ActorLayout`)."""
    build: Callable[..., TrainEngine]
    """``build(role, *, actor, ref, model, seed, groups, model_folder, device, pad_token_id, total_updates,
    critic=None)``; ``groups``: the run's :class:`spmd_rl.world.RunGroups` (not imported here: the world
    builds megatron's groups, so it sits above this registry); ``critic`` (the section) only for
    ``role="critic"``, whose ``model_folder`` is the value model's."""
    critic: bool = False
    """It builds PPO's critic (``role="critic"``: a value model; ``algo.adv_estimator=gae``)."""
    export_copy: bool = False
    """Its checkpoints also hold a full HF-named copy of the weights (``export_weights`` is not empty)."""
    ignored_flags: Callable[[ActorConfig], list[str]] = field(default=lambda actor: [])
    """Flags set in ``actor`` that this engine does not use (plan() refuses them)."""
    warnings: Callable[[ActorConfig], list[str]] = field(default=lambda actor: [])
    """What the layout tool should say before a run starts (the engine refuses it at start)."""
    lora: bool = False
    """It trains LoRA adapters (``actor.lora.rank`` > 0) and its actor is its own reference then."""
    moe_aux: bool = False
    """It adds an MoE router's load-balancing loss to the actor loss (``algo.moe_aux_coef`` > 0)."""
    router_replay: bool = False
    """Its actor forwards route generated tokens to the experts the rollout recorded (``actor.router_replay``)."""
    model_rules: Callable[[ActorConfig, ModelShape], None] = field(default=lambda actor, shape: None)
    """What its layout asks of the model's shape (heads, layers, widths against tp / pp / sp); plan()
    calls it when the model's shape is known (ValueError naming the flag and the model's numbers)."""
    models: Callable[[], str] = field(default=lambda: "")
    """The models it trains, in words (the layout tool prints it; :mod:`spmd_rl.models.families`, imported
    only when asked: it loads transformers)."""
    memory: EngineMemory = FSDP_MEMORY
    """What its actor and reference hold on a GPU, for plan()'s memory estimate (:mod:`spmd_rl.memory.parts`)."""


def _fsdp_layouts(actor: ActorConfig, size: int) -> dict[str, Any]:
    return {"fsdp": FsdpLayout(size, actor.fsdp.fsdp_size), "ulysses": UlyssesLayout(size, actor.fsdp.ulysses_size)}


def _megatron_layouts(actor: ActorConfig, size: int) -> dict[str, Any]:
    m = actor.megatron
    return {"megatron": MegatronLayout(size, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, etp=m.etp, vpp=m.vpp, order=m.order)}


def _fsdp_model_rules(actor: ActorConfig, shape: ModelShape) -> None:
    from spmd_rl.models.shape import require_divides

    # Ulysses splits the heads over the sp ranks (spmd_rl.engine.ulysses.check_heads, at build)
    require_divides("--actor.fsdp.ulysses-size", actor.fsdp.ulysses_size, shape, heads=shape.heads,
                    kv_heads=shape.kv_heads)


def _megatron_model_rules(actor: ActorConfig, shape: ModelShape) -> None:
    """The rules of spmd_rl.engine.megatron.model.check_layout (which checks them again at build), from the
    shape alone; the vocabulary is padded to a multiple of tp there, so it needs no rule."""
    from spmd_rl.models.shape import require_divides

    m = actor.megatron
    require_divides("--actor.megatron.tp", m.tp, shape, heads=shape.heads, kv_heads=shape.kv_heads,
                    intermediate=shape.expert_intermediate if shape.experts else shape.intermediate)
    require_divides(f"--actor.megatron.pp {m.pp} x --actor.megatron.vpp {m.vpp} =", m.pp * m.vpp, shape,
                    layers=shape.layers)
    if shape.experts:
        require_divides("--actor.megatron.ep", m.ep, shape, experts=shape.experts)
        require_divides("--actor.megatron.etp", m.etp or m.tp, shape, expert_intermediate=shape.expert_intermediate)
    elif m.ep > 1:
        raise ValueError(f"--actor.megatron.ep {m.ep} > 1 needs a mixture-of-experts model; {shape.describe()} "
                         f"is dense")


def _build_fsdp(role: Role, *, actor: ActorConfig, ref: RefConfig, model: ModelConfig, seed: int, groups: Any,
                model_folder: str, device: torch.device, pad_token_id: int, total_updates: int,
                critic: CriticConfig | None = None, moe_aux_coef: float = 0.0) -> TrainEngine:
    from spmd_rl.engine.fsdp import FSDPEngine

    common = dict(model_folder=model_folder, mesh=groups.actor_mesh, device=device, fsdp=actor.fsdp,
                  trust_remote_code=model.trust_remote_code, pad_token_id=pad_token_id,
                  group=groups.pools.get("global").group, sp_group=groups.sp_group,
                  use_packing=actor.use_packing, max_tokens_per_gpu=actor.max_tokens_per_gpu)
    checkpointing = model.checkpointing_on(device.type)  # None: on for CPU runs (ModelConfig)
    if role == "actor":
        return FSDPEngine(actor=actor, total_updates=total_updates, trainable=True, moe_aux_coef=moe_aux_coef,
                          gradient_checkpointing=checkpointing, lora=actor.lora, **common)
    if role == "critic":
        assert critic is not None, "the critic's engine needs the critic section"
        common["trust_remote_code"] = critic.model.trust_remote_code
        return FSDPEngine(actor=critic_optimizer(actor, critic), total_updates=total_updates, trainable=True,
                          gradient_checkpointing=checkpointing, value_model=True, seed=seed, **common)
    return FSDPEngine(trainable=False, param_offload=ref.param_offload, **common)


def critic_optimizer(actor: ActorConfig, critic: CriticConfig) -> ActorConfig:
    """The critic's optimizer settings in the shape an engine reads them: the actor's section with the
    critic's LR, weight decay, warmup and gradient clip (betas, schedule, guard: the actor's)."""
    return dataclasses.replace(actor, lr=critic.lr, weight_decay=critic.weight_decay,
                               warmup_steps=critic.warmup_steps, grad_clip=critic.grad_clip)


def _build_megatron(role: Role, *, actor: ActorConfig, ref: RefConfig, model: ModelConfig, seed: int,
                    groups: Any, model_folder: str, device: torch.device, pad_token_id: int,
                    total_updates: int, critic: CriticConfig | None = None, moe_aux_coef: float = 0.0) -> TrainEngine:
    from spmd_rl.engine.megatron import MegatronEngine  # actor and reference share megatron's groups

    if role == "critic":  # plan() refuses this first (EngineSpec.critic)
        raise ValueError("actor.engine=megatron has no critic (value model): use --actor.engine fsdp for "
                         "algo.adv_estimator=gae")

    common = dict(model_folder=model_folder, device=device, layout=groups.plan.actor, megatron=actor.megatron,
                  trust_remote_code=model.trust_remote_code, pad_token_id=pad_token_id, seed=seed,
                  group=groups.pools.get("global").group)
    if role == "actor":
        return MegatronEngine(actor=actor, total_updates=total_updates, trainable=True, **common)
    return MegatronEngine(trainable=False, param_offload=ref.param_offload, **common)


def _megatron_ignored(actor: ActorConfig) -> list[str]:
    return [flag for flag, on in (("actor.use_packing", actor.use_packing),
                                  ("actor.max_tokens_per_gpu", actor.max_tokens_per_gpu is not None),
                                  ("actor.fsdp.ulysses_size", actor.fsdp.ulysses_size > 1),
                                  ("actor.fsdp.param_offload", actor.fsdp.param_offload),
                                  ("actor.fsdp.optimizer_offload", actor.fsdp.optimizer_offload)) if on]


def _fsdp_models() -> str:
    from spmd_rl.models.families import FAMILIES

    return f"any Hugging Face causal LM (its own attention for {', '.join(FAMILIES)})"


def _megatron_models() -> str:
    from spmd_rl.models.families import megatron_families

    return megatron_families()


ENGINES: dict[str, EngineSpec] = {
    "fsdp": EngineSpec(layouts=_fsdp_layouts, meshes=("fsdp", "ulysses"), batch_layout="ulysses", build=_build_fsdp,
                       critic=True, lora=True, moe_aux=True, router_replay=True,
                       model_rules=_fsdp_model_rules, models=_fsdp_models),
    "megatron": EngineSpec(layouts=_megatron_layouts, meshes=("megatron",), batch_layout="megatron", build=_build_megatron,
                           export_copy=True, router_replay=True, ignored_flags=_megatron_ignored,
                           model_rules=_megatron_model_rules, models=_megatron_models, memory=MEGATRON_MEMORY),
}


def engine_spec(name: str) -> EngineSpec:
    """The registry entry of ``actor.engine``; ValueError naming the known engines otherwise."""
    spec = ENGINES.get(name)
    if spec is None:
        raise ValueError(f"actor.engine={name!r} is not available; known engines: {sorted(ENGINES)}")
    return spec


def build_engine(role: Role, *, actor: ActorConfig, **kwargs: Any) -> TrainEngine:
    """The actor (``role="actor"``, trainable), the frozen reference or the critic (``role="critic"``, a
    trainable value model; pass ``critic=``) of engine ``actor.engine``."""
    return engine_spec(actor.engine).build(role, actor=actor, **kwargs)


def build_reference(actor_engine: TrainEngine, *, actor: ActorConfig, **kwargs: Any) -> Any:
    """The frozen reference: with LoRA the actor's own base model with its adapters off (no second
    copy of the weights, :class:`~spmd_rl.engine.lora.FrozenBase`), else a ``ref`` engine built from
    the model folder (``kwargs`` as for :func:`build_engine`)."""
    if actor.lora.enabled:
        from spmd_rl.engine.lora import FrozenBase

        return FrozenBase(actor_engine)
    return build_engine("ref", actor=actor, **kwargs)


def build_teacher(*, teacher: TeacherConfig, actor: ActorConfig, model_folder: str, mesh: Any, group: Any,
                  device: torch.device, pad_token_id: int, sp_group: Any = None) -> TrainEngine:
    """The frozen teacher of on-policy distillation: an FSDP engine over ``mesh`` (the actor's mesh
    when colocated, the teacher pool's otherwise), with the actor's micro-batching settings."""
    from spmd_rl.engine.fsdp import FSDPEngine

    return FSDPEngine(model_folder=model_folder, mesh=mesh, device=device, fsdp=actor.fsdp,
                      trust_remote_code=teacher.model.trust_remote_code, pad_token_id=pad_token_id, group=group,
                      sp_group=sp_group, use_packing=actor.use_packing, max_tokens_per_gpu=actor.max_tokens_per_gpu,
                      trainable=False, param_offload=teacher.param_offload)


def __getattr__(name: str) -> Any:
    # engine.base imports torch: loaded on first use, so plan() and the layout tool need no torch.
    if name in ("LossFn", "NonfiniteGuard", "TrainEngine", "lr_lambda"):
        from spmd_rl.engine import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENGINES", "ActorLayout", "EngineSpec", "LossFn", "NonfiniteGuard", "TrainEngine", "build_engine",
           "build_reference", "build_teacher", "critic_optimizer", "engine_spec", "lr_lambda"]
