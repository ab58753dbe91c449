"""The model families the fast paths compute, and what sets each apart: one table, read by the built-in
rollout's decoder (:mod:`spmd_rl.rollout.layers`) and the FSDP engine's attention (:mod:`spmd_rl.engine.attention`);
and the model types the megatron engine converts (:data:`MEGATRON_FAMILIES`).

    family = FAMILIES.get(config.model_type)      # None: the HF forward / HF decode loop, logged once
    windows = layer_windows(config)               # per layer: the sliding window, or None (full causal)
    print(supported_families())                   # "llama (Llama 2 / 3.x, incl. llama3 RoPE), ..."
    print(megatron_families())                    # the model types actor.engine=megatron converts

A model type outside the table still trains and generates through the Hugging Face forward; the
rollout logs the reason it fell back (:func:`spmd_rl.rollout.layers.unsupported_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` differs from the Llama decoder layer."""

    label: str
    """Checkpoints of the family, for logs and docs."""
    norm_offset: float = 0.0
    """RMSNorm scales by ``offset + weight`` (Gemma: 1, with float32 statistics and scale)."""
    sandwich_norms: bool = False
    """Gemma: the attention output and the MLP output are normalised too (``post_attention_layernorm``,
    ``post_feedforward_layernorm``) before their residual adds; the MLP input norm is ``pre_feedforward_layernorm``."""
    moe: bool = False
    """Some layers' MLP is routed experts (Qwen3-MoE: softmax router, top-k, optionally renormalised)."""


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 2 / 3.x (incl. llama3 RoPE scaling)"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2 / Qwen2.5"),
    "qwen3": Family("Qwen3 (q/k RMSNorm)"),
    "qwen3_moe": Family("Qwen3-MoE (routed experts)", moe=True),
    "gemma3_text": Family("Gemma 3 text (sliding/global layers)", norm_offset=1.0, sandwich_norms=True),
}


MEGATRON_FAMILIES: dict[str, str] = {
    **{name: FAMILIES[name].label for name in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")},
    "mixtral": "Mixtral (routed experts)",
}
"""The model types ``actor.engine=megatron`` converts to megatron-core and back
(:mod:`spmd_rl.engine.megatron.convert`), with their labels; any other is refused at start, naming it.
Mixtral is converted there, while the fast paths above run it through the Hugging Face forward."""


def supported_families() -> str:
    """One line: every ``model_type`` of :data:`FAMILIES` with its label."""
    return ", ".join(f"{name} ({family.label})" for name, family in FAMILIES.items())


def megatron_families() -> str:
    """One line: every ``model_type`` of :data:`MEGATRON_FAMILIES` with its label."""
    return ", ".join(f"{name} ({label})" for name, label in MEGATRON_FAMILIES.items())


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding attention window, None for full causal attention: with ``layer_types``
    (Qwen2, Gemma 3 and newer configs) the layers named ``sliding_attention``, without it (Mistral) every
    layer whenever ``sliding_window`` is set. The same rule as :func:`spmd_rl.models.sliding_window`."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * n
    if types is None:
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types[:n]]


__all__ = ["FAMILIES", "Family", "MEGATRON_FAMILIES", "layer_windows", "megatron_families", "supported_families"]
