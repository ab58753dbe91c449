"""The FSDP engine's attention forward (spmd_rl/engine/attention.py) against Hugging Face's own.

The same weights run through HF's attention forward and through ``natural_layout_forward`` (RoPE on
``[b, s, heads, d]``), both with the engine's attention function on packed rows: the dense-mask CPU
path, and the flash layout path with a per-run SDPA standing in for the CUDA kernel. Outputs and
every parameter gradient must agree (fp32), also with the layers under ``torch.compile``. Also:
what ``install`` refuses, and the engine's error for a sequence longer than the model's sliding
window.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
    Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

from spmd_rl.engine import attention, ulysses
from test_varlen import reference_varlen

COMMON = dict(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              max_position_embeddings=64, initializer_range=0.2)
MODELS = {
    "llama-gqa-bias": lambda: LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                                                           **COMMON)),
    "qwen2-gqa-tied": lambda: Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=3, tie_word_embeddings=True,
                                                           use_sliding_window=False, **COMMON)),
    "qwen3-gqa-qknorm": lambda: Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=3, head_dim=8, use_sliding_window=False,
                                                             **COMMON)),
    "mistral-mha": lambda: MistralForCausalLM(MistralConfig(num_key_value_heads=6, sliding_window=None, **COMMON)),
}
# two packed rows: sequences of 3 and 2 tokens then one padding token, and one sequence of 6
SEGMENTS = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])


def _run(model: torch.nn.Module, ids: torch.Tensor, spec: ulysses.AttnSpec) -> tuple[torch.Tensor, dict]:
    logits = model(input_ids=ids, position_ids=POSITIONS, attention_mask=None, use_cache=False, spmd_attn=spec).logits
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("flash_layout", [False, True], ids=["dense-mask", "flash-layout"])
@pytest.mark.parametrize("name", list(MODELS))
def test_natural_layout_forward_equals_hf(name: str, flash_layout: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    ulysses.register_attention()
    torch.manual_seed(0)
    hf = MODELS[name]()
    hf.config._attn_implementation = ulysses.ATTENTION_NAME
    ours = copy.deepcopy(hf)
    assert attention.install(ours)
    assert all("forward" in vars(layer.self_attn) for layer in ours.model.layers)
    if flash_layout:  # the CUDA kernel's call, with a per-run SDPA in its place
        monkeypatch.setattr(ulysses, "_flash_varlen", reference_varlen)
        cu, longest = ulysses.varlen_runs(SEGMENTS)
        spec = ulysses.AttnSpec(cu_seqlens=cu, max_seqlen=longest)
    else:
        spec = ulysses.AttnSpec(mask=ulysses.block_causal_mask(SEGMENTS))
    ids = torch.randint(0, 61, SEGMENTS.shape, generator=torch.Generator().manual_seed(1))
    logits_hf, grads_hf = _run(hf, ids, spec)
    logits, grads = _run(ours, ids, spec)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, logits_hf, **tol)
    assert grads.keys() == grads_hf.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], grads_hf[n], **tol, msg=lambda m, n=n: f"gradient of {n}: {m}")


def test_compiled_layers_equal_eager() -> None:
    """The installed attention with the layers under torch.compile (CPU inductor, as
    ``actor.fsdp.compile_layers``): the same logits and gradients as the eager layers."""
    ulysses.register_attention()
    torch.manual_seed(0)
    eager = MODELS["qwen2-gqa-tied"]()
    eager.config._attn_implementation = ulysses.ATTENTION_NAME
    assert attention.install(eager)
    compiled = copy.deepcopy(eager)
    for layer in compiled.model.layers:
        layer.compile(dynamic=True)
    spec = ulysses.AttnSpec(mask=ulysses.block_causal_mask(SEGMENTS))
    ids = torch.randint(0, 61, SEGMENTS.shape, generator=torch.Generator().manual_seed(1))
    logits_eager, grads_eager = _run(eager, ids, spec)
    logits, grads = _run(compiled, ids, spec)
    torch.testing.assert_close(logits, logits_eager, rtol=2e-4, atol=2e-5)
    for n in grads:  # inductor reorders the norms' and RoPE's fp32 sums: compare each gradient as a whole
        err = ((grads[n] - grads_eager[n]).norm() / grads_eager[n].norm()).item()
        assert err < 1e-5, (n, err)


def test_sliding_window_from_the_config() -> None:
    from spmd_rl.models import sliding_window

    assert sliding_window(LlamaConfig(**COMMON)) is None
    assert sliding_window(MistralConfig(sliding_window=12, **COMMON)) == 12
    assert sliding_window(MistralConfig(sliding_window=None, **COMMON)) is None
    assert sliding_window(Qwen2Config(sliding_window=16, use_sliding_window=False, **COMMON)) is None
    assert sliding_window(Qwen2Config(sliding_window=16, use_sliding_window=True, max_window_layers=1,
                                      **COMMON)) == 16  # layer 1 of 2 slides
    from spmd_rl.engine.megatron.model import ModelSpec  # the megatron engine refuses the same sequences

    assert ModelSpec.from_hf(MistralConfig(sliding_window=12, **COMMON)).sliding_window == 12


def test_install_leaves_other_models_alone() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_embd=32, n_layer=1, n_head=2))
    forwards = [type(m).forward for m in gpt2.modules()]
    assert not attention.install(gpt2)
    assert [type(m).forward for m in gpt2.modules()] == forwards and not any("forward" in vars(m) for m in gpt2.modules())


def _window_body(rank: int, world_size: int, folder: str) -> dict:
    from spmd_rl.config import FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), trainable=False, pad_token_id=0)

    def batch(prompt: int, response: int) -> RolloutBatch:
        return RolloutBatch(prompts=[list(range(3, 3 + prompt))],
                            tensors={"response_ids": torch.full((1, response), 5),
                                     "response_mask": torch.ones(1, response)})

    logprobs, _ = engine.compute_logprobs(batch(4, 4), temperature=1.0, micro_batch_size=1)  # 8 tokens: fine
    try:
        engine.compute_logprobs(batch(5, 4), temperature=1.0, micro_batch_size=1)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"window": engine.sliding_window, "installed": engine.natural_attention,
            "shape": tuple(logprobs.shape), "error": error}


def test_engine_refuses_sequences_longer_than_the_sliding_window(tmp_path) -> None:
    """The engine's attention is full causal: a Mistral whose window a sequence exceeds must stop with the
    flags to change, not train on a different function than the model's."""
    from spmd_rl.distributed.testing import run_distributed

    MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=8, **COMMON)).save_pretrained(tmp_path)
    (got,) = run_distributed(_window_body, 1, str(tmp_path))
    assert got["window"] == 8 and got["installed"] and got["shape"] == (1, 4)
    assert got["error"] is not None
    assert "a sequence of 9 tokens exceeds the model's sliding window (8); the FSDP engine's" in got["error"]
    assert "data.max_prompt_length + rollout.max_new_tokens" in got["error"]
