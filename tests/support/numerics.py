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
