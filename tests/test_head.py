"""Chunked log-prob head (spmd_rl/engine/head.py): equal to the plain full-logits path, gradients included."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.engine.head import HeadRequest, LogprobHead, chunked_logprobs, default_chunk_tokens
from spmd_rl.models import load_causal_lm, resolve_model_path
from support.devices import cuda
from support.reference import entropy_from_logits, logprobs_from_logits


def _plain(hidden, weight, labels, temperature):
    logits = torch.nn.functional.linear(hidden, weight)
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


@pytest.mark.parametrize("keep", [0, 10 ** 6], ids=["recompute", "keep"])
@pytest.mark.parametrize("chunk", [1, 4, 10, 64])  # many chunks, uneven last chunk, exactly one, one larger
@pytest.mark.parametrize("entropy", ["grad", "detached", "none"])
def test_chunked_equals_plain_with_gradients(chunk: int, entropy: str, keep: int, monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v, t = 10, 16, 50, 0.7
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    up_lp, up_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    lp_ref, ent_ref = _plain(hidden, weight, labels, t)
    loss_ref = (lp_ref * up_lp).sum() + ((ent_ref * up_ent).sum() if entropy == "grad" else 0.0)
    gh_ref, gw_ref = torch.autograd.grad(loss_ref, (hidden, weight))

    gemms = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: gemms.append(1) or linear(*a))
    lp, ent = chunked_logprobs(hidden, weight, labels, temperature=t, entropy=entropy, chunk_tokens=chunk,
                               keep_bytes=keep)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-12, atol=1e-12)
    if entropy == "none":
        assert ent is None
    else:
        torch.testing.assert_close(ent, ent_ref, rtol=1e-12, atol=1e-12)
        assert ent.requires_grad == (entropy == "grad")
    loss = (lp * up_lp).sum() + ((ent * up_ent).sum() if entropy == "grad" else 0.0)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    chunks = -(-n // chunk)  # the logits' GEMM: once per chunk, again in the backward unless kept
    assert len(gemms) == (chunks if keep or chunks == 1 else 2 * chunks)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-9, atol=1e-12)


def test_kept_logits_only_when_a_backward_runs_and_within_budget(monkeypatch) -> None:
    """No graph (reference / old log-prob passes): nothing is kept whatever the budget; a budget smaller
    than the logits (10 x 50 x 8 bytes here) recomputes."""
    from spmd_rl.engine import head

    seen = []
    forward = head.ChunkedLogprobs.forward

    def spy(ctx, *args):
        out = forward(ctx, *args)
        seen.append(None if ctx.kept is None else len(ctx.kept))
        return out

    monkeypatch.setattr(head.ChunkedLogprobs, "forward", staticmethod(spy))
    hidden, weight = torch.randn(10, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (10,))
    with torch.no_grad():
        chunked_logprobs(hidden, weight, labels, chunk_tokens=3, keep_bytes=10 ** 6)
    chunked_logprobs(hidden.requires_grad_(), weight, labels, chunk_tokens=3, keep_bytes=10 * 50 * 8 - 1)
    chunked_logprobs(hidden, weight, labels, chunk_tokens=3, keep_bytes=10 * 50 * 8)
    assert seen == [None, None, 4]


def test_bf16_is_as_accurate_as_the_plain_bf16_path() -> None:
    """bf16 weights (FSDP mixed precision): logits in bf16, softmax in fp32, as the plain path does;
    both land within bf16 rounding of the float64 truth, the chunked one no further than the plain one."""
    g = torch.Generator().manual_seed(1)
    hidden64 = torch.randn(12, 32, generator=g, dtype=torch.float64)
    weight64 = torch.randn(80, 32, generator=g, dtype=torch.float64) * 0.2
    labels = torch.randint(0, 80, (12,), generator=g)

    def grads(fn, dtype):
        h, w = hidden64.to(dtype).requires_grad_(), weight64.to(dtype).requires_grad_()
        lp = fn(h, w)
        return (lp.double(), *(x.double() for x in torch.autograd.grad(lp.sum(), (h, w))))

    truth = grads(lambda h, w: _plain(h, w, labels, 1.0)[0], torch.float64)
    plain = grads(lambda h, w: _plain(h, w, labels, 1.0)[0], torch.bfloat16)
    chunked = grads(lambda h, w: chunked_logprobs(h, w, labels, chunk_tokens=5)[0], torch.bfloat16)
    for t, p, c in zip(truth, plain, chunked):
        err_plain, err_chunked = ((p - t).norm() / t.norm()).item(), ((c - t).norm() / t.norm()).item()
        assert err_chunked < 1e-2 and err_chunked <= 1.5 * err_plain + 1e-4, (err_chunked, err_plain)


def test_head_replaces_the_linear_and_keeps_ties() -> None:
    model = load_causal_lm(resolve_model_path("tiny-random", cache_dir=None), dtype=torch.float32)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    names = [n for n, _ in model.named_parameters()]
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    plain = model(input_ids=ids).logits
    head = LogprobHead.replace(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    torch.testing.assert_close(model(input_ids=ids).logits, plain)  # no request: a plain Linear
    rows, cols = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 8])
    labels = ids[rows, (cols + 1) % 9]
    head.request = HeadRequest(positions=(rows, cols), labels=labels, temperature=1.0, entropy="detached",
                               chunk_tokens=2)
    out = model(input_ids=ids).logits
    assert out.shape == (1, 3, 2)
    torch.testing.assert_close(out[0, :, 0], torch.log_softmax(plain[rows, cols], -1)[torch.arange(3), labels])
    assert default_chunk_tokens(151936) == 1766 and default_chunk_tokens(10) == 2 ** 28 // 10


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("entropy", ["grad", "detached"])
def test_fused_kernels_equal_the_eager_path(dtype: torch.dtype, entropy: str, device: str) -> None:
    """``fused=True`` (the engine's choice on CUDA) runs the chunk work through torch.compile (on CPU
    inductor's C++ backend compiles the same functions): log-probs, entropy and both gradients equal the eager
    path's (float64: to 1e-12; bf16: the logits' rounding is the same, the fp32 sums may be reordered)."""
    g = torch.Generator().manual_seed(2)
    n, h, v, t = 10, 16, 50, 0.7
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    up = torch.randn(n, generator=g, dtype=torch.float64).to(device)
    out = {}
    for fused in (False, True):
        lp, ent = chunked_logprobs(hidden, weight, labels, temperature=t, entropy=entropy, chunk_tokens=4, fused=fused)
        loss = (lp * up.to(lp.dtype)).sum() + ((ent * up.to(lp.dtype)).sum() if entropy == "grad" else 0.0)
        out[fused] = (lp, ent, *torch.autograd.grad(loss, (hidden, weight)))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    for eager, fused in zip(out[False], out[True]):
        torch.testing.assert_close(fused, eager, **tol)


def test_fused_head_falls_back_to_eager_when_compilation_fails(monkeypatch, caplog, request) -> None:
    """A toolchain that cannot compile (no C++ compiler, a triton bug) costs speed, not the run: the
    failure is logged once and the eager chunk code gives the same numbers."""
    from spmd_rl.engine import head

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("inductor: no working compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    head._HEAD.reset()
    request.addfinalizer(head._HEAD.reset)  # later tests compile for real
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 20, (6,), generator=g)
    out = {}
    with caplog.at_level("WARNING", logger="spmd_rl"):
        for fused in (True, False):
            lp, ent = chunked_logprobs(hidden, weight, labels, entropy="grad", chunk_tokens=4, fused=fused)
            out[fused] = (lp, ent, *torch.autograd.grad((lp + ent).sum(), (hidden, weight)))
    assert caplog.text.count("the fused log-prob head failed") == 1 and "no working compiler" in caplog.text
    for fused, eager in zip(out[True], out[False]):
        torch.testing.assert_close(fused, eager, rtol=0, atol=0)
