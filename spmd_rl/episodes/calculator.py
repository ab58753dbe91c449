"""The ``calculator`` tool's arithmetic: an expression parsed with :mod:`ast` and evaluated exactly
(fractions for whole numbers), with nothing but numbers, operators and parentheses allowed, and
results bounded in size.

    calculate("2 * (3 + 4)")   # "14"
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any, Callable

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.BitXor: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_BITS = 4096
"""Largest result (in bits of numerator / denominator) the calculator computes exactly."""


def _bits(x: Fraction | float) -> int:
    return max(x.numerator.bit_length(), x.denominator.bit_length()) if isinstance(x, Fraction) else 64


def _power(base: Fraction | float, exponent: Fraction | float) -> Fraction | float:
    if isinstance(exponent, Fraction) and exponent.denominator == 1:
        if isinstance(base, Fraction) and abs(base) not in (0, 1) and _bits(base) * abs(exponent.numerator) > _MAX_BITS:
            raise ValueError("the power is too large to compute")
        if base == 0 and exponent < 0:
            raise ValueError("division by zero")
        return base ** int(exponent)
    result = float(base) ** float(exponent)
    if isinstance(result, complex):
        raise ValueError("a negative number to a fractional power has no real value")
    return result


def _evaluate(node: ast.AST) -> Fraction | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value) if isinstance(node.value, int) else node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.Pow, ast.BitXor)):
            return _power(left, right)
        if isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > _MAX_BITS:
            raise ValueError("the product is too large to compute")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    what = type(node).__name__
    raise ValueError(f"only numbers, + - * / // % ** ^ and parentheses are allowed (found {what})")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (fractions for whole-number input); the result as text."""
    if len(expression) > 1000:
        raise ValueError("the expression is longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, Fraction):
        return str(value.numerator) if value.denominator == 1 else repr(float(value))
    return repr(value)


__all__ = ["calculate"]
