"""Answer-format reward: 1.0 when the completion states its answer in an explicit, recognised form.

Recognised forms: the whole completion is just a number (``42``, ``-3.5``, ``1,234``, ``3/4``,
optionally with ``$`` and a trailing ``.``), or it contains a closed ``\\boxed{...}`` or a non-empty
``<answer>...</answer>``. Added to the main score with weight ``reward.format_weight``, or used
alone as ``reward.fn=format``.
"""

from __future__ import annotations

import re

from spmd_rl.reward.math import last_braced

_JUST_NUMBER_RE = re.compile(r"\$?\s*[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?\s*\.?")
_ANSWER_TAG_RE = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL | re.IGNORECASE)


def format_score(completion: str) -> float:
    """1.0 for an explicit answer form (see the module docstring), else 0.0."""
    text = completion.strip()
    if _JUST_NUMBER_RE.fullmatch(text):
        return 1.0
    if last_braced(text, "\\boxed") or _ANSWER_TAG_RE.search(text):
        return 1.0
    return 0.0


def format_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Batch scorer ``reward.fn=format`` (the scorer signature; needs no column)."""
    return [format_score(c) for c in completions]


__all__ = ["format_reward", "format_score"]
