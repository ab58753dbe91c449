"""A megatron-core GPT model built from a Hugging Face config (Llama 3.x / Qwen2 / Qwen3 / Mistral dense,
Mixtral / Qwen3-MoE routed experts), with megatron-core's local layer spec (no TransformerEngine needed).

    spec = ModelSpec.from_hf(hf_config)                      # what we support, checked
    chunks = build_chunks(spec, layout, params_dtype=torch.float32)   # one GPTModel per vpp stage

``check_layout(spec, layout)`` raises ``ValueError`` naming the flag when the model cannot be
split as asked (heads and kv heads % tp, MLP widths % tp / etp, layers % (pp * vpp), experts % ep;
any cp fits: rows are padded to a multiple of 2 * cp). RoPE: the default, or Llama 3.x's ``llama3``
scaling (:func:`scale_rope`). Qwen3's per-head q/k RMSNorm is megatron-core's ``qk_layernorm``;
Qwen3-MoE's routed experts (no shared expert) take Mixtral's path, with or without renormalised
top-k probabilities. :func:`transformer_config` sets
dropout 0, no fused kernels and ``calculate_per_token_loss``. Two modules replace the local spec's:
:class:`RMSNorm` (Hugging Face's fp32 math; marks its weight for sequence parallelism, which
megatron's torch norm refuses) and :class:`~spmd_rl.engine.megatron.sdpa.CausalSDPA` (torch SDPA with ``is_causal`` as the core
attention, instead of ``DotProductAttention``'s bf16 scores); with cp > 1 its context-parallel form
:class:`~spmd_rl.engine.megatron.context.ContextParallelSDPA` (megatron-core's own context
parallelism lives only in TransformerEngine's attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spmd_rl.distributed.dims import MegatronLayout
from spmd_rl.engine.megatron.context import ContextParallelSDPA
from spmd_rl.engine.megatron.sdpa import CausalSDPA
from spmd_rl.models import sliding_window


def _qwen3_moe_routing(config) -> tuple[int, int, int, bool]:
    dense = sorted(set(getattr(config, "mlp_only_layers", None) or []))
    step = getattr(config, "decoder_sparse_step", 1)
    if dense or step != 1:
        raise ValueError(f"actor.engine=megatron converts Qwen3-MoE models whose every layer is routed; this one "
                         f"has dense layers (mlp_only_layers={dense}, decoder_sparse_step={step}); use "
                         f"--actor.engine fsdp for this model")
    return config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, bool(config.norm_topk_prob)


_ROUTING = {
    "mixtral": lambda c: (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, True),
    "qwen3_moe": _qwen3_moe_routing,
}
"""MoE model type -> ``(experts, top_k, expert MLP width, renormalised top-k)`` read from its config
(every layer routed, no shared expert); other types are dense."""
_QK_NORM = frozenset({"qwen3", "qwen3_moe"})
"""Model types with an RMSNorm over each query and key head."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a supported HF decoder, in the terms both conversions need."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    experts: int = 0
    """0 = dense MLP; else the number of routed experts (``moe_ffn`` wide each)."""
    top_k: int = 0
    moe_ffn: int = 0
    family: str = "llama"
    """The Hugging Face ``model_type`` (one of :data:`~spmd_rl.models.families.MEGATRON_FAMILIES`)."""
    sliding_window: int | None = None
    """The model's sliding attention window; this engine's attention is full causal, so longer
    sequences are refused (:func:`spmd_rl.models.check_sliding_window`)."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each query and key head (``head_dim`` wide) before RoPE; megatron-core's
    ``qk_layernorm``."""
    norm_topk: bool = True
    """MoE: the top-k routing probabilities are renormalised to sum to 1 (Mixtral always; Qwen3-MoE's
    ``norm_topk_prob``); False = the top-k entries of the softmax over all experts, as they are."""
    rope_llama3: tuple[float, float, float, int] | None = None
    """Llama 3.x RoPE scaling: ``(factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)``; None = RoPE as is (see :func:`scale_rope`)."""

    @staticmethod
    def from_hf(config) -> "ModelSpec":
        from spmd_rl.models.families import MEGATRON_FAMILIES, megatron_families

        model_type = getattr(config, "model_type", "")
        if model_type not in MEGATRON_FAMILIES:
            raise ValueError(f"actor.engine=megatron does not convert Hugging Face model type {model_type!r}; it "
                             f"supports {megatron_families()}; use --actor.engine fsdp for this model")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope = rope if isinstance(rope, dict) else {}
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        llama3 = None
        if rope_type == "llama3":
            llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                      int(rope["original_max_position_embeddings"]))
        elif rope_type != "default":
            raise ValueError(f"actor.engine=megatron supports the default and the llama3 RoPE, the model has "
                             f"rope_type {rope_type!r}; use --actor.engine fsdp for this model")
        theta = rope.get("rope_theta")
        theta = theta if theta is not None else getattr(config, "rope_theta", 10000.0)
        heads = config.num_attention_heads
        experts, top_k, moe_ffn, norm_topk = _ROUTING.get(model_type, lambda c: (0, 0, 0, True))(config)
        if experts and top_k == 1 and norm_topk:
            # the renormalised probability is 1: HF's router gets no gradient; megatron-core refuses the case
            raise ValueError(f"actor.engine=megatron cannot route top-1 with renormalised probabilities ({model_type}, "
                             f"{experts} experts); use --actor.engine fsdp for this model")
        return ModelSpec(
            layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn=moe_ffn or config.intermediate_size, vocab=config.vocab_size, eps=config.rms_norm_eps,
            rope_theta=float(theta), max_positions=config.max_position_embeddings,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(getattr(config, "attention_bias", False)),
            experts=experts, top_k=top_k, moe_ffn=moe_ffn, family=model_type, sliding_window=sliding_window(config),
            qk_norm=model_type in _QK_NORM, norm_topk=norm_topk, rope_llama3=llama3,
        )

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of tp (megatron splits it evenly); the extra
        rows are zero and never take part in a softmax (see :mod:`.vocab`)."""
        return -(-self.vocab // tp) * tp


def check_layout(spec: ModelSpec, layout: MegatronLayout) -> None:
    """Raise ``ValueError`` naming the flag when the model cannot be split by ``layout``."""
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    if spec.heads % tp or spec.kv_heads % tp:
        raise ValueError(
            f"actor.megatron.tp ({tp}) must divide the attention heads ({spec.heads}) and key/value heads "
            f"({spec.kv_heads}) of the model")
    if spec.ffn % tp or (spec.experts and spec.moe_ffn % layout.etp):  # type: ignore[operator]
        raise ValueError(f"actor.megatron.tp ({tp}) and etp ({layout.etp}) must divide the MLP widths of the model "
                         f"(intermediate {spec.ffn}, expert {spec.moe_ffn})")
    if spec.layers % (pp * vpp):
        raise ValueError(
            f"actor.megatron.pp ({pp}) * actor.megatron.vpp ({vpp}) = {pp * vpp} must divide the model's "
            f"{spec.layers} layers")
    if layout.ep > 1 and not spec.experts:
        raise ValueError(f"actor.megatron.ep ({layout.ep}) > 1 needs a mixture-of-experts model; this one is dense")
    if spec.experts and spec.experts % layout.ep:
        raise ValueError(f"actor.megatron.ep ({layout.ep}) must divide the model's {spec.experts} experts")


def transformer_config(spec: ModelSpec, layout: MegatronLayout, *, params_dtype: torch.dtype, bf16: bool,
                       sequence_parallel: bool, batch_p2p_comm: bool):
    """megatron-core ``TransformerConfig`` for ``spec`` on ``layout`` (dropout 0, no fused kernels,
    per-token loss: the engine's loss is already globally normalised)."""
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if spec.experts and layout.tp > 1 and not sequence_parallel:
        # megatron-core refuses the combination at the first training forward; say it at start
        raise ValueError(f"actor.megatron.tp ({layout.tp}) > 1 on a mixture-of-experts model needs "
                         f"--actor.megatron.sequence-parallel (megatron-core trains MoE layers under tp only with it)")
    if spec.experts:
        moe = dict(num_moe_experts=spec.experts, moe_router_topk=spec.top_k, moe_ffn_hidden_size=spec.moe_ffn,
                   # top-k of the logits, then a softmax over them = HF's renormalised top-k of the softmax
                   moe_router_pre_softmax=not spec.norm_topk,
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                   moe_permute_fusion=False)
    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn,
        normalization="RMSNorm", layernorm_epsilon=spec.eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm, hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # perform_initialization: megatron marks tensor-parallel parameters (the attribute its gradient
        # norm uses to count duplicates once) only while initialising them; the values are overwritten
        use_cpu_initialization=not bf16, perform_initialization=True,
        params_dtype=params_dtype, pipeline_dtype=torch.bfloat16 if bf16 else params_dtype, bf16=bf16,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, sequence_parallel=sequence_parallel and layout.tp > 1,
        calculate_per_token_loss=True, batch_p2p_comm=batch_p2p_comm, variable_seq_lengths=False,
        **moe,
    )


