"""Where a NaN or inf first appears in one forward and backward: which module, which autograd node.

    watch = NonfiniteWatch(model)
    with watch:                       # forward hooks on every module, forward tracebacks recorded
        loss = loss_fn(model(...))
        watch.track(loss)             # a hook on every autograd node that leads to the loss
        loss.backward()
    log.warning(watch.report())       # "forward: model.layers.3.self_attn (...) turned finite inputs ..."

A non-finite gradient with finite losses means a NaN was made somewhere the loss does not look
(padding positions, a masked-out row) or inside a backward kernel; the gradient norm alone cannot
say where. The watch records, in time order:

* **forward**: the first module whose output has a NaN/inf while its tensor inputs and its own
  parameters are finite (inner modules finish first, so this is the innermost such module), with
  the positions (leading two dims) that hold it;
* **backward**: the first autograd node that returned a non-finite gradient from finite incoming
  gradients, with the source line that created it in the forward (recorded through anomaly mode
  with ``check_nan=False``, so nothing raises).

No hook raises and the forward and backward run to the end, so every rank of an FSDP mesh stays in
lockstep through the collectives while replaying. It costs a full ``isfinite`` pass over every
activation and gradient: for diagnosis after the fact, not for every step.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The floating-point tensors inside nested tuples / lists / mappings (e.g. a ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            yield value.to_local() if isinstance(value, DTensor) else value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _finite(value: object) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(value))


def _positions(t: torch.Tensor, limit: int = 4) -> tuple[int, int, list[tuple[int, ...]]]:
    """(bad positions, all positions, the first ``limit`` of them) over ``t``'s leading two dims."""
    bad = ~torch.isfinite(t.detach())
    if bad.dim() > 2:
        bad = bad.flatten(2).any(-1)
    where = bad.nonzero()[:limit].tolist()
    return int(bad.sum()), bad.numel(), [tuple(w) for w in where]


def _creation_site(node: torch.autograd.graph.Node, frames: int = 3) -> str:
    """The innermost forward frames (outside torch's module machinery) that created ``node``."""
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    if not stack:
        return "source unknown"
    skip = ("torch/nn/modules/module.py", "torch/autograd/", "torch/_dynamo", "torch/distributed/",
            "torch/utils/", "nanwatch.py", "contextlib.py")
    kept = []
    for frame in stack if isinstance(stack, list) else [stack]:
        head = frame.strip().splitlines()[0] if frame.strip() else ""
        if not head.startswith("File ") or any(s in head for s in skip):
            continue
        # 'File "/a/b/c/x.py", line 12, in fn' -> 'c/x.py:12 in fn'
        try:
            path, line, fn = head.split(", ", 2)
            short = "/".join(path[len('File "'):-1].split("/")[-2:])
            kept.append(f"{short}:{line.split()[-1]} {fn}")
        except ValueError:
            kept.append(head)
    return " <- ".join(reversed(kept[-frames:])) or "source unknown"


@dataclass
class Finding:
    phase: str  # "forward" or "backward"
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.phase}: {self.where} {self.detail}"


class NonfiniteWatch:
    """Forward hooks on every submodule of ``model`` and, after :meth:`track`, hooks on every
    autograd node of the loss's graph; the first non-finite origin of each phase is kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.forward: Finding | None = None
        self.backward: Finding | None = None
        self._handles: list = []
        self._anomaly: torch.autograd.detect_anomaly | None = None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> "NonfiniteWatch":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name or "<model>"), with_kwargs=True))
        with warnings.catch_warnings():  # "Anomaly Detection has been enabled...": we know, it is on purpose
            warnings.simplefilter("ignore")
            self._anomaly = torch.autograd.detect_anomaly(check_nan=False)  # only to keep forward tracebacks
            self._anomaly.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._anomaly is not None:
            self._anomaly.__exit__(*exc)
            self._anomaly = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def found(self) -> bool:
        return self.forward is not None or self.backward is not None

    def report(self) -> str:
        if not self.found:
            return "no non-finite value in this forward and backward"
        return "; ".join(str(f) for f in (self.forward, self.backward) if f is not None)

    # ------------------------------------------------------------------ forward
    def _forward_hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if self.forward is not None:
                return
            outs = [t for t in _tensors(output) if not bool(torch.isfinite(t).all())]
            if not outs or not _finite((args, kwargs)):
                return
            if not _finite(list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))):
                self.forward = Finding("forward", f"{name} ({type(module).__name__})",
                                       "has non-finite parameters or buffers")
                return
            bad, total, first = _positions(outs[0])
            shape = list(outs[0].shape)
            self.forward = Finding(
                "forward", f"{name} ({type(module).__name__})",
                f"turned finite inputs into a non-finite output {shape}: {bad} of {total} positions, first {first}",
            )

        return hook

    # ------------------------------------------------------------------ backward
    def track(self, loss: torch.Tensor) -> None:
        """Hook every node reachable from ``loss.grad_fn`` (call before ``loss.backward()``)."""
        if loss.grad_fn is None:
            return
        seen: set = set()
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            self._handles.append(node.register_hook(self._node_hook(node)))
            stack.extend(fn for fn, _ in node.next_functions)

    def _node_hook(self, node: torch.autograd.graph.Node):
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if self.backward is not None or _finite(grad_inputs) or not _finite(grad_outputs):
                return
            self.backward = Finding("backward", node.name(),
                                    f"returned a non-finite gradient from finite incoming gradients; created at "
                                    f"{_creation_site(node)}")

        return hook


__all__ = ["Finding", "NonfiniteWatch"]
