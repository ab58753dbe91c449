"""The ``env`` section: multi-turn episodes with an environment and tools (``--env.*``).

    cfg.env.enabled          # an environment is set (--env.fn or --env.name)
    cfg.env.max_turns        # model turns per episode

With an environment every sample is an episode: the environment's first messages, then model turns
answered by the environment (or by tools) until it says done or a limit is reached
(:mod:`spmd_rl.episodes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .checks import _check


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn episodes: an environment answers the model's turns, tools run its calls."""

    fn: str | None = None
    """Your environment class as `module:Class`, built with no arguments, one instance per episode:
    `reset(row) -> messages` (the first chat messages, from the data row) and `step(reply) ->
    (messages, reward, done)` (the model's turn as text; the messages to append, a reward, whether
    the episode ended). The episode's reward is the sum of the rewards `step` returned."""
    name: Literal["guess_number", "python_math"] | None = None
    """A built-in environment (instead of `env.fn`): `guess_number` (find a hidden integer told
    higher / lower), `python_math` (arithmetic questions with the `python` tool)."""
    max_turns: int = 4
    """The episode ends after this many model turns (a turn that calls tools counts)."""
    max_tokens: int = 1024
    """Tokens of the whole episode after its first prompt, the model's and the environment's; past it
    the episode is cut and counted in `env/truncated_frac`."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: built-in `python` (code in a sandboxed subprocess) and `calculator`,
    or your functions as `module:function`. Calls use the chat template's `tools` when it has them,
    else the documented `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format."""
    workers: int = 8
    """Threads that run environment steps and tool calls beside generation, per rollout rank."""

    @property
    def enabled(self) -> bool:
        return self.fn is not None or self.name is not None

    def __post_init__(self) -> None:
        _check(self.fn is None or self.name is None,
               f"env.fn={self.fn!r} and env.name={self.name!r} both name an environment: set one of them")
        _check(self.max_turns >= 1, f"env.max_turns must be >= 1, got {self.max_turns}")
        _check(self.max_tokens >= 1, f"env.max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.workers >= 1, f"env.workers must be >= 1, got {self.workers}")
        _check(self.enabled or not self.tools,
               f"env.tools={self.tools} needs an environment: set --env.name or --env.fn")


__all__ = ["EnvConfig"]
