"""The fast decode path (spmd_rl/rollout/fast.py) against the Hugging Face decode loop of NativeRollout.

Run with ``python3 -m pytest tests/test_rollout_fast.py -q``. Tiny random Llama (also with ``llama3`` RoPE
scaling) / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 / Mistral models are built from configs (fp32 on CPU; the CUDA variants run where a GPU is present, with CUDA
graphs). Prompts are random ids of different lengths, so chunks are left-padded; a small
``batch_size`` gives several chunks and batch buckets, and an EOS id that some rows produce early
makes the live rows move to smaller buckets (compaction).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from spmd_rl.models import load_causal_lm
from spmd_rl.rollout import GenerationOutput, NativeRollout
from spmd_rl.rollout import fast
from spmd_rl.rollout.fast import FastDecoder, batch_buckets
from spmd_rl.rollout.sampling import inverse_cdf
from support.devices import cuda
from support.numerics import perturbed_copy

CUDA = cuda
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "llama-gqa-untied": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **COMMON)),
    "llama-mha-tied-bias": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=4, tie_word_embeddings=True,
                                                          attention_bias=True, mlp_bias=True, **COMMON)),
    "qwen2-gqa-tied": (Qwen2ForCausalLM, Qwen2Config(num_key_value_heads=1, tie_word_embeddings=True,
                                                     use_sliding_window=False, **COMMON)),
    "qwen2-gqa-untied": (Qwen2ForCausalLM, Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False,
                                                       use_sliding_window=False, **COMMON)),
    "qwen3-gqa-qknorm": (Qwen3ForCausalLM, Qwen3Config(num_key_value_heads=2, tie_word_embeddings=True, head_dim=16,
                                                       use_sliding_window=False, **COMMON)),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16), **COMMON)),
    # a dense first layer, then routed experts (top-2 of 8, renormalised)
    "qwen3-moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=8,
                                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                                      norm_topk_prob=True, mlp_only_layers=[0],
                                                      **{**COMMON, "num_hidden_layers": 3})),
    # local (window 6: prompts and answers run past it), global, local layers; local and global RoPE bases
    # (global linear-scaled); query_pre_attn_scalar; final logit soft-cap
    "gemma3-window": (Gemma3ForCausalLM, Gemma3TextConfig(
        num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=4.0)},
        **{**COMMON, "num_hidden_layers": 3})),
}
LENGTHS = [3, 9, 1, 14, 6, 11]


def build(root: Path, name: str, cls=None, config=None) -> str:
    folder = root / name
    if not (folder / "config.json").exists():
        cls, config = (cls, config) if cls is not None else SHAPES[name]
        torch.manual_seed(0)
        cls(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fast_models")


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of random token ids (none of them pad 0 or the ids below 3), one per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=1)


def engine(folder: str, device: str = "cpu", *, fast: bool = True, batch_size: int = 4, eos: int = VOCAB,
           dtype: torch.dtype = torch.float32) -> NativeRollout:
    """EOS defaults to an id outside the vocabulary: rows run to max_new_tokens."""
    return NativeRollout(folder, device=torch.device(device), dtype=dtype, batch_size=batch_size, pad_token_id=0,
                         eos_token_ids=[eos], fast_decode=fast)


def greedy(e: NativeRollout, prompts, n: int = 2, max_new_tokens: int = 20) -> GenerationOutput:
    return e.generate(prompts, n=n, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=0)


def responses(out: GenerationOutput) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(out.response_ids, out.response_mask)]


def early_eos(rows: list[list[int]]) -> int:
    """A token that ends some rows early but not all: the one that stops the most rows in their first 8 tokens."""
    counts = {}
    for r in rows:
        for t in set(r[:8]):
            counts[t] = counts.get(t, 0) + 1
    return max((t for t in counts if counts[t] < len(rows)), key=lambda t: counts[t])


def assert_same(a: GenerationOutput, b: GenerationOutput, atol: float = 1e-5) -> None:
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.truncated, b.truncated)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_hf_loop_with_padding_buckets_and_compaction(root: Path, prompts, shape: str,
                                                                    device: str) -> None:
    folder = build(root, shape)
    free = greedy(engine(folder, device, fast=False), prompts)
    eos = early_eos(responses(free))
    ref = greedy(engine(folder, device, fast=False, eos=eos), prompts)
    fast_engine = engine(folder, device, eos=eos)
    fast_engine._fast.check_every = 1  # look for finished rows every step, also on CUDA
    out = greedy(fast_engine, prompts)
    atol = 1e-5 if device == "cpu" else 1e-4  # GPU kernels differ between the two paths in fp32 rounding
    assert_same(out, ref, atol=atol)
    assert_same(greedy(engine(folder, device), prompts), free, atol=atol)  # no EOS: every row runs to the end
    lengths = ref.response_lengths.tolist()
    assert min(lengths) < max(lengths) and ref.truncated.any() and not ref.truncated.all()
    assert fast_engine._fast.compactions > 0  # live rows moved to a smaller bucket
    if device == "cuda" and fast_engine._fast.use_graphs:  # (fp32 experts where grouped_mm takes bf16 only: no)
        assert fast_engine._fast._graphs  # the decode step ran as CUDA graphs


def test_compiled_decode_layers_equal_the_eager_ones(root: Path, prompts, monkeypatch) -> None:
    """``compile_decode`` (the CUDA default) runs the decode step's layer halves through torch.compile;
    on CPU inductor's C++ backend compiles the same functions. Greedy with EOS and compaction, and
    seeded top-k / top-p sampling, give the eager step's tokens, and its log-probs in fp32 rounding."""
    folder = build(root, "qwen2-gqa-untied")
    eos = early_eos(responses(greedy(engine(folder, fast=False), prompts)))
    runs: list[str] = []  # names of the compiled functions, once per call of their compiled code
    real_compile = torch.compile

    def counting_compile(fn, **kwargs):
        compiled = real_compile(fn, **kwargs)
        return lambda *args: runs.append(fn.__name__) or compiled(*args)

    monkeypatch.setattr(torch, "compile", counting_compile)
    outs = {}
    for compiled in (False, True):
        e = NativeRollout(folder, device=torch.device("cpu"), dtype=torch.float32, batch_size=4, pad_token_id=0,
                          eos_token_ids=[eos], compile_decode=compiled)
        assert e._fast.compile_layers is compiled
        sampled = e.generate(prompts, n=2, temperature=0.9, top_p=0.8, top_k=15, max_new_tokens=16, seed=5)
        outs[compiled] = (greedy(e, prompts), sampled, e._fast.compactions)
        layers = len(e._fast.layers)
        if not compiled:
            assert runs == []
    # every decode step, every layer; the first half writes the step's K/V into the cache itself
    assert runs.count("attn_in_store") == runs.count("attn_out") >= layers * 2 * 15 and "attn_in" not in runs
    assert outs[True][2] > 0 and outs[True][2] == outs[False][2]
    assert_same(outs[True][0], outs[False][0])
    assert_same(outs[True][1], outs[False][1])
    assert fast._DECODE.failed is None


