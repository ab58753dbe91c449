"""Rollout engines: generate responses with the actor's current weights. The backend registry.

    spec = backend_spec(cfg.rollout.backend)        # what plan() checks: sharding, sampling; its pool's groups
    engine = build_rollout_from_config(cfg.rollout, model_folder=folder, device=device, pad_token_id=0,
                                       eos_token_ids=[2], max_prompt_length=512, seed=17)
    engine = build_rollout("native", model_folder=folder, device=device, dtype=torch.float32, ...)

Every engine implements :class:`RolloutEngine` (``generate``, ``load_weights``, ``sleep``,
``wake_up``, ``close``) and returns a :class:`GenerationOutput`. Backends: ``native``
(:class:`NativeRollout`, built in, CPU and GPU, one whole model per rank) and ``vllm``
(``vllm_engine.VllmRollout``, the `vllm` extra, imported only when chosen; its tp / pp groups are
vLLM's own over the whole world, or built by :mod:`.vllm_groups` over the rollout's pool when that
pool is not the whole world). This table is the only place that tells the backends apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from spmd_rl.memory.parts import NATIVE_MEMORY, VLLM_MEMORY, RolloutMemory

if TYPE_CHECKING:
    import torch

    from spmd_rl.config import RolloutConfig
    from spmd_rl.models.shape import ModelShape

    from .base import GenerationOutput, RolloutEngine
    from .native import NativeRollout


def __getattr__(name: str) -> Any:
    # Imported on first use: planning a layout (plan(), the layout tool) needs neither transformers
    # nor torch, so the layout tool runs in a fraction of a second on a machine without them.
    if name == "NativeRollout":
        from .native import NativeRollout

        return NativeRollout
    if name in ("GenerationOutput", "RolloutEngine"):
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _native(**kwargs: Any) -> RolloutEngine:
    from .native import NativeRollout

    return NativeRollout(**kwargs)


def _vllm(**kwargs: Any) -> RolloutEngine:
    from .vllm_engine import VllmRollout  # imports vllm: only when this backend is asked for

    return VllmRollout(**kwargs)


def _native_options(rollout: RolloutConfig, *, max_prompt_length: int, seed: int) -> dict[str, Any]:
    return {"compile_decode": None if rollout.compile_decode else False, "length_dist": rollout.length_dist,
            "min_new_tokens": rollout.min_new_tokens, "token_delay_s": rollout.token_delay_s}


def _vllm_options(rollout: RolloutConfig, *, max_prompt_length: int, seed: int) -> dict[str, Any]:
    return dict(tp=rollout.tp, pp=rollout.pp, gpu_memory_utilization=rollout.gpu_memory_utilization,
                max_model_len=rollout.max_model_len or max_prompt_length + rollout.max_new_tokens, seed=seed)


def _vllm_pool_groups(*, pool_ranks: list[int], tp: int, pp: int, device_type: str) -> Any:
    from .vllm_groups import VllmPoolGroups  # torch only: every rank of the world runs this, vLLM or not

    return VllmPoolGroups.create(pool_ranks=pool_ranks, tp=tp, pp=pp, device_type=device_type)


def _no_check(rollout: RolloutConfig) -> None:
    return None


def _vllm_check(rollout: RolloutConfig) -> None:
    workload = [f for f, on in (("rollout.length_dist", rollout.length_dist != "model"),
                                ("rollout.token_delay_s", rollout.token_delay_s > 0)) if on]
    if workload:
        raise ValueError(f"{' and '.join(workload)} shape the built-in rollout's workload: use --rollout.backend "
                         "native, or leave them unset with vllm")
    if rollout.top_k != 0 or rollout.top_p != 1.0:
        raise ValueError(
            f"rollout.backend=vllm reports log-probs after top-k / top-p filtering, the trainer before it: "
            f"use --rollout.top-k 0 --rollout.top-p 1.0 with vllm (got top_k={rollout.top_k}, top_p={rollout.top_p})")


def _vllm_model_rules(rollout: RolloutConfig, shape: ModelShape) -> None:
    """vLLM's own rules for splitting the model: tp divides the attention heads, and the key/value heads
    (or is a multiple of them: each is then replicated); pp at most the layers (split unevenly). It pads
    the vocabulary, which needs no rule."""
    from spmd_rl.models.shape import require_divides

    require_divides("--rollout.tp", rollout.tp, shape, heads=shape.heads)
    if shape.kv_heads % rollout.tp and rollout.tp % shape.kv_heads:
        raise ValueError(f"--rollout.tp {rollout.tp} must divide the model's {shape.kv_heads} key/value heads or be "
                         f"a multiple of them ({shape.describe()})")
    if rollout.pp > shape.layers:
        raise ValueError(f"--rollout.pp {rollout.pp} exceeds the model's {shape.layers} layers ({shape.describe()})")


@dataclass(frozen=True)
class BackendSpec:
    """One rollout backend: its constructor and what :func:`spmd_rl.plan.plan` must know."""

    factory: Callable[..., RolloutEngine]
    options: Callable[..., dict[str, Any]]
    """Backend-specific constructor arguments from the ``rollout`` section."""
    model_parallel: bool
    """A replica may span ``rollout.tp`` x ``rollout.pp`` ranks (else one whole model per rank)."""
    pool_groups: Callable[..., Any] | None = None
    """When the rollout's pool is not the whole world: builds, on every rank of the world, the process
    groups the engine needs over that pool (``pool_ranks``, ``tp``, ``pp``, ``device_type``), handed to
    its constructor as ``pool_groups`` on the pool's ranks. None: the engine needs none of its own."""
    check: Callable[[RolloutConfig], None] = _no_check
    """Rules of the ``rollout`` section that only this backend has."""
    model_rules: Callable[[RolloutConfig, ModelShape], None] = lambda rollout, shape: None
    """What its ``rollout.tp`` / ``rollout.pp`` ask of the model's shape (plan() calls it when the shape is
    known; ValueError naming the flag and the model's numbers)."""
    partial: bool = False
    """Its ``generate`` takes a ``swap`` callback (``rollout.partial``: responses continued under new weights)."""
    stream: bool = False
    """It has ``stream(feed=, done=, ...)`` (``rollout.stream``: rows fed and handed back one by one)."""
    stage_weights: bool = False
    """Its ``generate`` and ``stream`` take a ``look`` callback, called while it decodes, and it says
    whether a second copy of its weights fits (``room_for_weights()``): ``rollout.stage_weights``,
    weights received into a staging copy mid-round."""
    fp8: bool = False
    """It takes ``fp8`` at construction and holds its projections' weights in FP8 (``--rollout.dtype fp8``)."""
    router_replay: bool = False
    """Its ``generate`` takes ``record_routes`` at construction and returns each generated token's experts
    (``GenerationOutput.routed_experts``): ``actor.router_replay``."""
    memory: RolloutMemory = NATIVE_MEMORY
    """What it holds on a GPU, for plan()'s memory estimate (:mod:`spmd_rl.memory.parts`)."""


