"""The FLOPs counter (spmd_rl/models/flops.py) against torch's FlopCounterMode and hand counts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
)

from spmd_rl.models import FlopsModel, model_flops_per_token

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)

CONFIGS = {
    "llama-tied": LlamaConfig(**SMALL, tie_word_embeddings=True),
    "qwen2-untied-bias": Qwen2Config(**SMALL, tie_word_embeddings=False),
    "mistral-head-dim": MistralConfig(**SMALL, head_dim=24),
    "mixtral-moe": MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe-shared": Qwen2MoeConfig(**{**SMALL, "num_hidden_layers": 3}, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                       num_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_flops_match_torch_flop_counter(name: str) -> None:
    """Eager attention computes the full s x s score matrix, so the measured count is ours with
    s^2 pairs; every projection, expert and the head are counted by torch independently."""
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    s = 7
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, cfg.vocab_size, (1, s)))
    fm = FlopsModel.from_config(cfg)
    causal = fm.forward([s], head_tokens=s)
    full_minus_causal = 4 * fm.layers * fm.heads * fm.head_dim * (s * s - s * (s + 1) // 2)
    # some transformers releases compute RoPE's angles as a matmul (inv_freq x positions, once per
    # forward): torch counts it, the model's FLOPs do not
    rope_angles = 2 * (fm.head_dim // 2) * s
    assert counter.get_total_flops() in (causal + full_minus_causal, causal + full_minus_causal + rope_angles)


def test_qwen2_0_5b_hand_count() -> None:
    """Qwen2-0.5B has 494,032,768 parameters: the matmul weights of its 24 layers, the tied
    151936 x 896 embedding, q/k/v biases and RMSNorm weights."""
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    fm = FlopsModel.from_config(cfg)
    per_layer = 896 * 896 * 2 + 896 * 128 * 2 + 3 * 896 * 4864
    assert fm.body_macs == 24 * per_layer
    assert fm.body_macs + 151936 * 896 + 24 * (896 + 128 + 128) + (2 * 24 + 1) * 896 == 494_032_768
    # one 3-token sequence: 3 tokens of body, 6 causal pairs, logits at 2 positions
    assert fm.forward([3], head_tokens=2) == 2 * fm.body_macs * 3 + 4 * 24 * 14 * 64 * 6 + 2 * 151936 * 896 * 2
    assert model_flops_per_token(cfg, seq_len=100) == 6 * (fm.body_macs + 151936 * 896) + 12 * 24 * 896 * 100


def test_rollout_flops_are_the_fed_tokens() -> None:
    fm = FlopsModel.from_config(CONFIGS["llama-tied"])
    # prompt 5 + response 3: 7 tokens fed (prefill 5, decode 2), head at 3 positions; empty responses cost 0
    assert fm.rollout([5, 4], [3, 0]) == fm.forward([7], head_tokens=3)
    assert fm.attention([3, 4]) == 4 * fm.layers * fm.heads * fm.head_dim * (6 + 10)


def test_unsupported_shapes_say_why() -> None:
    class Mla:
        model_type, kv_lora_rank = "deepseek_v3", 512
    with pytest.raises(ValueError, match="multi-head latent attention"):
        FlopsModel.from_config(Mla())
    with pytest.raises(ValueError, match="none of the attributes"):
        FlopsModel.from_config(type("NoHidden", (), {})())


def test_grpo_step_flops_and_phase_mfu() -> None:
    from spmd_rl.metrics import grpo_step_flops, phase_mfu

    fm = FlopsModel.from_config(CONFIGS["qwen2-untied-bias"])
    prompts, responses = [4, 6], [3, 1]
    phases = grpo_step_flops(fm, prompts, responses, old_logprob=False, ref=True, ppo_epochs=2)
    fwd = fm.forward([7, 7], head_tokens=4)
    assert phases == {"gen": fm.forward([6], head_tokens=3) + fm.forward([6], head_tokens=1),
                      "old_logprob": 0.0, "ref": fwd, "update": 6 * fwd}
    seconds = {"gen": 3.0, "weight_sync": 1.0, "ref": 0.5, "update": 2.0, "old_logprob": 0.0, "step": 8.0}
    mfu = phase_mfu(phases, seconds, peak=1e3, world=2)
    assert mfu == pytest.approx({"perf/mfu/gen": phases["gen"] / 2.0 / 2e3, "perf/mfu/ref": fwd / 0.5 / 2e3,
                                 "perf/mfu/update": 6 * fwd / 2.0 / 2e3,
                                 "perf/mfu": (phases["gen"] + 7 * fwd) / 8.0 / 2e3})
