"""Structural rules of the package's source, read with :mod:`ast` (nothing imported, nothing run).

Run with ``python3 -m pytest tests/test_structure.py -q``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "spmd_rl"
MAX_FUNCTION_LINES = 80


def long_functions(root: Path, limit: int) -> list[str]:
    """``file:line name (N lines)`` for every function or method under ``root`` longer than ``limit``
    lines, nested ones included (a def's lines run from its ``def`` to its last statement)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_over_80_lines() -> None:
    offenders = long_functions(PACKAGE, MAX_FUNCTION_LINES)
    assert not offenders, (f"{len(offenders)} function(s) in spmd_rl/ over {MAX_FUNCTION_LINES} lines; "
                           "split each into named steps:\n" + "\n".join(offenders))
