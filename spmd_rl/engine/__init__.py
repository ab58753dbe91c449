"""Training engines and their registry: ``actor.engine`` → layouts over the actor pool and a builder.

    spec = engine_spec(cfg.actor.engine)
    layouts = spec.layouts(cfg.actor, pool_size)      # pure, for plan(): {"fsdp": ..., "ulysses": ...}
    actor = build_engine("actor", actor=cfg.actor, ref=cfg.ref, model=cfg.model, seed=0, groups=groups,
                         model_folder=folder, device=device, pad_token_id=0, total_updates=40)

Every engine implements :class:`~spmd_rl.engine.base.TrainEngine`. This table is the only place
that tells the engines apart: :func:`spmd_rl.distributed.plan.plan` reads their layouts and rules
from it, the trainer builds the actor and the reference through :func:`build_engine`. The engine
modules are imported only when built, so planning a layout needs neither FSDP nor megatron-core.

* ``fsdp`` (:mod:`.fsdp`): FSDP2 over ``[fsdp]`` / ``[ddp, fsdp]``, Ulysses ``[dp, sp]`` for the batch.
* ``megatron`` (:mod:`.megatron`): megatron-core tp / pp / vpp / cp / ep over the global pool.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from spmd_rl.distributed.dims import ActorLayout, FsdpLayout, MegatronLayout, UlyssesLayout
from spmd_rl.engine.base import LossFn, NonfiniteGuard, TrainEngine, lr_lambda

if TYPE_CHECKING:
    import torch

    from spmd_rl.config import ActorConfig, ModelConfig, RefConfig, TeacherConfig
    from spmd_rl.distributed.world import RunGroups

Role = Literal["actor", "ref"]


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
    """``build(role, *, actor, ref, model, seed, groups, model_folder, device, pad_token_id, total_updates)``."""
    whole_world: bool = False
    """Its groups are built over the whole world, so no rank may be in another pool."""
    export_copy: bool = False
    """Its checkpoints also hold a full HF-named copy of the weights (``export_weights`` is not empty)."""
    ignored_flags: Callable[[ActorConfig], list[str]] = field(default=lambda actor: [])
    """Flags set in ``actor`` that this engine does not use (plan() refuses them)."""
    warnings: Callable[[ActorConfig], list[str]] = field(default=lambda actor: [])
    """What the layout tool should say before a run starts (the engine refuses it at start)."""


def _fsdp_layouts(actor: ActorConfig, size: int) -> dict[str, Any]:
    return {"fsdp": FsdpLayout(size, actor.fsdp.fsdp_size), "ulysses": UlyssesLayout(size, actor.fsdp.ulysses_size)}


def _megatron_layouts(actor: ActorConfig, size: int) -> dict[str, Any]:
    m = actor.megatron
    return {"megatron": MegatronLayout(size, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, etp=m.etp, vpp=m.vpp, order=m.order)}


def _build_fsdp(role: Role, *, actor: ActorConfig, ref: RefConfig, model: ModelConfig, seed: int, groups: RunGroups,
                model_folder: str, device: torch.device, pad_token_id: int, total_updates: int) -> TrainEngine:
    from spmd_rl.engine.fsdp import FSDPEngine

    common = dict(model_folder=model_folder, mesh=groups.actor_mesh, device=device, fsdp=actor.fsdp,
                  trust_remote_code=model.trust_remote_code, pad_token_id=pad_token_id,
                  group=groups.pools.get("global").group, sp_group=groups.sp_group,
                  use_packing=actor.use_packing, max_tokens_per_gpu=actor.max_tokens_per_gpu)
    if role == "actor":
        return FSDPEngine(actor=actor, total_updates=total_updates, trainable=True,
                          gradient_checkpointing=model.gradient_checkpointing, **common)
    return FSDPEngine(trainable=False, param_offload=ref.param_offload, **common)


def _build_megatron(role: Role, *, actor: ActorConfig, ref: RefConfig, model: ModelConfig, seed: int,
                    groups: RunGroups, model_folder: str, device: torch.device, pad_token_id: int,
                    total_updates: int) -> TrainEngine:
    from spmd_rl.engine.megatron import MegatronEngine  # actor and reference share megatron's groups

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


def _megatron_warnings(actor: ActorConfig) -> list[str]:
    if actor.megatron.cp > 1 and importlib.util.find_spec("transformer_engine") is None:
        return [f"actor.megatron.cp ({actor.megatron.cp}) > 1 needs TransformerEngine, which is not installed "
                "here: the megatron engine will refuse to start without it"]
    return []


ENGINES: dict[str, EngineSpec] = {
    "fsdp": EngineSpec(layouts=_fsdp_layouts, meshes=("fsdp", "ulysses"), batch_layout="ulysses", build=_build_fsdp),
    "megatron": EngineSpec(layouts=_megatron_layouts, meshes=("megatron",), batch_layout="megatron", build=_build_megatron,
                           export_copy=True, ignored_flags=_megatron_ignored, warnings=_megatron_warnings),
}


def engine_spec(name: str) -> EngineSpec:
    """The registry entry of ``actor.engine``; ValueError naming the known engines otherwise."""
    spec = ENGINES.get(name)
    if spec is None:
        raise ValueError(f"actor.engine={name!r} is not available; known engines: {sorted(ENGINES)}")
    return spec


def build_engine(role: Role, *, actor: ActorConfig, **kwargs: Any) -> TrainEngine:
    """The actor (``role="actor"``, trainable) or the frozen reference of engine ``actor.engine``."""
    return engine_spec(actor.engine).build(role, actor=actor, **kwargs)


def build_teacher(*, teacher: TeacherConfig, actor: ActorConfig, model_folder: str, mesh: Any, group: Any,
                  device: torch.device, pad_token_id: int, sp_group: Any = None) -> TrainEngine:
    """The frozen teacher of on-policy distillation: an FSDP engine over ``mesh`` (the actor's mesh
    when colocated, the teacher pool's otherwise), with the actor's micro-batching settings."""
    from spmd_rl.engine.fsdp import FSDPEngine

    return FSDPEngine(model_folder=model_folder, mesh=mesh, device=device, fsdp=actor.fsdp,
                      trust_remote_code=teacher.model.trust_remote_code, pad_token_id=pad_token_id, group=group,
                      sp_group=sp_group, use_packing=actor.use_packing, max_tokens_per_gpu=actor.max_tokens_per_gpu,
                      trainable=False, param_offload=teacher.param_offload)


__all__ = ["ENGINES", "ActorLayout", "EngineSpec", "LossFn", "NonfiniteGuard", "TrainEngine", "build_engine", "build_teacher",
           "engine_spec", "lr_lambda"]