def teacher_forced_logprobs(folder: str, out: GenerationOutput, temperature: float) -> torch.Tensor:
    model = load_causal_lm(folder, dtype=torch.float32)
    result = torch.zeros_like(out.logprobs)
    for i, (p, r) in enumerate(zip(out.prompt_ids, responses(out))):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        result[i, :len(r)] = logp[torch.arange(len(p) - 1, len(p) - 1 + len(r)), torch.tensor(r)]
    return result


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (15, 0.8)])
def test_sampling_is_seeded_and_logprobs_match_teacher_forcing(root: Path, prompts, top_k: int,
                                                               top_p: float) -> None:
    folder = build(root, "qwen2-gqa-tied")
    e = engine(folder, eos=early_eos(responses(greedy(engine(folder, fast=False), prompts))))
    args = dict(n=3, temperature=0.8, top_k=top_k, top_p=top_p, max_new_tokens=16)
    a, b = e.generate(prompts, seed=4, **args), e.generate(prompts, seed=4, **args)
    c = e.generate(prompts, seed=5, **args)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert len({tuple(r) for r in responses(a)[:3]}) > 1
    mask = a.response_mask.bool()
    diff = (a.logprobs - teacher_forced_logprobs(folder, a, 0.8)).abs()[mask]
    assert diff.max() <= 1e-4, f"max log-prob difference {diff.max():.2e}"
    assert (a.logprobs[~mask] == 0).all() and (a.logprobs[mask] < 0).all()