BACKENDS: dict[str, BackendSpec] = {
    "native": BackendSpec(factory=_native, options=_native_options, model_parallel=False, partial=True,
                          stream=True, stage_weights=True, router_replay=True, fp8=True),
    "vllm": BackendSpec(factory=_vllm, options=_vllm_options, model_parallel=True,
                        pool_groups=_vllm_pool_groups, check=_vllm_check, model_rules=_vllm_model_rules,
                        memory=VLLM_MEMORY),
}


def backend_spec(backend: str) -> BackendSpec:
    """The registry entry of ``rollout.backend``; ValueError naming the known ones otherwise."""
    spec = BACKENDS.get(backend)
    if spec is None:
        raise ValueError(f"rollout.backend={backend!r} is not available; known backends: {sorted(BACKENDS)}")
    return spec


def build_rollout(backend: str, **kwargs: Any) -> RolloutEngine:
    """Create the rollout engine named ``backend``; ``kwargs`` go to its constructor."""
    return backend_spec(backend).factory(**kwargs)


def build_rollout_from_config(rollout: RolloutConfig, *, model_folder: str, device: torch.device, pad_token_id: int,
                              eos_token_ids: list[int], trust_remote_code: bool, max_prompt_length: int,
                              seed: int, pool_groups: Any = None, record_routes: bool = False) -> RolloutEngine:
    """The engine ``rollout.backend`` names, configured from the ``rollout`` section: bf16 on CUDA,
    fp32 elsewhere (``rollout.dtype fp8``: the projections in FP8); no EOS ids with ``rollout.ignore_eos``. ``seed``: the sampling seed of this rank's
    replica (vLLM seeds its engine with it). ``pool_groups``: what the backend's
    :attr:`BackendSpec.pool_groups` built for this rank (``RunGroups.rollout_pool_groups``), or None.
    ``record_routes``: the engine records the experts of every generated token (``actor.router_replay``;
    plan() allows it only where :attr:`BackendSpec.router_replay`)."""
    import torch

    spec = backend_spec(rollout.backend)
    return spec.factory(
        model_folder=model_folder, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        batch_size=rollout.batch_size, pad_token_id=pad_token_id,
        eos_token_ids=[] if rollout.ignore_eos else eos_token_ids,
        trust_remote_code=trust_remote_code, **spec.options(rollout, max_prompt_length=max_prompt_length, seed=seed),
        **({"pool_groups": pool_groups} if pool_groups is not None else {}),
        **({"record_routes": True} if record_routes else {}), **({"fp8": True} if rollout.dtype == "fp8" else {}))


__all__ = ["BACKENDS", "BackendSpec", "GenerationOutput", "NativeRollout", "RolloutEngine", "backend_spec",
           "build_rollout", "build_rollout_from_config"]
