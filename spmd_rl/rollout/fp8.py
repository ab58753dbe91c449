"""FP8 weights for the built-in rollout (``--rollout.dtype fp8``): e4m3 with one scale per output row.

    q, scale = quantize_rows(w)             # w [out, in] -> q [out, in] float8_e4m3fn, scale [out] float32
    y = fp8_linear(x, q, scale, bias)       # ~ F.linear(x, w, bias): x quantised per token, torch._scaled_mm
    fp8_works(device, dtype)                # None, or why FP8 weights cannot run there

Weights: each output row of ``w`` is scaled so that its largest magnitude maps to e4m3's largest finite
value (448) and rounded to nearest; ``scale`` = row max / 448 (1 for an all-zero row). One scale per row
makes a row's quantisation independent of the others, so rows loaded apart (the HF names of a fused
q/k/v GEMM) quantise exactly as the whole tensor would. Activations: each token's row likewise
(dynamic, per token: an outlier token costs only its own precision). The GEMM multiplies the two e4m3
operands with float32 accumulation and applies both scales to its output: ``torch._scaled_mm`` with
row-wise scales on CUDA (FP8 tensor cores, compute capability 8.9+). Elsewhere (the CPU, whose
``_scaled_mm`` takes per-tensor scales only in some releases) both operands are quantised the same way
and multiplied dequantised: the same numbers up to the accumulation order. Each product carries two
e4m3 roundings, at most 2^-4 relative each (``tests/test_rollout_fp8.py`` checks the bounds).

A weight-only variant (e4m3 tiles widened to bf16 in registers by a Triton kernel) was measured slower
than both on an H200 (docs/PERF.md, "FP8 rollout").
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


def fp8_shape_ok(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape is held in FP8 (both widths multiples of 16, as the scaled GEMM wants)."""
    return out_features % 16 == 0 and in_features % 16 == 0


def _row_scales(t: torch.Tensor) -> torch.Tensor:
    """``amax(|row|) / 448`` per row of ``t [rows, n]`` in float32, 1 for an all-zero row: ``[rows, 1]``."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> ``(q [out, in] e4m3, scale [out] float32)``, ``weight ≈ q * scale[:, None]``."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_rows: expected a 2-d weight, got shape {tuple(weight.shape)}")
    scale = _row_scales(weight)
    return _quantize(weight, scale), scale.squeeze(-1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight that ``(q, scale)`` stands for."""
    return q.float() * scale[:, None]


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               ) -> torch.Tensor:
    """``x [..., in] @ (q * scale).T + bias`` in ``x``'s dtype, with ``x`` quantised to e4m3 per token
    (graph-capturable, no host sync; compiled, the quantisation fuses into one kernel)."""
    flat = x.reshape(-1, x.shape[-1])
    x_scale = _row_scales(flat)
    xq = _quantize(flat, x_scale)
    if x.device.type == "cuda":
        out = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)
    else:
        out = (dequantize_rows(xq, x_scale.squeeze(-1)) @ dequantize_rows(q, scale).T).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], q.shape[0])


def fp8_works(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when FP8 weights run on ``device`` with ``dtype`` activations, else why not (CUDA: a probe of the
    row-wise scaled GEMM, which needs FP8 tensor cores, compute capability 8.9+, and bf16 outputs)."""
    if device.type != "cuda":
        return None
    try:
        x = torch.randn(16, 32, device=device, dtype=dtype)
        q, scale = quantize_rows(torch.randn(16, 32, device=device))
        fp8_linear(x, q, scale)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch._scaled_mm does not run row-wise FP8 on this GPU with {dtype} activations ({first})"
    return None


__all__ = ["E4M3", "E4M3_MAX", "dequantize_rows", "fp8_linear", "fp8_shape_ok", "fp8_works", "quantize_rows"]
