"""Continuous batching in the fast decoder (spmd_rl/rollout/fast.py): more rows than sequence slots.

Run with ``python3 -m pytest tests/test_rollout_contbatch.py -q`` (CPU, fp32); the CUDA variants (``-k cuda``)
run where a GPU is present, with CUDA graphs per batch bucket and attention span. A call of 16 rows on
2 slots makes 14 rows enter mid-way, into the slots of rows that hit an EOS id early; every row must
still equal the Hugging Face loop's greedy decode token for token, sampled runs must repeat with their
seed, and the log-probs must equal a teacher-forced recomputation. The memory check is tested with a
small fake budget, and the 1.5B shape's footprint at batch 256 x 8192 new tokens on a meta-device model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_rollout_fast import (
    CUDA,
    DEVICES,
    assert_same,
    build,
    early_eos,
    engine,
    greedy,
    random_prompts,
    responses,
    teacher_forced_logprobs,
)
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmd_rl.rollout import decode_attention, decode_step
from spmd_rl.rollout.fast import FastDecoder
from spmd_rl.rollout.slots import free_bytes, size

LENGTHS = [5, 13, 2, 9, 17, 7, 11, 3]  # 8 prompts x n = 2: 16 rows on 2 slots


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("contbatch_models")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["qwen3-gqa-qknorm", "gemma3-window"])
def test_queued_rows_take_freed_slots_and_equal_the_hf_loop(root: Path, prompts, shape: str, device: str) -> None:
    """Greedy, 16 rows on 2 slots, an EOS some rows hit early: each row equals the HF loop's (which runs
    chunks of 2); per-row length limits cut rows exactly there; a second call on CUDA recaptures nothing."""
    folder = build(root, shape)
    eos = early_eos(responses(greedy(engine(folder, device, fast=False), prompts)))
    ref = greedy(engine(folder, device, fast=False, eos=eos, batch_size=2), prompts)
    e = engine(folder, device, eos=eos, batch_size=2)
    fd = e._fast
    out = greedy(e, prompts)
    atol = 1e-5 if device == "cpu" else 1e-4
    assert_same(out, ref, atol=atol)
    lengths = ref.response_lengths.tolist()
    assert min(lengths) < max(lengths) and ref.truncated.any() and not ref.truncated.all()
    assert fd.refills > 0 and fd._shape[0] == 2  # 2 slots, refilled mid-way
    graphs = dict(fd._graphs)
    if device == "cuda":
        assert graphs and all(key[0] in fd.buckets and key[1] <= fd._shape[1] for key in graphs)
        assert_same(greedy(e, prompts), ref, atol=atol)
        assert fd._graphs == graphs  # graphs per bucket and span: the refills recaptured nothing

    # per-row limits: a row stops at its limit (truncated) or its EOS, whichever comes first
    rows = [p for p in prompts for _ in range(2)]
    limits = [1 + (3 * i) % 20 for i in range(len(rows))]
    tokens, mask, logprobs, truncated = fd.generate_chunk(
        rows, temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=20, generator=torch.Generator(device=device),
        eos=e._eos, max_new_per_row=limits)
    for i, (limit, n) in enumerate(zip(limits, lengths)):
        keep = min(limit, n)
        assert int(mask[i].sum()) == keep and tokens[i, :keep].tolist() == ref.response_ids[i, :keep].tolist()
        torch.testing.assert_close(logprobs[i, :keep].cpu(), ref.logprobs[i, :keep], atol=atol, rtol=0)
        assert bool(truncated[i]) == (limit < n or bool(ref.truncated[i]))


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_rows_entering_mid_way_are_seeded_and_their_logprobs_exact(root: Path, prompts, device: str) -> None:
    """Top-k / top-p sampling, 24 rows on 4 slots: the same seed gives the same rows, another seed others,
    and every log-prob equals ``log_softmax(logits / T)`` of a teacher-forced forward (1e-5 on CPU fp32)."""
    folder = build(root, "qwen2-gqa-untied")
    eos = early_eos(responses(greedy(engine(folder, fast=False), prompts)))
    e = engine(folder, device, eos=eos, batch_size=4)
    args = {"n": 3, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "max_new_tokens": 24}
    a, b = e.generate(prompts, seed=11, **args), e.generate(prompts, seed=11, **args)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, e.generate(prompts, seed=12, **args).response_ids)
    assert e._fast.refills > 0
    lengths = a.response_lengths
    assert lengths.min() < lengths.max()
    mask = a.response_mask.bool()
    diff = (a.logprobs - teacher_forced_logprobs(folder, a, 0.8)).abs()[mask]
    assert diff.max() <= (1e-5 if device == "cpu" else 1e-4), f"max log-prob difference {diff.max():.2e}"


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, enable_gqa, seqused_k):
    """What flash varlen computes for the decode's call (one query per row), written with SDPA: row ``i``
    attends over keys ``cu_k[i] .. cu_k[i] + seqused_k[i]`` of the flattened cache."""
    assert max_q == 1 and enable_gqa and torch.equal(cu_q, torch.arange(len(q) + 1, dtype=torch.int32))
    assert (seqused_k <= cu_k[1:] - cu_k[:-1]).all() and (seqused_k <= max_k).all()
    out = []
    for i in range(len(q)):
        keys = slice(int(cu_k[i]), int(cu_k[i] + seqused_k[i]))
        kv_heads = k.shape[1]
        o = F.scaled_dot_product_attention(q[i].unflatten(0, (kv_heads, -1)), k[keys].transpose(0, 1),
                                           v[keys].transpose(0, 1), scale=scale)
        out.append(o.flatten(0, 1))
    return torch.stack(out)


@pytest.mark.parametrize("shape", ["qwen2-gqa-untied", "gemma3-window"])
def test_the_varlen_attention_call_reads_each_rows_own_entries(root: Path, prompts, shape: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's flash varlen call (each row's keys from past its left padding to its write slot in
    the flattened cache), run on CPU through an SDPA version of the kernel: greedy with continuous
    batching equals the HF loop (Gemma 3: its global layer through varlen, its local layers in the ring)."""
    assert not decode_attention.varlen_works(dtype=torch.float32, device=torch.device("cpu"), heads=4, kv_heads=2, head_dim=16)
    folder = build(root, shape)
    eos = early_eos(responses(greedy(engine(folder, fast=False), prompts)))
    ref = greedy(engine(folder, fast=False, eos=eos, batch_size=3), prompts)
    monkeypatch.setattr(decode_step, "varlen_attn", reference_varlen)
    monkeypatch.setattr(decode_attention, "varlen_works", lambda **kwargs: True)
    e = engine(folder, eos=eos, batch_size=3)
    assert e._fast.varlen
    assert_same(greedy(e, prompts), ref)
    assert e._fast.refills > 0 and e._fast.compactions > 0


