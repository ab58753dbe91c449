"""The GPU layout of packed attention and the chunked head, checked on CPU.

On GPU the engine runs packed rows through torch's flash varlen kernel (``cu_seqlens`` over the
flattened rows) instead of SDPA with a block-diagonal mask. That kernel is CUDA-only, so here it is
replaced by a per-run causal SDPA reference, which checks everything around it: the run offsets,
the ``[R, H, W, D] <-> [R * W, H, D]`` layout, GQA and the output shape. The engine test also
chunks the log-prob head into 3-position chunks, so both GPU-path changes together must give the
log-probs, gradient norm and updated weights of the CPU path (one chunk, dense mask).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from spmd_rl.engine import ulysses


def reference_varlen(q, k, v, cu, max_len, scale, window=None):
    """Causal attention inside each run ``[cu[i], cu[i+1])``: ``[T, H, D]`` x ``[T, Hkv, D]``; ``window``:
    keys fewer than ``window`` positions back."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i = torch.arange(e - s)
        mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :]) < (window or e - s + 1))
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1)
    assert max_len == int((cu[1:] - cu[:-1]).max())
    return out


def test_varlen_runs_split_rows_at_segment_changes() -> None:
    seg = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0], [-1, -1, 0, 0, 0, -1]])
    cu, longest = ulysses.varlen_runs(seg)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 5, 6, 12, 14, 17, 18]
    assert longest == 6


def test_flash_layout_equals_the_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ulysses, "_flash_varlen", reference_varlen)
    g = torch.Generator().manual_seed(0)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]])
    r, w, h, hkv, d = 2, 8, 4, 2, 8
    q, k, v = (torch.randn(r, n, w, d, generator=g) for n in (h, hkv, hkv))
    dense, _ = ulysses.varlen_sdpa(None, q, k, v, None, scaling=0.3,
                                   spmd_attn=ulysses.AttnSpec(mask=ulysses.block_causal_mask(seg)))
    cu, longest = ulysses.varlen_runs(seg)
    flash, _ = ulysses.varlen_sdpa(None, q, k, v, None, scaling=0.3,
                                   spmd_attn=ulysses.AttnSpec(cu_seqlens=cu, max_seqlen=longest))
    assert flash.shape == dense.shape == (r, w, h, d)
    valid = (seg >= 0)[..., None, None].expand_as(dense)  # padding outputs are never read
    torch.testing.assert_close(flash[valid], dense[valid], rtol=1e-5, atol=1e-6)


def _engine_body(rank: int, world: int, folder: str) -> dict[str, object]:
    from spmd_rl.algo.objective import actor_objective
    from spmd_rl.config import ActorConfig, AlgoConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    ulysses._flash_varlen = reference_varlen  # this spawned worker's stand-in for the CUDA kernel
    g = torch.Generator().manual_seed(7)
    rows, t = 6, 9
    prompts = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (rows,), generator=g)]
    lengths = torch.randint(1, t + 1, (rows,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    batch = RolloutBatch(prompts=prompts, tensors={
        "response_ids": torch.where(mask.bool(), torch.randint(3, 100, (rows, t), generator=g), 0),
        "response_mask": mask, "advantages": torch.randn(rows, 1, generator=g).expand(rows, t) * mask})
    algo = AlgoConfig(use_kl_loss=False, entropy_coef=0.01)
    out: dict[str, object] = {}
    for name, flash, chunk in (("mask", False, None), ("flash", True, 3)):
        engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                            fsdp=FsdpConfig(), actor=ActorConfig(lr=1e-3), use_packing=True,
                            logits_chunk_tokens=chunk)
        engine.flash_varlen = flash
        logprobs, entropy = engine.compute_logprobs(batch, temperature=0.8, micro_batch_size=3, with_entropy=True)

        def loss_fn(lp, ent, micro):
            return actor_objective(lp, ent, old_logprobs=lp.detach(), advantages=micro["advantages"],
                                   response_mask=micro["response_mask"], ref_logprobs=None, algo=algo,
                                   global_tokens=mask.sum().item(), global_seqs=float(rows))

        stats = engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=3), loss_fn, temperature=0.8,
                                        need_entropy_grad=True)
        out[name] = dict(logprobs=logprobs, entropy=entropy, grad_norm=stats["grad_norm"],
                         weights={n: w.clone() for n, w in engine.named_full_tensors()})
    return out


