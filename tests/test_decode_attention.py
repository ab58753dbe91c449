"""The Triton decode attention (spmd_rl/rollout/decode_attention.py) against SDPA, alone and in the fast decoder.

Run with ``python3 -m pytest tests/test_decode_attention.py -q``. On CUDA the kernel runs in bf16 / fp16
on rows of very different lengths (one split and several), and the fast decoder with it (16 rows on 3
slots, CUDA graphs) agrees with masked SDPA and the HF loop to bf16 rounding. Off CUDA the kernels run
only in Triton's interpreter: where ``triton`` is importable (CPU wheels of torch do not ship it), one
test re-runs this file under ``TRITON_INTERPRET=1`` in fp32 / fp16 (the interpreter's bf16 ``tl.dot``
is wrong as of triton 3.9), which also checks that the decoder's calls give the HF loop's greedy tokens;
else these tests skip with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_rollout_fast import assert_same, build, early_eos, engine, greedy, responses

from spmd_rl.rollout import decode_attention as da

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# where the kernels run in this process: CUDA, or the CPU under Triton's interpreter
DEVICE = "cuda" if torch.cuda.is_available() and da.triton is not None else "cpu" if INTERPRETED else None
KERNEL = pytest.mark.skipif(DEVICE is None, reason="the Triton kernel runs on CUDA (on CPU only in Triton's "
                                                   "interpreter: see test_the_kernels_in_tritons_interpreter)")
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]
LENGTHS = [5, 13, 2, 9, 17, 7, 11, 3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("decode_attention_models")


def test_splits_fill_the_gpu_and_cover_the_span() -> None:
    """Many rows: one split per row and KV head; few long rows: splits of at least 256 keys; always
    ``splits * chunk >= span`` with ``chunk`` a multiple of the key block."""
    assert da.splits_for(1024, 8, 4224) == (1, 4224)
    assert da.splits_for(256, 8, 4224) == (2, 2112)
    assert da.splits_for(4, 8, 4224) == (17, 256)
    for rows in (1, 3, 16, 64, 256, 1024):
        for span in (128, 1000, 4224, 9216):
            splits, chunk = da.splits_for(rows, 8, span)
            assert splits * chunk >= span > (splits - 1) * chunk and chunk % da.BLOCK_N == 0


@KERNEL
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_equals_sdpa_over_each_rows_own_entries(dtype: torch.dtype) -> None:
    """Rows from 1 key to past several splits, starting past their left padding, GQA (8 query heads on 2 KV
    heads), the query a strided view as the decoder passes it: equal to SDPA over the same keys."""
    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, slots = 6, 8, 2, 64, 1100
    q = torch.randn(rows, heads + kv_heads, dim, generator=gen).to(DEVICE, dtype)[:, :heads]
    k, v = torch.randn(2, rows, slots, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    start = torch.tensor([0, 3, 10, 600, 0, 1098], dtype=torch.int32, device=DEVICE)
    end = torch.tensor([1100, 4, 300, 650, 1, 1100], dtype=torch.int32, device=DEVICE)
    assert da.splits_for(rows, kv_heads, slots)[0] > 1  # the long row spans several splits
    out = da.decode_attention(q, k, v, start, end, scale=dim ** -0.5, span=slots)
    ref = da.reference(q, k, v, start, end, scale=dim ** -0.5)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert out.dtype == dtype and out.shape == (rows, heads, dim)
    assert (out.float() - ref).abs().max() <= tol


@KERNEL
def test_the_decoder_with_the_kernel_equals_the_hf_loop(root: Path) -> None:
    """Greedy, 16 rows on 3 slots with an early EOS (refills and compaction), the full-length layers through
    the kernel: CPU (interpreter, fp32) gives the HF loop's tokens and log-probs; CUDA (bf16, graphs)
    agrees with masked SDPA and the HF loop to bf16 rounding, and the decoder picks the kernel itself
    where flash varlen does not run."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 101, (n,), generator=gen).tolist() for n in LENGTHS]
    folder = build(root, "qwen3-gqa-qknorm")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    eos = early_eos(responses(greedy(engine(folder, DEVICE, fast=False, dtype=dtype), prompts)))
    e = engine(folder, DEVICE, eos=eos, batch_size=3, dtype=dtype)
    if DEVICE == "cuda":
        assert e._fast.attention == ("varlen" if da.varlen_works(
            dtype=dtype, device=torch.device("cuda"), heads=4, kv_heads=2, head_dim=16) else "triton")
    e._fast.attention = "triton"
    out = greedy(e, prompts, max_new_tokens=12)
    assert e._fast.refills > 0 and e._fast.compactions > 0
    hf = greedy(engine(folder, DEVICE, fast=False, eos=eos, batch_size=3, dtype=dtype), prompts, max_new_tokens=12)
    if DEVICE == "cpu":
        assert_same(out, hf)
        return
    assert e._fast._graphs
    sdpa = engine(folder, DEVICE, eos=eos, batch_size=3, dtype=dtype)
    sdpa._fast.attention = "sdpa"
    for ref in (greedy(sdpa, prompts, max_new_tokens=12), hf):
        same = out.response_ids == ref.response_ids
        diff = (out.logprobs - ref.logprobs).abs()[same & ref.response_mask.bool()]
        print(f"\nbf16 Triton decode attention vs a reference: {same.float().mean():.1%} tokens equal, "
              f"log-prob mean abs diff {diff.mean():.2e}")
        assert same[:, 0].float().mean() >= 0.75 and diff.mean() < 5e-2


@pytest.mark.skipif(torch.cuda.is_available() or INTERPRETED or importlib.util.find_spec("triton") is None,
                    reason="runs where triton is importable without CUDA (CPU wheels of torch do not ship it)")
def test_the_kernels_in_tritons_interpreter() -> None:
    """This file's kernel tests again, in a process whose kernels run in Triton's interpreter on the CPU."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                          "-k", "not interpreter and not splits"], check=False, env=env, capture_output=True, text=True,
                         cwd=Path(__file__).parent, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