def test_sampler_draws_from_the_filtered_distribution(root: Path) -> None:
    fast = engine(build(root, "llama-gqa-untied"))._fast
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scaled = torch.log(probs).expand(20000, 4)
    lse = torch.logsumexp(scaled, -1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))  # the step's uniforms, one per row
    tokens, logprobs = fast._pick(scaled, lse, u, top_k=3, top_p=1.0)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log(probs)[tokens])  # log-probs before filtering
    tokens, _ = fast._pick(scaled, lse, u, top_k=0, top_p=0.6)
    assert set(tokens.tolist()) == {0, 1}
    assert fast._pick(scaled, lse, None, top_k=0, top_p=1.0)[0].eq(0).all()  # greedy: argmax
    assert batch_buckets(1) == [1] and batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("vocab", [4, 5, 1000, 4097, 151936])
def test_two_level_inverse_cdf_picks_the_token_a_float64_scan_picks(vocab: int) -> None:
    """``inverse_cdf`` (block sums, then one block) against one float64 running total over the vocabulary:
    the token whose interval holds ``u`` of the mass, up to float32 rounding at an interval's edge; never
    a filtered (zero-probability) token, also at u = 0, u just below 1 and rows with one token left."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(96, vocab, generator=g) * 3
    logits[32:64, torch.randperm(vocab, generator=g)[: vocab // 2]] = float("-inf")  # filtered tokens
    logits[64:68] = float("-inf")
    logits[64:68, vocab // 2] = 0.0  # one token of mass
    lse = torch.logsumexp(logits, -1)
    u = torch.rand(96, generator=g)
    u[::3], u[1::7] = 0.0, 1 - 2 ** -24
    tok = inverse_cdf(logits, lse, u)
    assert torch.isfinite(logits.gather(1, tok[:, None])).all()
    cdf = F.pad(torch.exp(logits.double() - lse.double()[:, None]).cumsum(-1), (1, 0))  # mass before each token
    target = u.double() * cdf[:, -1]
    low, high = cdf.gather(1, tok[:, None]).squeeze(1), cdf.gather(1, tok[:, None] + 1).squeeze(1)
    assert ((low <= target + 1e-6) & (target < high + 1e-6)).all()
    exact = torch.searchsorted(cdf[:, 1:].contiguous(), target[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    assert (tok != exact).sum() <= 2  # only where u falls within float32 rounding of an edge
    assert tok[64:68].eq(vocab // 2).all()


def test_hot_swap_reaches_the_fast_path(root: Path, prompts, tmp_path: Path) -> None:
    folder = build(root, "llama-mha-tied-bias")
    e = engine(folder)
    before = greedy(e, prompts)
    e.load_weights(perturbed_copy(folder, tmp_path, scale=0.05).items())
    after = greedy(e, prompts)
    assert not torch.equal(before.response_ids, after.response_ids)
    assert_same(after, greedy(engine(str(tmp_path), fast=False), prompts))


@pytest.mark.parametrize("device", DEVICES)
def test_sleep_frees_the_kv_cache_and_wake_up_restores_it(root: Path, prompts, device: str) -> None:
    e = engine(build(root, "qwen2-gqa-untied"), device)
    ref = greedy(e, prompts)
    fast = e._fast
    shape = tuple(fast.cache.shape)
    saved = [(name, p.detach().clone()) for name, p in e.model.named_parameters()]
    for level in (1, 2):
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        e.sleep(level)
        assert fast.cache is None and not fast._graphs
        if device == "cuda":
            freed = before - torch.cuda.memory_allocated()
            assert freed >= math.prod(shape) * 4, f"sleep({level}) freed {freed} bytes"
        if e.needs_weights:  # a level-2 sleep on the CPU drops the weights: the next sync brings them back
            e.load_weights(saved)
        e.wake_up()
        assert tuple(fast.cache.shape) == shape
        assert_same(greedy(e, prompts), ref, atol=0)
    graphs = dict(fast._graphs)
    cache = fast.cache
    e.sleep(0)  # keeps the cache and the captured graphs: the next call reuses them, nothing is recaptured
    e.wake_up()
    assert fast.cache is cache and fast._graphs == graphs and (device == "cpu" or graphs)
    assert_same(greedy(e, prompts), ref, atol=0)
    assert fast._graphs == graphs
    e.close()


def test_fallbacks_are_logged_and_use_the_hf_loop(root: Path, prompts, caplog: pytest.LogCaptureFixture) -> None:
    gpt2 = build(root, "gpt2", GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        assert engine(gpt2)._fast is None
    assert "fast decode is off (model_type 'gpt2' is not one of ('llama', 'mistral', 'qwen2', 'qwen3', " in caplog.text
    with pytest.raises(ValueError, match="FastDecoder: model_type 'gpt2'"):
        FastDecoder(load_causal_lm(gpt2, dtype=torch.float32), device=torch.device("cpu"), max_batch=2,
                    pad_token_id=0)


def test_sliding_window_past_the_window_equals_the_hf_loop(root: Path, prompts,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Mistral's window on every layer: prompts and answers longer than it stay on the fast path, every
    layer's K/V in the window-sized ring (slots wrap around it), and Gemma 3's local layers in the ring
    beside its global layer's full-length cache."""
    mistral = build(root, "mistral-window", MistralForCausalLM, MistralConfig(num_key_value_heads=2,
                                                                              sliding_window=12, **COMMON))
    e = engine(mistral)
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        long = greedy(e, prompts)  # up to 14 + 20 tokens, window 12
    assert not caplog.text and e._fast.windows == [12, 12]
    assert e._fast.cache.shape[0] == 0 and e._fast.ring.shape[:2] == (2, 2) and e._fast.ring.shape[4] == 12
    assert_same(long, greedy(engine(mistral, fast=False), prompts))
    gemma = engine(build(root, "gemma3-window"))
    greedy(gemma, prompts, max_new_tokens=2)  # its equality to HF: the greedy test's gemma3-window shape
    assert gemma._fast.cache.shape[0] == 1 and gemma._fast.ring.shape[0] == 2 and gemma._fast.ring.shape[4] == 6


