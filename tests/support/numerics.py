"""Relative differences used by the parity tests (layout vs one process)."""

from __future__ import annotations

from typing import Any

import torch


def rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64 (b is the reference)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def max_rel(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    """The largest :func:`rel` over same-named tensors, with the name where it occurs."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((rel(a[n], b[n]), n) for n in b)


def perturbed_copy(folder: str, out_dir: Any, *, scale: float, seed: int = 0) -> dict[str, Any]:
    """The fp32 model of ``folder`` with N(0, scale^2) noise on every parameter, saved to ``out_dir``
    (a fresh model folder to compare against) and returned as a state dict (to hot-swap in)."""
    from spmd_rl.models import load_causal_lm

    model = load_causal_lm(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(out_dir)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}
