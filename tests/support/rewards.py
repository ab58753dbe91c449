"""User reward functions for the end-to-end tests (passed as `--reward.fn support.rewards:NAME`).

A tiny random model cannot learn arithmetic in a few CPU steps, but it can learn a simple
preference over its own output distribution quickly; that is a real policy-gradient signal.
"""

from __future__ import annotations


def digit_fraction(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Fraction of the completion's characters that are digits (0 for an empty completion)."""
    return [sum(c.isdigit() for c in text) / len(text) if text else 0.0 for text in completions]


def raises_on_seven(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Fails for any prompt that mentions 7: exercises the reward error path."""
    for p in prompts:
        if "7" in p:
            raise ArithmeticError("scorer exploded on a prompt with a 7")
    return [0.0 for _ in completions]


HANG_CALLS = [0]
"""How many times :func:`hangs_on_seven` was called in this process."""


def hangs_on_seven(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """Never returns for a prompt that mentions 7 (a hung scorer): exercises `reward.timeout_s`."""
    import threading

    HANG_CALLS[0] += 1
    if any("7" in p for p in prompts):
        threading.Event().wait()  # forever
    return [1.0 for _ in completions]


def zero(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """No reward at all: every advantage is 0, so only the other loss terms (KL, distillation) train."""
    return [0.0] * len(completions)


def digit_fraction_on_odd_prompts(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """`digit_fraction` for prompts whose character codes sum to an odd number, a constant 0.5 for the
    others: about half of the groups have equal scores, which DAPO's dynamic sampling must drop."""
    scores = digit_fraction(prompts, completions)
    return [s if sum(map(ord, p)) % 2 else 0.5 for p, s in zip(prompts, scores)]


def any_digit(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    """1 when the completion holds a digit, else 0: a tiny random model is right about half the time."""
    return [float(any(c.isdigit() for c in text)) for text in completions]
