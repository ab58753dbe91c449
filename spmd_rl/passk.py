"""pass@k and mean@k of held-out answers, when ``trainer.val_n`` answers are sampled per prompt.

    pass_at_k(n=8, c=3, k=2)                      # 1 - C(5, 2) / C(8, 2) = 0.642...
    sample_metrics([(0, True), (0, False), (1, False), (1, False)], prefix="val/")   # (prompt, correct) per answer
    # {"val/pass@1": 0.25, "val/mean@1": 0.25, "val/pass@2": 0.5, "val/mean@2": 0.25}
    answer_metrics([(0, 1.0, True), (0, 0.2, False)], prefix="val/")   # (prompt, score, correct) per answer
    # {"val/score": 0.6, "val/accuracy": 0.5, "val/pass@1": 0.5, ...}: validation's and spmd_rl.evaluate's summary

``pass@k`` is the unbiased estimator of the chance that at least one of k answers is correct, from
n >= k samples of which c are correct: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021), computed
exactly with integers, averaged over prompts, for k = 1, 2, 4, ... below n and k = n itself (the
k verl's validation metrics use). ``mean@k`` is the expected accuracy of k answers, averaged over
prompts; its unbiased estimate from n answers is c / n whatever k is (by linearity, every k-subset's
mean averages to it), so every ``mean@k`` equals verl's ``mean@N`` (``process_validation_metrics``,
N = ``val_n``) and, with the same N for every prompt, ``val/accuracy``: the keys are there so that
``pass@k`` and ``mean@k`` plot side by side, the gap between them being what sampling k answers buys.
A prompt with fewer answers than k (none in a validation run) is left out of that k.
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from math import comb

__all__ = ["answer_metrics", "is_correct", "ks_for", "pass_at_k", "sample_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def ks_for(n: int) -> list[int]:
    """The k of pass@k for n samples: 1, 2, 4, ... below n, then n."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def sample_metrics(answers: Iterable[tuple[int, bool]], *, prefix: str = "") -> dict[str, float]:
    """``pass@k`` and ``mean@k`` for every k of :func:`ks_for` (the largest answer count), averaged
    over the prompts of ``answers``: (prompt id, correct) per answer."""
    correct: dict[int, list[bool]] = {}
    for prompt, ok in answers:
        correct.setdefault(prompt, []).append(bool(ok))
    if not correct:
        return {}
    n = max(len(v) for v in correct.values())
    out: dict[str, float] = {}
    for k in ks_for(n):
        values = [pass_at_k(len(v), sum(v), k) for v in correct.values() if len(v) >= k]
        means = [sum(v) / len(v) for v in correct.values() if len(v) >= k]
        out[f"{prefix}pass@{k}"] = sum(values) / len(values)
        out[f"{prefix}mean@{k}"] = sum(means) / len(means)
    return out


def is_correct(main_score: float) -> bool:
    """An answer is correct when the task's main scorer gives it full marks (a format bonus is not
    part of it)."""
    return main_score >= 1.0 - 1e-6


def answer_metrics(answers: Iterable[tuple[int, float, bool]], *, prefix: str = "") -> dict[str, float]:
    """Mean score and accuracy over all answers, with pass@k and mean@k: (prompt id, score, correct)
    per answer, at least one."""
    answers = list(answers)
    return {
        f"{prefix}score": sum(s for _, s, _ in answers) / len(answers),
        f"{prefix}accuracy": sum(ok for _, _, ok in answers) / len(answers),
        **sample_metrics(((i, ok) for i, _, ok in answers), prefix=prefix),
    }
