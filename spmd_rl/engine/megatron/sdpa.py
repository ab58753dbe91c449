"""The megatron engine's core attention without a context-parallel group: :class:`CausalSDPA`.

    layer_spec.submodules.self_attention.submodules.core_attention = CausalSDPA

Its context-parallel form (:class:`~spmd_rl.engine.megatron.context.ContextParallelSDPA`) derives from
it; both plug into megatron-core's local layer spec (:func:`spmd_rl.engine.megatron.model.build_chunks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalSDPA(torch.nn.Module):
    """megatron's core attention for this engine, where every row starts at column 0 and is padded
    on the right, so attention is plain causal with no mask: torch's ``scaled_dot_product_attention``
    (flash / memory-efficient kernels on GPU: fp32 score accumulation, no ``[b, h, s, s]`` tensor).

    It replaces the local spec's ``DotProductAttention``, which forms the scores with a bf16
    ``baddbmm`` before its fp32 softmax, which puts the engine's bf16 log-probs further from the FSDP
    engine's (flash attention) than this path does (``bench/megatron_logprob_gap.py`` measures both).
    Same constructor and call as megatron's core attention; q ``[s, b, h, d]``, k / v ``[s, b, g, d]``
    -> ``[s, b, h * d]``, query groups shared natively (``enable_gqa``)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 softmax_scale: float | None = None, **_: object) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"CausalSDPA serves causal self-attention only, got {attn_mask_type}")
        self.config = config
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None, **_: object) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("CausalSDPA takes no attention mask, bias or packed sequences (the engine's rows "
                             "are right-padded and causal)")
        s, b, h, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=k.shape[1] != h)
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


__all__ = ["CausalSDPA"]
