"""Test setup: make `tests/` importable (for `support.*`), keep model caches in one place, and
undo the logging set-up of entry points run in-process."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# One cache for the whole session (and for subprocesses that tests start): built-in models are
# materialised once. CI may point this elsewhere.
os.environ.setdefault("SPMD_RL_CACHE", os.path.join(REPO, ".cache", "models"))


import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_spmd_rl_logger():
    """Tests that run an entry point in-process (``spmd_rl.train.main``) call ``setup_logging``,
    which gives the ``spmd_rl`` logger a handler on that test's captured stderr and stops
    propagation; restore the logger so later tests' ``caplog`` sees its records."""
    logger = logging.getLogger("spmd_rl")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]
