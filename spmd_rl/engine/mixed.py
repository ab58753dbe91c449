"""Mixed precision without FSDP, for an engine on one rank: compute copies of the fp32 weights.

On a mesh of one rank FSDP2 shards nothing, yet it still runs its hooks around every layer, keeps
the parameters as DTensors (so the optimizer step, the gradient norm and every parameter access go
through DTensor dispatch) and casts the weights per layer. For a small model that costs more than
the GPU's work (docs/PERF.md, "SmolLM2-135M: a small model's update is bound by launches"). So on one rank the engine keeps
the plain Hugging Face module (``actor.fsdp.wrap_one_rank`` restores FSDP there) and does what
FSDP2's mixed precision does, once per pass over the micro-batches:

* inside ``with copies.swapped():`` every floating-point weight whose dtype is not the compute dtype
  is replaced, in its module, by a copy in the compute dtype: a fresh leaf that records a gradient
  when the weight does; tied weights share one copy; leaving the block puts the weights back;
* after each backward, :meth:`ComputeCopies.grads_to_weights` adds each copy's gradient, cast to
  the weight's dtype, into the weight's ``.grad`` and drops the copy's. FSDP2 likewise accumulates
  the micro-batches' gradients in its reduce dtype (fp32), each cast from the compute dtype.

The optimizer, the gradient norm, checkpoints and weight export see the fp32 weights only, as on a
sharded mesh, and the numbers are FSDP2's on one rank (``tests/test_fsdp_one_rank.py`` checks them
bit for bit). Where the compute and weight dtypes agree (fp32 on CPU, a LoRA base stored in bf16)
nothing is copied.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class ComputeCopies:
    """The compute-dtype copies of ``model``'s weights for one pass (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []  # (weight, copy) of this pass

    def _slots(self) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        # every (module, name) that holds such a weight, a tied weight under each of its names; read at
        # every pass, so weights moved or replaced between passes are found where they are
        return [(module, name, p) for module in self.model.modules() for name, p in module._parameters.items()
                if p is not None and p.is_floating_point() and p.dtype != self.dtype]

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The modules hold the compute copies inside the block, their weights again after it."""
        slots = self._slots()
        if self._pairs:
            raise RuntimeError("ComputeCopies.swapped() does not nest")
        grad = torch.is_grad_enabled()
        weights = list({id(w): w for _, _, w in slots}.values())  # a tied weight once
        # one buffer and one multi-tensor cast: a small model's pass is bound by launches, not bytes
        views = _flat_like(weights, self.dtype)
        with torch.no_grad():
            _foreach_copy(views, [w.detach() for w in weights])
        copies = {id(w): torch.nn.Parameter(v, requires_grad=grad and w.requires_grad) for w, v in zip(weights, views)}
        self._pairs = [(w, copies[id(w)]) for w in weights]
        for module, name, weight in slots:
            module._parameters[name] = copies[id(weight)]
        try:
            yield
        finally:
            for module, name, weight in slots:
                module._parameters[name] = weight
            self._pairs = []

    @torch.no_grad()
    def grads_to_weights(self) -> None:
        """Add the copies' gradients (cast) into their weights' ``.grad``; the copies' go. Weights without a
        gradient yet get one as views of one buffer, written by one multi-tensor cast."""
        pairs = [(w, c) for w, c in self._pairs if c.grad is not None]
        fresh = [(w, c) for w, c in pairs if w.grad is None]
        added = [(w, c) for w, c in pairs if w.grad is not None]
        for (w, _), v in zip(fresh, _flat_like([w for w, _ in fresh])):
            w.grad = v
        _foreach_copy([w.grad for w, _ in fresh], [c.grad for _, c in fresh])
        for weight, copy in added:
            weight.grad.add_(copy.grad)
        for _, copy in pairs:
            copy.grad = None


def _flat_like(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Uninitialised tensors shaped like ``tensors`` (in ``dtype``, default each one's), views of one buffer
    per device and dtype."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, dtype or t.dtype), []).append(i)
    for (device, dt), idx in groups.items():
        flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=dt, device=device)
        for i, v in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = v.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def _foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` (casting) for all ``i``, as multi-tensor kernels where torch has them."""
    if dst:
        torch._foreach_copy_(dst, src)


__all__ = ["ComputeCopies"]
