"""Megatron engine rules that need no process group: which HF models and layouts are accepted (each
error names the flag and the numbers), the pp 2 + vpp p2p guard, and the fused-weight layouts."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig, Qwen2Config

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
    with pytest.raises(ValueError, match=re.escape("actor.engine=megatron supports Hugging Face model types")):
        ModelSpec.from_hf(type("C", (), {"model_type": "gpt2"})())


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