@CUDA
def test_bf16_continuous_batching_with_flash_varlen_on_cuda(root: Path, prompts) -> None:
    """bf16 on CUDA: the full-length layers attend through flash varlen inside the CUDA graphs, 16 rows on 2
    slots; its tokens and log-probs agree with masked SDPA's and the HF loop's to bf16 rounding."""
    folder = build(root, "qwen3-gqa-qknorm")
    e = engine(folder, "cuda", dtype=torch.bfloat16, batch_size=2)
    if not e._fast.varlen:  # torch 2.11's varlen_attn has no seqused_k / enable_gqa: the decode takes the Triton kernel
        import inspect

        from spmd_rl.rollout.decode_attention import varlen_attn
        params = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
        assert not {"seqused_k", "enable_gqa"} <= set(params), "varlen_attn takes the decode's arguments, yet the probe failed"
        pytest.skip(f"torch {torch.__version__}: varlen_attn lacks seqused_k / enable_gqa (the decode uses the Triton kernel, tests/test_decode_attention.py, or masked SDPA)")
    assert e._fast.use_graphs
    out = greedy(e, prompts, max_new_tokens=12)
    assert e._fast.refills > 0 and e._fast._graphs
    sdpa = engine(folder, "cuda", dtype=torch.bfloat16, batch_size=2)
    sdpa._fast.varlen = False
    hf = engine(folder, "cuda", fast=False, dtype=torch.bfloat16, batch_size=2)
    for ref in (greedy(sdpa, prompts, max_new_tokens=12), greedy(hf, prompts, max_new_tokens=12)):
        same = out.response_ids == ref.response_ids
        diff = (out.logprobs - ref.logprobs).abs()[same & ref.response_mask.bool()]
        print(f"\nbf16 varlen vs a reference: {same.float().mean():.1%} tokens equal, "
              f"log-prob mean abs diff {diff.mean():.2e}")
        assert same[:, 0].float().mean() >= 0.75 and diff.mean() < 5e-2


