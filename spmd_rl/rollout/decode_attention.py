"""Decode attention over each row's own cache entries: a split-K Triton kernel (CUDA, bf16 / fp16), and
the probes that pick the fast decoder's attention (:func:`attention_kind`: torch's flash varlen, this
kernel, or masked SDPA).

    o = decode_attention(q, k_cache, v_cache, start, end, scale=0.088, span=4224)
    # q [rows, heads, D]; k_cache, v_cache [rows, slots, kv_heads, D] (the fast decoder's cache layout);
    # row i attends over its slots start[i] .. end[i] - 1 only; o [rows, heads, D] in q's dtype

The fast decoder's masked SDPA reads a power-of-two span of slots for EVERY row, so one long row makes
every row pay for its length; torch's flash varlen kernel reads each row's own entries but needs
``seqused_k`` and ``enable_gqa`` (absent from torch 2.11). This kernel does the same job with what
every CUDA build of torch ships (Triton), launches inside a CUDA graph and needs no extension:

* stage 1, grid ``(rows, kv_heads, splits)``: a program takes one row, one KV head and one chunk of
  the row's keys (chunk ``s`` = keys ``start + s * chunk ..``, at most ``end``), loads the query heads
  of that KV head together (GQA: no K/V copy; the group is padded to 16 rows for ``tl.dot``) and runs
  an online softmax over the chunk in blocks of ``BLOCK_N`` keys; it writes its normalised partial
  output and its log-sum-exp (base 2). A chunk past the row's end writes a log-sum-exp of ``-inf``;
* stage 2, grid ``(rows, heads)``: the partials of each row and head are merged by their
  log-sum-exps (the flash-decoding reduction) into ``o``.

``splits`` depends only on ``rows`` and ``span`` (a CUDA graph's bucket and span), so each graph
launches a fixed grid: few splits when rows x KV heads already fill the GPU, up to ``span / 256``
when few long rows are left. The partials are float32. On CPU the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, which the tests use); the decoder selects this path only where
:func:`decode_attention_works` says so (CUDA, bf16 / fp16, and a probe that agrees with SDPA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # ships with every CUDA build of torch; absent from CPU wheels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

try:  # flash attention over each row's valid cache entries only (CUDA, bf16 / fp16; torch >= 2.10)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None

BLOCK_N = 64  # keys per inner block
MIN_CHUNK = 256  # fewest keys a split takes
TARGET_PROGRAMS = 4096  # stage-1 programs that keep an H200's 132 SMs busy with room for uneven rows


def splits_for(rows: int, kv_heads: int, span: int) -> tuple[int, int]:
    """``(splits, chunk)`` of a call of ``rows`` rows over at most ``span`` keys each: as many splits as
    fill about ``TARGET_PROGRAMS`` programs, each split at least ``MIN_CHUNK`` keys, ``chunk`` a multiple
    of ``BLOCK_N`` with ``splits * chunk >= span``."""
    splits = max(1, min(math.ceil(span / MIN_CHUNK), math.ceil(TARGET_PROGRAMS / max(1, rows * kv_heads))))
    chunk = math.ceil(math.ceil(span / splits) / BLOCK_N) * BLOCK_N
    return math.ceil(span / chunk), chunk


if triton is not None:

    @triton.jit
    def _partials(Q, K, V, START, END, O_PART, LSE_PART,
                  stride_qr, stride_qh, stride_kr, stride_ks, stride_kh, stride_vr, stride_vs, stride_vh,
                  qk_scale, chunk, splits, n_heads,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        lo = tl.load(START + r) + s * chunk
        hi = tl.minimum(lo + chunk, tl.load(END + r))
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        heads = h * GROUP + g
        q = tl.load(Q + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        k_row = K + r.to(tl.int64) * stride_kr + h * stride_kh
        v_row = V + r.to(tl.int64) * stride_vr + h * stride_vh
        for n0 in range(lo, hi, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < hi
            k = tl.load(k_row + n[:, None] * stride_ks + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_row + n[:, None] * stride_vs + d[None, :], mask=ok[:, None], other=0.0)
            z = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK], base-2 logits
            z = tl.where(ok[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(z - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        found = l > 0  # an empty chunk (past the row's end) leaves l = 0
        o = acc / tl.where(found, l, 1.0)[:, None]
        lse = tl.where(found, m + tl.log2(tl.where(found, l, 1.0)), float("-inf"))
        at = (r * n_heads + heads) * splits + s  # the partials are [rows, heads, splits (, D)]
        tl.store(LSE_PART + at, lse, mask=g < GROUP)
        tl.store(O_PART + at[:, None] * D + d[None, :], o, mask=(g < GROUP)[:, None])

    @triton.jit
    def _merge(O_PART, LSE_PART, OUT, stride_or, stride_oh, splits, D: tl.constexpr):
        r = tl.program_id(0)
        hh = tl.program_id(1)
        d = tl.arange(0, D)
        base = (r * tl.num_programs(1) + hh) * splits
        m = tl.load(LSE_PART + base)  # split 0 always holds the row's first key
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s in range(splits):
            lse = tl.load(LSE_PART + base + s)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)  # 0 for an empty split (lse = -inf)
            acc = acc * alpha + w * tl.load(O_PART + (base + s) * D + d)
            total = total * alpha + w
            m = m_new
        tl.store(OUT + r * stride_or + hh * stride_oh + d, (acc / total).to(OUT.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                     end: torch.Tensor, *, scale: float, span: int) -> torch.Tensor:
    """Attention of one query per row over that row's cache slots ``start[i] .. end[i] - 1`` (module
    docstring). ``q [rows, heads, D]``, caches ``[rows, slots, kv_heads, D]`` (last dim contiguous),
    ``start`` / ``end`` int ``[rows]`` with ``start < end <= span``; returns ``[rows, heads, D]``."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    splits, chunk = splits_for(rows, kv_heads, span)
    lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    part = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    _partials[(rows, kv_heads, splits)](
        q, k_cache, v_cache, start, end, part, lse, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale * math.log2(math.e),
        chunk, splits, heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK=BLOCK_N,
        num_warps=4)
    _merge[(rows, heads)](part, lse, out, out.stride(0), out.stride(1), splits, D=dim, num_warps=1)
    return out


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
              end: torch.Tensor, *, scale: float) -> torch.Tensor:
    """:func:`decode_attention` written with SDPA, one row at a time, float32 (tests and the probe)."""
    kv_heads = k_cache.shape[2]
    out = []
    for i in range(q.shape[0]):
        keys = slice(int(start[i]), int(end[i]))
        o = F.scaled_dot_product_attention(q[i].float().unflatten(0, (kv_heads, -1)),
                                           k_cache[i, keys].float().transpose(0, 1),
                                           v_cache[i, keys].float().transpose(0, 1), scale=scale)
        out.append(o.flatten(0, 1))
    return torch.stack(out)


