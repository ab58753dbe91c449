"""Multi-turn, tool-using episodes: the environment interface and its loader (``env``), built-in
environments (``builtin``), adapters for other frameworks' environments (``adapters``), tools and
their calls (``tools``) and the ``python`` tool's sandbox (``sandbox``). See docs/AGENTS.md.

Import the submodules (``from spmd_rl.episodes.env import Env, load_env``); this package imports
nothing itself, so loading one piece does not load the others.
"""
