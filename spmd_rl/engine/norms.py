"""The FSDP engine's RMSNorm forward for the Llama-like families of :data:`spmd_rl.models.families.FAMILIES`
(Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE): torch's RMSNorm op instead of Hugging Face's eight.

    install_norms(model)        # every RMSNorm module's forward -> fused_forward; returns how many

Hugging Face computes ``weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype)``: in a
bf16 forward that is eight kernels, and about fifteen more in the backward, for every norm (two per
layer, q and k norms in Qwen3). A small model's update is bound by those launches (docs/PERF.md,
"SmolLM2-135M"). ``F.rms_norm`` computes the same statistics in float32 and runs as one kernel each
way on CUDA (torch's fused RMSNorm). It rounds once, after the weight, where Hugging Face rounds the
normalised value to bf16 before multiplying: in bf16 the two differ by a rounding step of the
output; in float32 they are the same formula. The built-in rollout already normalises this way
(:func:`spmd_rl.rollout.layers.rms_norm`), so the trainer's log-probs move towards the sampler's.

Gemma 3 (``1 + weight``, float32 throughout) keeps its own forward. A norm whose weight and input
dtypes differ (no mixed precision, an autocast forward) takes Hugging Face's forward, which promotes.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ..models.families import FAMILIES


def fused_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm's forward through ``F.rms_norm`` (module docstring)."""
    if self.weight.dtype != x.dtype:
        return type(self).forward(self, x)
    return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.variance_epsilon)


def install_norms(model: torch.nn.Module) -> int:
    """Give every RMSNorm module of a supported Llama-like model :func:`fused_forward`; returns how many
    (0 for other model types, and for Gemma)."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is None or family.norm_offset:
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") \
                and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1:
            module.forward = types.MethodType(fused_forward, module)
            count += 1
    return count


__all__ = ["fused_forward", "install_norms"]