def decode_attention_works(*, dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int,
                           head_dim: int) -> bool:
    """Whether :func:`decode_attention` runs on this device and dtype with the decode's head layout and
    agrees with SDPA (a probe: CUDA, bf16 / fp16, Triton importable, ``head_dim`` a power of two)."""
    if triton is None or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if head_dim < 16 or head_dim & (head_dim - 1) or heads % kv_heads:
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        slots = 600  # three splits for the long row
        q = torch.randn(3, heads, head_dim, generator=gen, device=device).to(dtype)
        k, v = (torch.randn(3, slots, kv_heads, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
        start = torch.tensor([0, 5, 7], device=device, dtype=torch.int32)
        end = torch.tensor([slots, 9, 8], device=device, dtype=torch.int32)
        out = decode_attention(q, k, v, start, end, scale=head_dim ** -0.5, span=slots)
        ref = reference(q, k, v, start, end, scale=head_dim ** -0.5)
        return bool(torch.allclose(out.float(), ref, atol=2e-2, rtol=0))
    except Exception:  # noqa: BLE001 - any failure of the compiler or the launch means: not here
        return False




def varlen_works(*, dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`varlen_attn` runs on this device and dtype with the decode's arguments (one query per
    row, rows starting past their left padding, ``seqused_k``, grouped KV heads) and agrees with SDPA: a
    probe, as kernels differ by device, dtype and release."""
    if varlen_attn is None:
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        slots, pad, used = 8, torch.tensor([0, 3], device=device), torch.tensor([5, 4], device=device)
        q = torch.randn(2, heads, head_dim, generator=gen, device=device).to(dtype)
        k, v = (torch.randn(2, slots, kv_heads, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
        ar = torch.arange(2, device=device)
        # max_k: the step's span, below the rows' cache length as in the decode
        out = varlen_attn(q, k.flatten(0, 1), v.flatten(0, 1), (torch.arange(3, device=device)).int(),
                          torch.cat([ar * slots + pad, ar.new_full((1,), 2 * slots)]).int(), 1, 6,
                          enable_gqa=True, seqused_k=used.int())
        for i in range(2):
            keys = slice(int(pad[i]), int(pad[i] + used[i]))
            ref = F.scaled_dot_product_attention(
                q[i].unflatten(0, (kv_heads, -1)), k[i, keys].transpose(0, 1), v[i, keys].transpose(0, 1))
            if not torch.allclose(out[i].float(), ref.flatten(0, 1).float(), atol=2e-2, rtol=0):
                return False
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


def attention_kind(*, dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> str:
    """The full-length layers' decode attention on this device and dtype: ``varlen`` (torch's flash varlen),
    ``triton`` (:func:`~spmd_rl.rollout.decode_attention.decode_attention`), both reading each row's own
    cache entries, or ``sdpa`` (masked, over the step's span of slots): the first whose probe passes."""
    probe = {"dtype": dtype, "device": device, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    if varlen_works(**probe):
        return "varlen"
    if decode_attention_works(**probe):
        return "triton"
    return "sdpa"


__all__ = ["attention_kind", "decode_attention", "decode_attention_works", "reference", "splits_for", "varlen_attn",
           "varlen_works"]
