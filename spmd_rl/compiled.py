"""Pure tensor functions through ``torch.compile``, with the eager code as a logged fallback.

    HEAD = CompileGroup("the fused log-prob head")
    stats = HEAD.wrap(chunk_stats)                       # compiled on the first call
    grad = HEAD.wrap(chunk_grad, eager=grad_in_place)    # another eager function with the same result

Each wrapped function is compiled once (``dynamic=True``: one artifact for every length,
``fullgraph=True``: no silent graph breaks). If compiling or running the compiled code fails (no
C++ compiler, a triton or inductor bug), the reason is logged once for the group and every function
of the group runs its eager code from then on: a broken toolchain slows a run, it does not stop it.
Out-of-memory errors are not toolchain trouble and propagate. Functions that share a code object
(closures of one ``def``) share dynamo's cache of compiled variants, and past its recompile limit
dynamo runs them eagerly by itself (with its own warning): a process that builds many different
model shapes gets the eager speed for the later ones.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("spmd_rl")


class CompileGroup:
    """Functions that are compiled together and fall back to eager together (module docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failed: str | None = None  # the first failure's reason, once one happened
        self._generation = 0  # bumped by reset(): wrappers compile again

    def wrap(self, fn: Callable, *, eager: Callable | None = None) -> Callable:
        """``fn`` compiled on first use; ``eager`` (default ``fn``) after a failure of the group.
        The compiled code lives with the returned wrapper (dropping the wrapper drops it)."""
        fallback = eager or fn
        state: dict[str, object] = {"generation": -1, "compiled": None}

        def call(*args: object) -> object:
            if self.failed is None:
                if state["generation"] != self._generation:
                    state["compiled"] = torch.compile(fn, dynamic=True, fullgraph=True)
                    state["generation"] = self._generation
                try:
                    return state["compiled"](*args)  # type: ignore[operator]
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # inductor / triton trouble: fall back rather than lose the run
                    self.failed = f"{type(exc).__name__}: {exc}"
                    log.warning("%s failed to compile or run (%s); running it eagerly from now on",
                                self.what, self.failed[:300])
            return fallback(*args)

        call.__name__ = call.__qualname__ = getattr(fn, "__name__", "compiled")
        return call

    def reset(self) -> None:
        """Forget compiled code and failures (tests; after swapping the toolchain)."""
        self.failed = None
        self._generation += 1


def triton_available(device: torch.device) -> bool:
    """Whether inductor can generate kernels for ``device`` the way the GPU paths use it: CUDA with triton."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["CompileGroup", "triton_available"]
