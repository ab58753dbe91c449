"""The environment interface of multi-turn episodes, and ``load_env``, which picks the run's environment.

An environment is a class built with no arguments, one instance per episode::

    class Env(Protocol):
        def reset(self, row: dict) -> list[dict]: ...          # the first chat messages, from the data row
        def step(self, reply: str) -> tuple[list[dict], float, bool]: ...
            # reply: the model's last turn as text; returns (messages to append, reward, done)

The episode's reward is the sum of the rewards ``step`` returned. Usage::

    make_env = load_env(fn=cfg.env.fn, name=cfg.env.name)    # --env.fn module:Class or --env.name NAME
    env = make_env()
    messages = env.reset(row)
    new_messages, reward, done = check_step(env.step(reply), make_env)

``--env.name`` takes a built-in (:data:`EnvName`, :data:`BUILTIN_ENVS`), ``--env.fn`` a user class
``module:Class`` importable from ``sys.path``; either failing to load is a ``ValueError`` naming the flag
and its value. :func:`check_messages` and :func:`check_step` turn a wrong return value of a user
environment into a ``TypeError`` that names the class and what was wrong.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Literal, Protocol, get_args, runtime_checkable

from spmd_rl.episodes.adapters import TextArenaEnv
from spmd_rl.episodes.builtin import GuessNumberEnv, PythonMathEnv
from spmd_rl.user_code import import_object


@runtime_checkable
class Env(Protocol):
    """One episode's environment (see the module docstring)."""

    def reset(self, row: dict) -> list[dict]: ...

    def step(self, reply: str) -> tuple[list[dict], float, bool]: ...


EnvFactory = Callable[[], Env]

EnvName = Literal["guess_number", "python_math", "textarena"]
"""The built-in environments' names (``--env.name``)."""

BUILTIN_ENVS: dict[str, EnvFactory] = {
    "guess_number": GuessNumberEnv,
    "python_math": PythonMathEnv,
    "textarena": TextArenaEnv,
}
assert set(BUILTIN_ENVS) == set(get_args(EnvName))


def _required_arguments(cls: type) -> list[str]:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _check_env_class(obj: Any, flag: str) -> EnvFactory:
    """``obj`` if it is a class with callable ``reset`` and ``step`` that needs no arguments."""
    if not inspect.isclass(obj):
        raise ValueError(f"{flag}: is a {type(obj).__name__}, not a class with reset(row) and step(reply)")
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"{flag}: class {obj.__name__} has no method {' and no '.join(missing)}; an environment "
                         "defines reset(row) -> messages and step(reply) -> (messages, reward, done)")
    required = _required_arguments(obj)
    if required:
        raise ValueError(f"{flag}: class {obj.__name__} needs the argument(s) {required}, but each episode's "
                         "environment is built with none; give them defaults or read them from the row")
    return obj


def load_env(fn: str | None, name: str | None) -> EnvFactory:
    """The class that makes each episode's environment: ``fn`` (``--env.fn module:Class``) or ``name``
    (``--env.name``, a built-in); exactly one of them must be set."""
    fn = fn.strip() if fn else None
    name = name.strip() if name else None
    if fn and name:
        raise ValueError(f"env.fn={fn} and env.name={name} are both set; set one of them")
    if name:
        if name not in BUILTIN_ENVS:
            raise ValueError(f"env.name={name}: no such built-in environment; the built-ins are "
                             f"{', '.join(BUILTIN_ENVS)} (a class of your own goes in --env.fn module:Class)")
        return BUILTIN_ENVS[name]
    if not fn:
        raise ValueError("no environment: set --env.fn module:Class or --env.name "
                         f"({', '.join(BUILTIN_ENVS)})")
    flag = f"env.fn={fn}"
    return _check_env_class(import_object(fn, flag=flag, usage="`module:Class` (a class with reset and step)"), flag)


def _name(source: Any) -> str:
    return getattr(source, "__qualname__", None) or type(source).__qualname__


def check_messages(messages: Any, source: Any, method: str = "reset") -> list[dict]:
    """``messages`` if it is a list of ``{"role": str, "content": str, ...}``; else a ``TypeError``
    naming ``source`` (the environment's class or instance) and ``method``."""
    where = f"{_name(source)}.{method}"
    if not isinstance(messages, list):
        raise TypeError(f"{where} returned a {type(messages).__name__} as messages, expected a list of dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}: message {i} is {m!r:.120}; each message needs a `role` and a `content` string")
    return messages


def check_step(result: Any, source: Any) -> tuple[list[dict], float, bool]:
    """``step``'s return value as ``(messages, reward, done)``; else a ``TypeError`` naming ``source``."""
    where = f"{_name(source)}.step"
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(f"{where} returned {result!r:.120}, expected a tuple (messages, reward, done)")
    messages, reward, done = result
    check_messages(messages, source, "step")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise TypeError(f"{where} returned the reward {reward!r}, expected a finite number")
    if not isinstance(done, (bool, numbers.Integral)) and type(done).__name__ != "bool_":
        raise TypeError(f"{where} returned done={done!r}, expected a bool")
    return messages, float(reward), bool(done)


__all__ = ["BUILTIN_ENVS", "Env", "EnvFactory", "EnvName", "check_messages", "check_step", "load_env"]
