"""Megatron engine rules that need no process group: which HF models and layouts are accepted (each
error names the flag and the numbers), the pp 2 + vpp p2p guard, and the fused-weight layouts."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from spmd_rl.distributed.dims import MegatronLayout
from spmd_rl.engine.megatron.convert import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from spmd_rl.engine.megatron.engine import batch_p2p_comm_for
from spmd_rl.engine.megatron.model import ModelSpec, check_layout

LLAMA = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=101)
MIXTRAL = MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, vocab_size=104)

BAD = [
    (LLAMA, dict(size=4, tp=4), "actor.megatron.tp (4) must divide the attention heads (4) and key/value heads (2)"),
    (LLAMA, dict(size=8, pp=8), "actor.megatron.pp (8) * actor.megatron.vpp (1) = 8 must divide the model's 4 layers"),
    (LLAMA, dict(size=4, pp=2, vpp=4), "actor.megatron.pp (2) * actor.megatron.vpp (4) = 8 must divide the model's 4 layers"),
    (LLAMA, dict(size=2, ep=2), "actor.megatron.ep (2) > 1 needs a mixture-of-experts model; this one is dense"),
    (MIXTRAL, dict(size=8, ep=8), "actor.megatron.ep (8) must divide the model's 4 experts"),
]


@pytest.mark.parametrize("config,layout,message", BAD, ids=[b[2][:40] for b in BAD])
def test_impossible_layouts_name_the_flag(config, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_layout(ModelSpec.from_hf(config), MegatronLayout(**layout))


def test_supported_models():
    spec = ModelSpec.from_hf(Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=101))
    assert spec.qkv_bias and spec.padded_vocab(2) == 102 and spec.padded_vocab(1) == 101
    moe = ModelSpec.from_hf(MIXTRAL)
    assert (moe.experts, moe.top_k, moe.moe_ffn, moe.family) == (4, 2, 96, "mixtral")
    check_layout(moe, MegatronLayout(4, ep=4))
    check_layout(ModelSpec.from_hf(LLAMA), MegatronLayout(8, tp=2, pp=2, vpp=2))
    check_layout(ModelSpec.from_hf(LLAMA), MegatronLayout(8, tp=2, cp=2, pp=2))  # cp: the engine's own attention
    with pytest.raises(ValueError, match=re.escape("actor.engine=megatron does not convert Hugging Face model type "
                                                   "'gpt2'; it supports llama (")):
        ModelSpec.from_hf(type("C", (), {"model_type": "gpt2"})())


SMALL = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=101)


def test_qwen3_qwen3_moe_and_llama3_rope_specs():
    """What the 2026 families set in the spec and in megatron-core's config (the conversions and
    their numerics: tests/test_megatron_families.py)."""
    from spmd_rl.engine.megatron.model import transformer_config

    def tf(spec, **layout):
        return transformer_config(spec, MegatronLayout(layout.pop("size", 1), **layout), params_dtype=torch.float32,
                                  bf16=False, sequence_parallel=layout.get("tp", 1) > 1, batch_p2p_comm=True)

    qwen3 = ModelSpec.from_hf(Qwen3Config(head_dim=16, **SMALL))  # not hidden / heads = 8
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.family) == (True, False, 16, "qwen3")
    config = tf(qwen3)
    assert config.qk_layernorm and config.kv_channels == 16 and not config.num_moe_experts
    moe = ModelSpec.from_hf(Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                           norm_topk_prob=True, **SMALL))
    assert (moe.experts, moe.top_k, moe.moe_ffn, moe.ffn, moe.qk_norm, moe.norm_topk) == (4, 2, 8, 8, True, True)
    config = tf(moe, size=2, ep=2)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 8)
    assert not config.moe_router_pre_softmax and config.moe_shared_expert_intermediate_size is None
    # norm_topk_prob off: the top-k entries of the softmax over all experts, as they are
    raw = ModelSpec.from_hf(Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                           norm_topk_prob=False, **SMALL))
    assert tf(raw).moe_router_pre_softmax
    llama3 = ModelSpec.from_hf(LlamaConfig(max_position_embeddings=16384, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192), **SMALL))
    assert llama3.rope_llama3 == (32.0, 1.0, 4.0, 8192) and llama3.rope_theta == 500000.0
    assert ModelSpec.from_hf(LlamaConfig(**SMALL)).rope_llama3 is None


REFUSED = [
    (Gemma3TextConfig(**SMALL), ("actor.engine=megatron does not convert Hugging Face model type 'gemma3_text'; "
                                 "it supports llama (Llama 2 / 3.x (incl. llama3 RoPE scaling)), mistral (Mistral), "
                                 "qwen2 (Qwen2 / Qwen2.5), qwen3 (Qwen3 (q/k RMSNorm)), qwen3_moe (Qwen3-MoE (routed "
                                 "experts)), mixtral (Mixtral (routed experts)); use --actor.engine fsdp")),
    (LlamaConfig(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=256), **SMALL),
     "actor.engine=megatron supports the default and the llama3 RoPE, the model has rope_type 'yarn'"),
    (Qwen3MoeConfig(num_experts=4, mlp_only_layers=[1], **SMALL),
     ("actor.engine=megatron converts Qwen3-MoE models whose every layer is routed; this one has dense layers "
      "(mlp_only_layers=[1], decoder_sparse_step=1)")),
]


@pytest.mark.parametrize("config,message", REFUSED, ids=[r[1][:48] for r in REFUSED])
def test_unsupported_models_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelSpec.from_hf(config)


def test_moe_under_tp_needs_sequence_parallel():
    from spmd_rl.engine.megatron.model import transformer_config

    with pytest.raises(ValueError, match=re.escape("actor.megatron.tp (2) > 1 on a mixture-of-experts model needs "
                                                   "--actor.megatron.sequence-parallel")):
        transformer_config(ModelSpec.from_hf(MIXTRAL), MegatronLayout(2, tp=2), params_dtype=torch.float32,
                           bf16=False, sequence_parallel=False, batch_p2p_comm=True)


def test_batched_p2p_off_only_for_pp2_with_vpp():
    assert not batch_p2p_comm_for(MegatronLayout(4, pp=2, vpp=2))
    assert batch_p2p_comm_for(MegatronLayout(4, pp=2))
    assert batch_p2p_comm_for(MegatronLayout(8, pp=4, vpp=2))


def test_fused_layouts_round_trip():
    spec = ModelSpec.from_hf(LLAMA)  # 4 heads in 2 groups of head_dim 16
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    qkv = fuse_qkv(spec, q, k, v)
    # group 0 = its two query heads, its key head, its value head
    assert torch.equal(qkv[:32], q[:32]) and torch.equal(qkv[32:48], k[:16]) and torch.equal(qkv[48:64], v[:16])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(spec, qkv), (q, k, v)))
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    fc1 = fuse_gate_up(gate, up, 2)  # tp rank r holds [gate_r; up_r]
    assert torch.equal(fc1[:48], gate[:48]) and torch.equal(fc1[48:96], up[:48])
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(fc1, 2), (gate, up)))


def test_vocab_parallel_logprobs_one_rank_equals_full_softmax():
    from support.reference import entropy_from_logits, logprobs_from_logits
    from spmd_rl.engine.megatron.vocab import vocab_parallel_logprobs

    logits = torch.randn(7, 12)
    labels = torch.randint(0, 10, (7,))
    padded = torch.cat([logits[:, :10], torch.full((7, 2), 50.0)], dim=1)  # 2 padding columns
    logp, ent = vocab_parallel_logprobs(padded, labels, group=None, vocab_start=0, vocab=10, entropy=True)
    torch.testing.assert_close(logp, logprobs_from_logits(logits[:, :10], labels))
    torch.testing.assert_close(ent, entropy_from_logits(logits[:, :10]))
