"""Pure-tensor RL algorithm pieces: advantage estimators and policy losses.

Usage::

    from spmd_rl.algo import advantages, losses
    adv = advantages.grpo(scores, group_index, response_mask)
    loss, metrics = losses.ppo_clip(logp, old_logp, adv, response_mask)

Nothing here knows about processes, devices or engines.
"""

from __future__ import annotations

import importlib
from typing import Any

CRITIC_ESTIMATOR_NAMES = ("gae",)
"""The ``algo.adv_estimator`` values that need a critic's values (``objective.CRITIC_ESTIMATORS`` maps
them to functions). Kept here, free of torch, for :func:`spmd_rl.plan.plan`."""


def __getattr__(name: str) -> Any:
    # The submodules import torch: loaded on first use, so plan() and the layout tool need no torch.
    if name in ("advantages", "losses"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CRITIC_ESTIMATOR_NAMES", "advantages", "losses"]
