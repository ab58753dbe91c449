"""Test setup: make `tests/` importable (for `support.*`) and keep model caches in one place."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# One cache for the whole session (and for subprocesses that tests start): built-in models are
# materialised once. CI may point this elsewhere.
os.environ.setdefault("SPMD_RL_CACHE", os.path.join(REPO, ".cache", "models"))