def test_engine_flash_layout_and_chunked_head_match_the_cpu_path() -> None:
    from spmd_rl.distributed.testing import run_distributed
    from spmd_rl.models import resolve_model_path

    folder = resolve_model_path("tiny-random", cache_dir=None)
    (res,) = run_distributed(_engine_body, 1, folder)
    a, b = res["mask"], res["flash"]
    # float32 rounding: the fused RoPE's multiply-adds round by the layout's vector lanes (engine/attention.py)
    torch.testing.assert_close(b["logprobs"], a["logprobs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b["entropy"], a["entropy"], rtol=1e-5, atol=1e-5)
    assert abs(b["grad_norm"] - a["grad_norm"]) <= 1e-5 * a["grad_norm"]
    for name, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], w, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or not ulysses.flash_varlen_available(),
                    reason="torch's flash varlen kernel runs on CUDA only")
def test_flash_kernel_equals_the_dense_mask_on_cuda() -> None:
    """The real kernel (bf16, GQA, packed runs and padding) against SDPA with the dense mask, in
    the forward and in the gradients of q, k and v."""
    g = torch.Generator(device="cuda").manual_seed(0)
    seg = torch.tensor([[0] * 40 + [1] * 70 + [2] * 10 + [-1] * 8, [0] * 128, [0] * 5 + [1] * 100 + [-1] * 23],
                       device="cuda")
    r, w, h, hkv, d = 3, 128, 8, 2, 64
    qkv = [torch.randn(r, n, w, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
           for n in (h, hkv, hkv)]
    up = torch.randn(r, w, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    cu, longest = ulysses.varlen_runs(seg)
    valid = (seg >= 0)[..., None, None].expand(r, w, h, d)
    results = []
    for spec in (ulysses.AttnSpec(mask=ulysses.block_causal_mask(seg)), ulysses.AttnSpec(cu_seqlens=cu, max_seqlen=longest)):
        out, _ = ulysses.varlen_sdpa(None, *qkv, None, scaling=d ** -0.5, spmd_attn=spec)
        grads = torch.autograd.grad((out * up * valid).sum(), qkv)
        results.append((out[valid].float(), *(x.float() for x in grads)))
    for dense, flash in zip(*results):
        assert ((flash - dense).norm() / dense.norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or not ulysses.flash_varlen_available(),
                    reason="torch's flash varlen kernel runs on CUDA only")
def test_grouped_flash_varlen_equals_repeated_kv_on_cuda() -> None:
    """Grouped-query flash without repeating k/v (aten's flash ops, as torch releases without
    ``enable_gqa`` need) equals the kernel on repeated k/v: outputs, dq, and dk/dv summed per group."""
    from torch.nn.attention.varlen import varlen_attn

    g = torch.Generator(device="cuda").manual_seed(1)
    cu = torch.tensor([0, 37, 150, 151, 300], device="cuda", dtype=torch.int32)
    t, h, hkv, d = 300, 12, 2, 128
    q = torch.randn(t, h, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(t, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    up = torch.randn(t, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
    grouped = ulysses._GroupedFlashVarlen.apply(q, k, v, cu, 149, d ** -0.5)
    got = (grouped, *torch.autograd.grad((grouped * up).sum(), (q, k, v)))
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    rep = h // hkv
    repeated = varlen_attn(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu, cu, 149, 149, scale=d ** -0.5, **causal)
    want = (repeated, *torch.autograd.grad((repeated * up).sum(), (q, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 5e-3, f"{name}: relative error {err:.2e}"