class RMSNorm(torch.nn.Module):
    """RMSNorm as Hugging Face Llama computes it (in fp32, then the weight in the input dtype), with
    megatron's constructor and the ``sequence_parallel`` mark on its weight (so megatron all-reduces
    its gradient over tp under sequence parallelism). megatron-core's torch fallback norm refuses
    sequence parallelism; its fused ones need TransformerEngine or Apex."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def build_chunks(spec: ModelSpec, layout: MegatronLayout, config, *, context_parallel: bool | None = None
                 ) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), weights uninitialised (loaded next).
    ``context_parallel``: the chunked attention of :mod:`.context` (default: when ``layout.cp`` > 1;
    True with cp 1 runs that path on one rank, for ``bench/megatron_cp.py``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    try:  # deprecated in megatron-core 0.19, still the class that takes a layer spec
        from megatron.core.models.gpt import GPTModel
    except ImportError:  # pragma: no cover - layout of later releases
        from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if spec.experts:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            # megatron-core 0.16 imports it only with TransformerEngine yet tests it for None in the
            # router's linear: without TE every MoE forward raises NameError. None = its torch path.
            moe_utils.te_general_gemm = None
    # moe_grouped_gemm stays off: without TransformerEngine megatron's grouped experts are the legacy
    # GroupedMLP, which needs the grouped_gemm CUDA extension (source only); docs/PERF.md, Actor update
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.experts or None, moe_grouped_gemm=False,
                                          normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    layer_spec.submodules.input_layernorm = RMSNorm
    if spec.qk_norm:  # built per head (hidden_size = head_dim); megatron all-reduces their gradients over tp
        layer_spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer_spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    if context_parallel if context_parallel is not None else layout.cp > 1:
        layer_spec.submodules.self_attention.submodules.core_attention = ContextParallelSDPA
    else:
        layer_spec.submodules.self_attention.submodules.core_attention = CausalSDPA
    layer_spec.submodules.pre_mlp_layernorm = RMSNorm
    # a block spec lists the layers of ONE chunk (megatron numbers them from the chunk's offset)
    per_chunk = spec.layers // (layout.pp * layout.vpp)
    block_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * per_chunk, layer_norm=RMSNorm)
    chunks = []
    for stage in range(layout.vpp):
        vp = stage if layout.vpp > 1 else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=block_spec, vocab_size=spec.padded_vocab(layout.tp),
            max_sequence_length=spec.max_positions,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=spec.tied, position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            vp_stage=vp,
        ))
        scale_rope(chunks[-1], spec)
    return chunks


def scale_rope(chunk: torch.nn.Module, spec: ModelSpec) -> None:
    """Llama 3.x RoPE scaling on ``chunk``'s rotary embedding, the one place it is set: megatron-core's
    own ``RotaryEmbedding._apply_scaling`` (the same frequency blend as Hugging Face's ``llama3`` RoPE)
    called with the model's four numbers. megatron's ``rope_scaling`` option cannot express them: it
    takes the factor only and fixes the rest to Llama 3.1's (1, 4, 8192). Runs before any forward, so
    nothing has cached frequencies yet; the tensor keeps its device."""
    if spec.rope_llama3 is None:
        return
    factor, low, high, original = spec.rope_llama3
    rotary = chunk.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, factor=factor, low_freq_factor=low,
                                            high_freq_factor=high, original_max_position_embeddings=original)
