"""The docs as reference: what they name exists, they describe rather than narrate, the README is short.

* every path and module ``docs/ARCHITECTURE.md`` names in backticks (``spmd_rl/x.py``, ``spmd_rl/x/``,
  ``tests/support/y.py``, ``spmd_rl.x.y``) exists in this checkout;
* README.md and docs/*.md state what is, not what changed: no "used to", "no longer", "previously",
  ... and no date in prose. A date belongs on a result's one ``Measured:`` line (date, hardware,
  versions) in docs/PERF.md and docs/RESULTS.md; the chronology is docs/results/HISTORY.md, which
  is not checked;
* README.md is at most 150 lines.
"""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

from conftest import REPO

ARCHITECTURE = os.path.join(REPO, "docs", "ARCHITECTURE.md")
HISTORY = os.path.join("docs", "results", "HISTORY.md")
TOP = ("spmd_rl", "tests", "bench", "configs", "launch", "slurm", "docs")
PATH = re.compile(rf"`((?:{'|'.join(TOP)})/[\w./-]*)`")
DOTTED = re.compile(r"`(spmd_rl(?:\.\w+)+)`")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def architecture_paths() -> list[str]:
    return sorted(set(PATH.findall(_read(ARCHITECTURE))))


def architecture_modules() -> list[str]:
    return sorted(set(DOTTED.findall(_read(ARCHITECTURE))))


def _module_file(parts: list[str]) -> str | None:
    base = os.path.join(REPO, *parts)
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _defines(path: str, attr: str) -> bool:
    """Whether a module defines, imports or lazily exports (a quoted name in its export table) ``attr``."""
    source = _read(path)
    name = re.escape(attr)
    if re.search(rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]", source, re.MULTILINE):
        return True
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[-1] == attr
                                                                   for a in node.names):
            return True
    return re.search(rf"[\"']{name}[\"']", source) is not None


def test_architecture_names_something() -> None:
    # a broken extraction would check nothing
    assert len(architecture_paths()) > 50 and "spmd_rl/trainer.py" in architecture_paths()


@pytest.mark.parametrize("path", architecture_paths())
def test_architecture_path_exists(path: str) -> None:
    assert os.path.exists(os.path.join(REPO, path)), f"docs/ARCHITECTURE.md names `{path}`, which is not in the checkout"


@pytest.mark.parametrize("name", architecture_modules())
def test_architecture_module_exists(name: str) -> None:
    """``spmd_rl.a.b`` is a module; ``spmd_rl.a.b.attr`` is a module that defines ``attr``."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        found = _module_file(parts[:cut])
        if found is None:
            continue
        rest = parts[cut:]
        if rest:
            assert _defines(found, rest[0]), f"`{name}`: {os.path.relpath(found, REPO)} defines no {rest[0]}"
        return
    pytest.fail(f"docs/ARCHITECTURE.md names `{name}`, which is no module of this checkout")


# --------------------------------------------------------------------------- reference, not narrative

NARRATION = re.compile(
    r"\bused to\b|\bno longer\b|\bpreviously\b|\bformerly\b|\bearlier (?:run|runs|version|versions|engine|code|today|"
    r"the same day)\b|\bbefore (?:this|the fix|the change)\b|\b(?:since|until|as of) 20\d\d\b"
    r"|\bsince the (?:change|fix|switch)\b"
    r"|\bis now\b|\bare now\b|\bnow (?:uses|keeps|runs|reads|writes|builds)\b",
    re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MEASURED_LINE = re.compile(r"^\*{0,2}Measured:?\*{0,2}[: ]")  # "Measured: 2026-12-02, 1× H200, torch 2.11, CUDA 13"


def reference_docs() -> list[str]:
    docs = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    return [os.path.relpath(p, REPO) for p in docs if os.path.relpath(p, REPO) != HISTORY]


def _prose_lines(path: str):
    """(number, line) of a markdown file outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(_read(os.path.join(REPO, path)).splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def test_history_file_exists() -> None:
    assert os.path.isfile(os.path.join(REPO, HISTORY))


@pytest.mark.parametrize("path", reference_docs())
def test_doc_does_not_narrate_change(path: str) -> None:
    found = [f"{path}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}"
             for n, line in _prose_lines(path) if (m := NARRATION.search(line))]
    assert not found, "narrates change (the chronology belongs in docs/results/HISTORY.md):\n" + "\n".join(found)


@pytest.mark.parametrize("path", reference_docs())
def test_doc_dates_only_on_measured_lines(path: str) -> None:
    found = [f"{path}:{n}: {line.strip()[:120]!r}" for n, line in _prose_lines(path)
             if DATE.search(line) and not MEASURED_LINE.match(line.strip())]
    assert not found, ("a date outside a result's `Measured:` line (date, hardware, versions); "
                       "history goes to docs/results/HISTORY.md:\n" + "\n".join(found))


def test_readme_is_short() -> None:
    lines = _read(os.path.join(REPO, "README.md")).splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150: details go to docs/)"