def test_moe_experts_loop_equals_grouped_gemms(root: Path, prompts, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``F.grouped_mm`` cannot run (probe fails), the experts run as a loop over the experts that got
    tokens: the same tokens and log-probs as the grouped GEMMs (which CPU torch runs)."""
    folder = build(root, "qwen3-moe")
    grouped = engine(folder)
    assert grouped._fast.grouped_experts and grouped._fast.kind == ["dense", "moe", "moe"]
    ref = greedy(grouped, prompts, max_new_tokens=8)
    monkeypatch.setattr(fast, "grouped_mm_works", lambda weight: False)
    looped = engine(folder)
    assert not looped._fast.grouped_experts and not looped._fast.use_graphs
    assert_same(greedy(looped, prompts, max_new_tokens=8), ref)


@CUDA
@pytest.mark.parametrize("shape", ["qwen2-gqa-tied", "qwen3-moe", "gemma3-window"])
def test_bf16_cuda_graphs_agree_with_the_hf_loop(root: Path, prompts, shape: str) -> None:
    folder = build(root, shape)
    fast_engine = engine(folder, "cuda", dtype=torch.bfloat16, batch_size=8)
    assert fast_engine._fast.use_graphs  # bf16 experts: grouped GEMMs, so the MoE step is a CUDA graph too
    out = greedy(fast_engine, prompts, max_new_tokens=12)
    ref = greedy(engine(folder, "cuda", fast=False, dtype=torch.bfloat16, batch_size=8), prompts, max_new_tokens=12)
    agree = (out.response_ids == ref.response_ids).float().mean().item()
    diff = (out.logprobs - ref.logprobs).abs()[(out.response_ids == ref.response_ids) & ref.response_mask.bool()]
    print(f"\nbf16 fast vs HF loop: {agree:.1%} of tokens equal, log-prob mean abs diff {diff.mean():.2e}")
    assert (out.response_ids[:, 0] == ref.response_ids[:, 0]).float().mean() >= 0.75 and diff.mean() < 5e-2


@pytest.mark.parametrize("duck_shapes,graphs", [(True, 2), (False, 1)])
def test_decode_group_compiles_a_cache_writer_once_for_every_bucket(duck_shapes: bool, graphs: int) -> None:
    """The decode layers' group compiles without duck shapes: a first call where the step's rows equal the
    cache's rows (the full bucket) must not tie the two sizes, or every smaller bucket compiles again."""
    from torch._dynamo.utils import counters

    from spmd_rl.compiled import CompileGroup

    def write(cache, at, x):
        cache[at] = x * 2
        return x + 1

    torch._dynamo.reset()
    counters.clear()
    fn = CompileGroup("a test group", duck_shapes=duck_shapes).wrap(write)
    cache = torch.zeros(4, 3)
    for rows in (4, 3, 2):
        fn(cache, torch.arange(rows), torch.ones(rows, 3))
    assert counters["stats"]["unique_graphs"] == graphs
    assert cache[:2].eq(2).all()


def test_each_rows_uniforms_are_its_own_and_uniform() -> None:
    """The fast path's uniforms (spmd_rl/rollout/sampling.py): a row's depend on the seed, its key and its
    prompt's length only, are uniform on [0, 1), and neither neighbouring rows nor a row's successive
    tokens are correlated."""
    from spmd_rl.rollout.sampling import row_seed, row_uniforms

    seeds = [row_seed(7, key, 5) for key in range(4000)]
    assert len(set(seeds)) == 4000 and all(0 <= s < 2 ** 63 for s in seeds)
    assert len({row_seed(7, 3, 5), row_seed(7, 3, 6), row_seed(8, 3, 5), row_seed(7, (0, 3), 5), row_seed(7, "3", 5)}) == 5
    u = row_uniforms(seeds, [8] * 4000)
    assert u.shape == (4000, 8) and 0 <= float(u.min()) and float(u.max()) < 1
    torch.testing.assert_close(torch.histc(u, bins=10, min=0, max=1) / u.numel(), torch.full((10,), 0.1), atol=0.005, rtol=0)
    centred = u - 0.5
    for a, b in ((centred[:, :-1], centred[:, 1:]), (centred[:-1], centred[1:])):  # successive tokens, rows
        corr = float((a * b).mean() / (a.std() * b.std()))
        assert abs(corr) < 0.02, corr
    assert torch.equal(row_uniforms([seeds[9]], [8])[0], u[9])  # the same row, alone: the same uniforms
    short = row_uniforms([1, 2], [3, 1])
    assert short.shape == (2, 3) and short[1, 1:].eq(0).all() and short[1, 0] > 0
