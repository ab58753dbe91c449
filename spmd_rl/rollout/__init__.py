"""Rollout engines: generate responses with the actor's current weights, colocated on each rank.

    engine = build_rollout(cfg.rollout.backend, model_folder=folder, device=device, dtype=torch.bfloat16,
                           batch_size=cfg.rollout.batch_size, pad_token_id=tok.pad_token_id,
                           eos_token_ids=[tok.eos_token_id])

Every engine implements :class:`RolloutEngine` (``generate``, ``load_weights``, ``sleep``,
``wake_up``, ``close``) and returns a :class:`GenerationOutput`. Backends: ``native``
(:class:`NativeRollout`, built in, CPU and GPU) and ``vllm`` (``vllm_engine.VllmRollout``, the
`vllm` extra, imported only when chosen; it also takes ``tp``, ``pp``, ``gpu_memory_utilization``,
``max_model_len`` and ``seed``).
"""

from __future__ import annotations

from typing import Any, Callable

from .base import GenerationOutput, RolloutEngine
from .native import NativeRollout


def _vllm(**kwargs: Any) -> RolloutEngine:
    from .vllm_engine import VllmRollout  # imports vllm: only when this backend is asked for

    return VllmRollout(**kwargs)


_BACKENDS: dict[str, Callable[..., RolloutEngine]] = {"native": NativeRollout, "vllm": _vllm}


def build_rollout(backend: str, **kwargs: Any) -> RolloutEngine:
    """Create the rollout engine named by ``rollout.backend``; ``kwargs`` go to its constructor."""
    factory = _BACKENDS.get(backend)
    if factory is None:
        raise ValueError(f"rollout.backend={backend!r} is not available; known backends: {sorted(_BACKENDS)}")
    return factory(**kwargs)


__all__ = ["GenerationOutput", "NativeRollout", "RolloutEngine", "build_rollout"]
