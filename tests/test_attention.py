"""The FSDP engine's attention forward (spmd_rl/engine/attention.py) against Hugging Face's own.

The same weights run through HF's attention forward and through ``natural_layout_forward`` (RoPE on
``[b, s, heads, d]``), both with the engine's attention function on packed rows: the dense-mask CPU
path, and the flash layout path with a per-run SDPA standing in for the CUDA kernel. Outputs and
every parameter gradient must agree (fp32, to its rounding), also with the layers under ``torch.compile``. Also:
what ``install`` refuses, and the engine's log-probs against the model's own HF forward past sliding
windows (Mistral, Gemma 3) and for Qwen3-MoE.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from spmd_rl.engine import attention, norms, ulysses
from spmd_rl.models.families import layer_windows
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
    "qwen3-moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(num_key_value_heads=3, head_dim=8, num_experts=4,
                                                            num_experts_per_tok=2, moe_intermediate_size=16, **COMMON)),
    # a local layer of window 3 (runs of 6 tokens go past it), then a global one
    "gemma3-window": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        num_key_value_heads=3, head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=12, **COMMON)),
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
    tol = dict(rtol=1e-5, atol=1e-5)  # float32 rounding: RoPE's products and sums are fused (attention.Rope)
    torch.testing.assert_close(logits, logits_hf, **tol)
    assert grads.keys() == grads_hf.keys()
    for n in grads:  # summed over many positions (the embedding's over every token): float32 rounding grows
        torch.testing.assert_close(grads[n], grads_hf[n], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, n=n: f"gradient of {n}: {m}")


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


def _engine_body(rank: int, world_size: int, folders: dict[str, str]) -> dict:
    from spmd_rl.config import FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 61, (n,), generator=gen).tolist() for n in (5, 9, 2)]
    responses = torch.randint(3, 61, (3, 7), generator=gen)
    mask = torch.ones(3, 7)
    mask[0, 5:] = 0  # a shorter response
    batch = RolloutBatch(prompts=prompts, tensors={"response_ids": responses, "response_mask": mask})
    got = {}
    for name, folder in folders.items():
        for packed in (False, True) if name == "gemma3-window" else (False,):  # packed runs: Gemma 3's windows
            engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                                fsdp=FsdpConfig(), trainable=False, pad_token_id=0, use_packing=packed)
            logprobs, _ = engine.compute_logprobs(batch, temperature=0.7, micro_batch_size=2)
            got[name, packed] = (logprobs, engine.natural_attention)
    hf = {}
    for name, folder in folders.items():  # HF's own forward (its own attention and masks), one row at a time
        from spmd_rl.models import load_causal_lm

        model = load_causal_lm(folder, dtype=torch.float32)
        rows = []
        for p, r in zip(prompts, responses):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + r.tolist()])).logits[0]
            lp = torch.log_softmax(logits / 0.7, -1)[len(p) - 1:len(p) + 6].gather(-1, r[:, None]).squeeze(-1)
            rows.append(lp)
        hf[name] = torch.stack(rows) * mask
    return {"got": got, "hf": hf}


def test_engine_logprobs_equal_the_hf_forward_past_sliding_windows(tmp_path) -> None:
    """The FSDP engine (padded and packed rows) against the model's own HF forward, with sequences of up to
    16 tokens: Mistral (window 8 on every layer), Gemma 3 (a local layer of window 3, a global one) and
    Qwen3-MoE (HF's expert GEMMs, the engine's attention)."""
    from spmd_rl.distributed.testing import run_distributed

    torch.manual_seed(0)
    folders = {"mistral-window": MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=8, **COMMON)),
               "gemma3-window": MODELS["gemma3-window"](), "qwen3-moe": MODELS["qwen3-moe"]()}
    for name, model in folders.items():
        model.save_pretrained(tmp_path / name)
    (out,) = run_distributed(_engine_body, 1, {name: str(tmp_path / name) for name in folders})
    for (name, packed), (logprobs, installed) in out["got"].items():
        assert installed, name
        torch.testing.assert_close(logprobs, out["hf"][name], rtol=0, atol=1e-5, msg=lambda m: f"{name} {packed}: {m}")


def test_stored_windows_compile_one_graph_for_all_layers() -> None:
    """A decoder layer compiled in place is one code object for every layer: the window must not make
    torch.compile guard on ``layer_idx`` (one recompile per layer, the layers past the recompile limit
    running eager). With :func:`ulysses.annotate_windows`, 10 full layers compile once and Gemma 3's
    sliding and global layers twice."""
    from torch._dynamo.testing import CompileCounter

    def window_plus(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = ulysses.layer_window(module)
        return x + (0 if w is None else w)

    x = torch.zeros(2)
    models = {"qwen3": (Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "num_hidden_layers": 10}, num_key_value_heads=3,
                                                      head_dim=8, use_sliding_window=False)), 1),
              "gemma3": (Gemma3ForCausalLM(Gemma3TextConfig(
                  **{**COMMON, "num_hidden_layers": 10}, num_key_value_heads=3, head_dim=8, sliding_window=3,
                  query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"] * 5)), 2)}
    for name, (model, graphs) in models.items():
        ulysses.annotate_windows(model)
        counter = CompileCounter()
        compiled = torch.compile(window_plus, backend=counter)
        torch._dynamo.reset()
        outs = [compiled(layer.self_attn, x) for layer in model.model.layers]
        assert counter.frame_count == graphs, name
        expected = [w or 0 for w in layer_windows(model.config)]
        assert [float(o[0]) for o in outs] == [float(w) for w in expected], name


def test_rope_function_is_hf_rope_and_its_gradient() -> None:
    """``attention.Rope`` (three kernels each way) against HF's ``x * cos + rotate_half(x) * sin``: values and
    gradients in float32 (to its rounding) and float64, also when the two halves of the tables differ;
    gradcheck in float64."""
    torch.manual_seed(0)
    angles = torch.randn(2, 7, 1, 4, dtype=torch.float64)
    cos = torch.cat([angles.cos(), (angles * 0.7).cos()], -1)
    sin = torch.cat([angles.sin(), (angles * 1.3).sin()], -1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-14)):
        x = torch.randn(2, 7, 3, 8, dtype=dtype, requires_grad=True)
        c, s, grad = cos.to(dtype), sin.to(dtype), torch.randn(2, 7, 3, 8, dtype=dtype)
        hf = x * c + torch.cat((-x[..., 4:], x[..., :4]), -1) * s
        ours = attention.Rope.apply(x, c, s)
        torch.testing.assert_close(ours, hf, atol=tol, rtol=0)
        torch.testing.assert_close(torch.autograd.grad(ours, x, grad)[0], torch.autograd.grad(hf, x, grad)[0],
                                   atol=tol, rtol=0)
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: attention.Rope.apply(t, cos, sin), (x,))


@pytest.mark.parametrize("name", ["llama-gqa-bias", "qwen3-gqa-qknorm", "gemma3-window", "gpt2"])
def test_fused_norms_equal_hf_norms(name: str) -> None:
    """``norms.install_norms``: every RMSNorm of a Llama-like model (Qwen3's q/k norms too) runs
    ``F.rms_norm``, with HF's float32 outputs and gradients; in bf16 within a rounding step of the
    output. Gemma 3 (``1 + w``) and other model types are left alone."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=61)) if name == "gpt2" \
        else MODELS[name]()
    model.eval()  # GPT-2's dropout
    norms_of = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in norms_of:
        m.weight.data.normal_(1.0, 0.5)
    fused = copy.deepcopy(model)
    count = norms.install_norms(fused)
    expected = len(norms_of) if name in ("llama-gqa-bias", "qwen3-gqa-qknorm") else 0
    assert count == expected and (name != "qwen3-gqa-qknorm" or count == 2 * 4 + 1)  # q/k norms too
    ids = torch.randint(0, 61, (2, 9))
    ref, out = model(input_ids=ids).logits, fused(input_ids=ids).logits
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    if not count:
        return
    ref.square().sum().backward()
    out.square().sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=n)
    norm = next(m for m in fused.modules() if type(m).__name__.endswith("RMSNorm")).to(torch.bfloat16)
    x = torch.randn(5, norm.weight.shape[0], dtype=torch.bfloat16) * 3
    hf = type(norm).forward(norm, x)
    assert norm(x).dtype == torch.bfloat16
    torch.testing.assert_close(norm(x).float(), hf.float(), atol=0, rtol=2 ** -7)  # one bf16 rounding step
