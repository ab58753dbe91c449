"""Pure-tensor RL algorithm pieces: advantage estimators and policy losses.

Usage::

    from spmd_rl.algo import advantages, losses
    adv = advantages.grpo(scores, group_index, response_mask)
    loss, metrics = losses.ppo_clip(logp, old_logp, adv, response_mask)
    weights, mask, metrics = rollout_correction(old_logp, rollout_logp, mask, is_level="token")

Nothing here knows about devices or engines; only :func:`rollout_correction` takes an optional process
group (its statistics global over data-parallel ranks). This module itself imports no torch: the
parsers of the rollout-correction flags below serve the config's checks and ``plan()``.
"""

from __future__ import annotations

import importlib
from typing import Any

CRITIC_ESTIMATOR_NAMES = ("gae",)
"""The ``algo.adv_estimator`` values that need a critic's values (``objective.CRITIC_ESTIMATORS`` maps
them to functions). Kept here, free of torch, for :func:`spmd_rl.plan.plan`."""


ROLLOUT_IS_LEVELS = ("token", "sequence")
"""Importance-weight levels of :func:`rollout_correction` (``is_level``; ``algo.rollout_is``)."""

ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""Rejection criteria of :func:`rollout_correction` (``rs``; ``algo.rollout_rs``, comma-separated):
a divergence estimator (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, r = pi_old / pi_rollout)
per token, or its sum, mean or max over a sequence."""


def parse_is_threshold(value: float | str) -> tuple[float | None, float]:
    """``(lower, upper)`` of ``algo.rollout_is_threshold``: a number is the truncation cap of the
    importance weights (``lower`` None); ``"L_U"`` (e.g. ``"0.5_5.0"``) is IcePop's band: weights
    outside [L, U] are set to 0, the others kept as they are."""
    text = str(value).strip()
    try:
        if "_" in text:
            low, high = (float(x) for x in text.split("_", 1))
        else:
            low, high = None, float(text)
    except ValueError:
        raise ValueError(f"algo.rollout_is_threshold must be a number (truncation cap) or 'lower_upper' "
                         f"(IcePop band, e.g. 0.5_5.0), got {value!r}") from None
    if not high > 0 or (low is not None and not 0 < low <= high):
        raise ValueError(f"algo.rollout_is_threshold must be > 0, and a band 'lower_upper' needs "
                         f"0 < lower <= upper, got {value!r}")
    return low, high


def parse_rollout_rs(rs: str, threshold: float | str | None) -> list[tuple[str, float | None, float]]:
    """``[(option, lower, upper), ...]`` of ``algo.rollout_rs`` and ``algo.rollout_rs_threshold``:
    the options comma-separated (repeats dropped), one threshold each or one shared by all (as verl).
    A k1 option takes ratio bounds ``"L_U"`` (a single number U means 1/U_U); the others an upper
    bound of the divergence (``lower`` None)."""
    options = list(dict.fromkeys(o.strip() for o in str(rs).split(",") if o.strip()))
    if not options:
        raise ValueError("algo.rollout_rs must name at least one rejection option")
    for o in options:
        if o not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"algo.rollout_rs: unknown rejection option {o!r}; valid: {list(ROLLOUT_RS_OPTIONS)}")
    if threshold is None:
        raise ValueError(f"algo.rollout_rs={rs} needs algo.rollout_rs_threshold (one entry per option)")
    specs = [t.strip() for t in str(threshold).split(",") if t.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"algo.rollout_rs_threshold has {len(specs)} entries for the {len(options)} options of "
                         f"algo.rollout_rs ({', '.join(options)}): give one per option, or one shared by all")
    return [_rs_rule(o, spec) for o, spec in zip(options, specs)]


def _rs_rule(option: str, spec: str) -> tuple[str, float | None, float]:
    try:
        if option.endswith("k1"):
            if "_" in spec:
                low, high = (float(x) for x in spec.split("_", 1))
            else:
                high = float(spec)
                low = 1.0 / high if high > 0 else 0.0
        elif "_" in spec:
            raise ValueError(f"algo.rollout_rs_threshold: option {option} takes one upper bound, not "
                             f"'lower_upper' ({spec!r})")
        else:
            low, high = None, float(spec)
    except (ValueError, ZeroDivisionError) as e:
        if "rollout_rs_threshold" in str(e):
            raise
        raise ValueError(f"algo.rollout_rs_threshold: invalid threshold {spec!r} for option {option}") from None
    if not high > 0 or (low is not None and not low > 0):
        raise ValueError(f"algo.rollout_rs_threshold: thresholds of option {option} must be > 0, got {spec!r}")
    return option, low, high


def __getattr__(name: str) -> Any:
    # The submodules import torch: loaded on first use, so plan() and the layout tool need no torch.
    if name in ("advantages", "losses", "correction"):
        return importlib.import_module(f"{__name__}.{name}")
    if name == "rollout_correction":
        return importlib.import_module(f"{__name__}.correction").rollout_correction
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CRITIC_ESTIMATOR_NAMES", "ROLLOUT_IS_LEVELS", "ROLLOUT_RS_OPTIONS", "advantages", "correction", "losses",
           "parse_is_threshold", "parse_rollout_rs", "rollout_correction"]
