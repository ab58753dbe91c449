"""Tiny random models of any shape or seed, for tests: ``tiny-random`` (``--model.path``) is the
default shape only; a test that needs another builds the folder here and passes its path.

    folder = tiny_model_folder(None, layers=4, hidden=256)           # under $SPMD_RL_CACHE (conftest)
    rm = tiny_model_folder(str(tmp_path), seed=5, reward_model=True)  # a tiny-random-rm of seed 5
"""

from __future__ import annotations

from spmd_rl.models.builtin import TinyShape, cache_root, materialise_tiny_random, materialise_tiny_random_rm


def tiny_model_folder(cache_dir: str | None, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                      kv_heads: int = 2, seed: int = 0, reward_model: bool = False) -> str:
    """The folder of the tiny random causal LM (or, with ``reward_model``, the one-output classifier)
    of this shape and seed, built once under ``cache_dir`` (None: ``$SPMD_RL_CACHE``); concurrent
    callers are safe. The defaults give the folder ``tiny-random`` / ``tiny-random-rm`` resolve to."""
    shape = TinyShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seed=seed)
    build = materialise_tiny_random_rm if reward_model else materialise_tiny_random
    return str(build(cache_root(cache_dir), shape))
