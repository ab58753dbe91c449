"""Import a user object named ``module:attr`` (``module:Class.attr`` also works) from ``sys.path``.

The one loader behind every flag that names user code (``reward.fn``, ``env.fn``, ``env.tools``).
Every failure is a ``ValueError`` that starts with the flag and its value, so the message says which
setting to fix::

    fn = import_object("my_rewards:score", flag="reward.fn=my_rewards:score",
                       usage="`module:function`")

``usage`` completes the sentence "expected ..." of the message for a value without ``:``. What the
object must be (a function, a class with certain methods) is for the caller to check.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def _import_module(module_name: str, flag: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"{flag}: no module named {e.name!r} on sys.path; put its folder on PYTHONPATH "
                f"(sys.path starts with {sys.path[:3]})"
            ) from e
        raise ValueError(f"{flag}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise ValueError(f"{flag}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e


def import_object(spec: str, *, flag: str, usage: str) -> Any:
    """The object ``spec`` = ``module:attr.path`` names; a ``ValueError`` starting with ``flag`` when
    ``spec`` has no ``:``, the module cannot be imported (with the import's own error) or has no such
    attribute (listing the callables it has)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name.strip() or not attr_path.strip():
        raise ValueError(f"{flag}: expected {usage}")
    module = _import_module(module_name, flag)
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            where = getattr(module, "__file__", module_name)
            raise ValueError(f"{flag}: {where} has no attribute {part!r}; callables there: {names}")
        obj = getattr(obj, part)
    return obj


__all__ = ["import_object"]
