"""The config's checks: a section's ``__post_init__`` calls :func:`_check`, which raises a plain
``ValueError`` naming the flag, unless tyro is still building the objects (then :func:`validate`
runs every check once they exist)."""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

_DEFER_CHECKS = contextvars.ContextVar("spmd_rl_defer_config_checks", default=False)


def _check(ok: bool, msg: str) -> None:
    if not ok and not _DEFER_CHECKS.get():
        raise ValueError(msg)


def validate(cfg: Any) -> None:
    """Run every section's checks, innermost first (``__post_init__`` only checks, so re-running
    it is safe). ``load_config`` defers checks while tyro builds the objects, then calls this, so
    a bad value always surfaces as a plain ``ValueError`` naming the flag."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate(value)
    post_init = getattr(cfg, "__post_init__", None)
    if post_init is not None:
        post_init()
