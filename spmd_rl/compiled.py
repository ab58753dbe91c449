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

Two groups use it: the fused log-prob head (:mod:`spmd_rl.engine.head`) and the rollout's compiled
decode layers (:mod:`spmd_rl.rollout.fast`), both on CUDA where :func:`triton_available`.
:func:`use_compile_cache` keeps the compiled artifacts between runs in the model cache folder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.fx.experimental._config as fx_config

log = logging.getLogger("spmd_rl")


class CompileGroup:
    """Functions that are compiled together and fall back to eager together (module docstring)."""

    def __init__(self, what: str, *, duck_shapes: bool = True) -> None:
        """``duck_shapes=False``: sizes that happen to be equal when a function is first traced (the rows of
        a step and the rows of a cache it writes, both full) stay separate symbols, so a later call where
        they differ needs no second compile."""
        self.what = what
        self.duck_shapes = duck_shapes
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
                    if self.duck_shapes:
                        return state["compiled"](*args)  # type: ignore[operator]
                    with fx_config.patch(use_duck_shape=False):  # read when dynamo traces
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


def use_compile_cache(folder: str | os.PathLike) -> dict[str, str]:
    """Keep ``torch.compile``'s artifacts between runs under ``folder`` (the run's cache folder, e.g.
    ``<cache_root>/compile``) rather than in ``/tmp``: ``TORCHINDUCTOR_CACHE_DIR`` holds inductor's
    FX-graph and AOT-autograd caches (both on by default in torch 2.13) and its generated code,
    ``TRITON_CACHE_DIR`` the compiled GPU kernels. A variable the user set is left alone; importing
    ``torch._dynamo`` writes torch's default (``/tmp/torchinductor_<user>``) into the first one, and
    that value counts as unset. Call it before anything compiles (torch reads both when it compiles);
    the environment passes them on to inductor's compile workers. Returns the variables it set. A
    later run then loads the compiled code instead of compiling it again; CUDA-graph captures belong
    to a process and are always redone."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    wanted = {"TORCHINDUCTOR_CACHE_DIR": (Path(folder), os.path.abspath(default_cache_dir())),
              "TRITON_CACHE_DIR": (Path(folder) / "triton", None)}
    out = {}
    for name, (path, torch_default) in wanted.items():
        if os.environ.get(name) in (None, "", torch_default):
            os.environ[name] = out[name] = str(path)
    return out


__all__ = ["CompileGroup", "triton_available", "use_compile_cache"]