def test_a_cache_that_does_not_fit_fails_before_allocating(root: Path, prompts) -> None:
    e = engine(build(root, "qwen2-gqa-untied"), batch_size=4)
    fd = e._fast
    need = sum(fd.memory_needed(4, 128, 16).values())  # 4 slots, 17 + 100 -> 128 positions, 16 rows
    fd.memory_budget = need // 2
    with pytest.raises(MemoryError) as info:
        greedy(e, prompts, n=2, max_new_tokens=100)
    message = str(info.value)
    assert f"needs {size(need)} on cpu" in message and f"{size(need // 2)} is available" in message
    for flag in ("--rollout.batch-size (about ", "--rollout.max-new-tokens", "--data.max-prompt-length",
                 "--rollout.sleep-level 2"):
        assert flag in message
    assert fd.cache is None  # nothing allocated
    fd.memory_budget = need
    assert greedy(e, prompts, n=2, max_new_tokens=100).response_ids.shape[0] == 16


def test_free_memory_counts_the_allocators_cache_and_the_process_fraction(monkeypatch) -> None:
    """What a cache may take on CUDA: the allocator's unused reserve plus the driver's free memory, but
    no more than this process's memory fraction lets the allocator reserve (``pools.colocate``)."""
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * gib)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked = []

    def fraction_of(f: float):
        def get(device):  # torch's wants an index: a device without one raises there
            asked.append(device)
            return f
        return get

    for fraction, room in ((1.0, 10 + 60), (0.5, 10 + 20), (0.25, 10)):
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction_of(fraction))
        assert free_bytes(torch.device("cuda")) == room * gib, fraction
    assert asked == [0, 0, 0]
    assert free_bytes(torch.device("cpu")) is None


# Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads / 2 KV heads of 128, MLP 8960, vocab 151936, tied
QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False,
                  max_position_embeddings=32768)
H200 = 139 * 2 ** 30


def test_a_1_5b_shape_at_batch_256_with_8192_new_tokens_fits_an_h200() -> None:
    """``--rollout.max-new-tokens 8192`` at batch 256 with 1024-token prompts: the cache, buffers, prefill
    activations and the bf16 weights stay under an H200's memory (a meta-device model: nothing allocated)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_1_5B)).to(torch.bfloat16)
    fd = FastDecoder(model, device=torch.device("meta"), max_batch=256, pad_token_id=0)
    need = fd.memory_needed(256, 1024 + 8192, 256 * 4)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = sum(need.values()) + weights
    assert 50 * 2 ** 30 < need["kv"] and total < 0.8 * H200, {k: v / 2 ** 30 for k, v in need.items()}


@CUDA
def test_a_1_5b_shape_allocates_8192_new_tokens_at_batch_256_on_one_cuda_gpu(tmp_path: Path) -> None:
    """The real allocation of the case above on the GPU (rows stop after 4 tokens: the cache is sized by
    ``max_new_tokens``), under the device's memory; 1024 rows queue on 256 slots."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        Qwen2ForCausalLM(Qwen2Config(**QWEN2_1_5B)).to(torch.bfloat16).save_pretrained(tmp_path)
    torch.cuda.empty_cache()
    e = engine(str(tmp_path), "cuda", dtype=torch.bfloat16, batch_size=256)
    torch.cuda.reset_peak_memory_stats()
    rows = torch.randint(3, 1000, (1024, 1024), generator=torch.Generator().manual_seed(0)).tolist()
    _, mask, _, truncated = e._fast.generate_chunk(
        rows, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8192, generator=torch.Generator("cuda"),
        eos=e._eos, max_new_per_row=[4] * len(rows))
    assert e._fast.cache.shape[3] == 1024 + 8192 and mask.sum(-1).eq(4).all() and truncated.all()
    peak = torch.cuda.max_memory_allocated()
    print(f"\npeak {peak / 2 ** 30:.1f} GiB of {torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.1f}")
    assert peak < H200
