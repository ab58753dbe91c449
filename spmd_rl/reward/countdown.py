"""Countdown scorer: is the completion's equation a valid way to reach the target?

The equation is the content of the last ``<answer>...</answer>`` (left of an ``=`` if any), else
the longest run of equation characters on the last line that has digits and an operator. It must
use only digits, ``+ - * /``, parentheses and spaces, and use every given number exactly once (a
multiset check, as verl's countdown reward does; the built-in generator guarantees such a solution
exists). It is evaluated with exact fractions by walking its ``ast`` -- only integer literals, the
four operators and unary minus are allowed; nothing is ever passed to ``eval``::

    countdown_score("<answer>(3 + 7) * 12</answer>", target=120, numbers=[3, 7, 12])  # 1.0
"""

from __future__ import annotations

import ast
import itertools
import re
from fractions import Fraction
from typing import Any, Iterable

_ALLOWED_RE = re.compile(r"^[\d+\-*/() ]+$")
_RUN_RE = re.compile(r"[\d+\-*/() ]+")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
MAX_EQUATION_CHARS = 200
"""Longer equations score 0 (keeps parsing cheap and bounded)."""


def _clean(text: str) -> str:
    return text.replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-").replace("\\times", "*")


def extract_equation(completion: str) -> str | None:
    """The equation a completion proposes, or None."""
    text = _clean(completion)
    tags = _ANSWER_TAG_RE.findall(text)
    if tags:
        eq = tags[-1].split("=", 1)[0].strip()
        return eq or None
    for line in reversed(text.strip().splitlines()):
        if re.search(r"\d", line) and re.search(r"[+\-*/]", line):
            runs = [r.strip() for r in _RUN_RE.findall(line.split("=", 1)[0])]
            runs = [r for r in runs if re.search(r"\d", r) and re.search(r"[+\-*/]", r)]
            return max(runs, key=len) if runs else None
    return None


def _value(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed expression node; collects the integer literals in ``used``."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand, used)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, used), _value(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ZeroDivisionError("division by zero in the equation")
            return left / right
    raise ValueError(f"not allowed in an equation: {type(node).__name__}")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]] | None:
    """``(value, numbers used)`` of a safe arithmetic equation, or None when it is not one."""
    eq = equation.strip()
    if not eq or len(eq) > MAX_EQUATION_CHARS or not _ALLOWED_RE.match(eq):
        return None
    try:
        tree = ast.parse(eq, mode="eval")
        used: list[int] = []
        return _value(tree.body, used), used
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def countdown_score(completion: str, *, target: int | float, numbers: Iterable[int]) -> float:
    """1.0 when the completion's equation uses every number exactly once and equals ``target``."""
    equation = extract_equation(completion)
    if equation is None:
        return 0.0
    result = evaluate_equation(equation)
    if result is None:
        return 0.0
    value, used = result
    if sorted(used) != sorted(int(n) for n in numbers):
        return 0.0
    return 1.0 if abs(float(value) - float(target)) < 1e-6 else 0.0


def countdown_reward(
    prompts: list[str], completions: list[str], *, target: list[Any], numbers: list[Any], **_: object
) -> list[float]:
    """Batch scorer ``reward.fn=countdown`` (the scorer signature, ``target`` and ``numbers`` columns)."""
    return [countdown_score(c, target=t, numbers=n) for c, t, n in zip(completions, target, numbers)]


def solve_countdown(numbers: list[int], target: int | float) -> str | None:
    """An equation using every number exactly once with ``+ - * /`` that equals ``target``, or None.

    Exhaustive search over orders, bracketings and operators; meant for small sets (tests, checks).
    """
    goal = Fraction(target)

    def combos(vals: tuple[Fraction, ...], texts: tuple[str, ...]) -> Iterable[tuple[Fraction, str]]:
        if len(vals) == 1:
            yield vals[0], texts[0]
            return
        for i, j in itertools.permutations(range(len(vals)), 2):
            rest_v = tuple(v for k, v in enumerate(vals) if k not in (i, j))
            rest_t = tuple(t for k, t in enumerate(texts) if k not in (i, j))
            a, b, ta, tb = vals[i], vals[j], texts[i], texts[j]
            options = [(a + b, f"({ta} + {tb})"), (a - b, f"({ta} - {tb})"), (a * b, f"({ta} * {tb})")]
            if b != 0:
                options.append((a / b, f"({ta} / {tb})"))
            for v, t in options:
                yield from combos(rest_v + (v,), rest_t + (t,))

    for value, text in combos(tuple(Fraction(n) for n in numbers), tuple(str(n) for n in numbers)):
        if value == goal:
            return text
    return None


__all__ = ["countdown_reward", "countdown_score", "evaluate_equation", "extract_equation", "solve_countdown"]
