"""MoE router replay ("R3") in the trainer's forwards: each token the rollout generated goes to the
experts the rollout's router chose for it, whatever the trainer's own router would pick.

    replay = RouterReplay(model)       # every MoE layer's router of a Hugging Face model (ValueError if unlike Qwen3-MoE's)
    replay.check(batch["routed_experts"])   # on the host: the records fit this model
    replay.set(routes)                 # [tokens of the forward's grid, MoE layers, top_k] int, -1: route by own logits
    out = model(input_ids=...)         # and the backward's recompute under gradient checkpointing
    replay.set(None)                   # every token by its own logits again

    grid = routes_grid(batch["routed_experts"], flat)   # the response tokens' routes laid out as the engine's grid

Why: a mixture-of-experts model's top-k is discontinuous: a bf16 rollout and an fp32 trainer that
differ in the last bits of a router logit pick a different expert for some tokens, and those tokens'
log-probs then differ by far more than precision (docs/OFFPOLICY.md). Replaying the rollout's choice
removes that part of the mismatch; the gate weights stay the trainer's own (softmax of its router
logits, gathered at the recorded experts, renormalised as the model does), so the router still
learns. The load-balancing loss (``output_router_logits``) is computed from the router logits as
before.

What is replayed: the tokens the rollout generated (the decode step records them,
:meth:`spmd_rl.rollout.fast.FastDecoder.routes`); prompt tokens, environment tokens and padding route by
the trainer's logits (a row of -1). The routers are found by structure, not by class name: a
module named ``gate`` inside a decoder layer's MLP with ``top_k``, ``num_experts``, ``norm_topk_prob``
and a ``weight [experts, hidden]``, returning ``(logits, weights, indices)``; :class:`RouterReplay`
checks on a probe input that its forward is the softmax top-k it replaces before patching anything.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from .sharding import decoder_layers


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of ``model``'s decoder layers, in layer order (dense layers have none)."""
    out = []
    for layer in decoder_layers(model):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and all(hasattr(gate, a) for a in ("top_k", "num_experts", "norm_topk_prob", "weight")):
            out.append(gate)
    return out


def _route(router: torch.nn.Module, hidden: torch.Tensor, given: torch.Tensor | None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router (softmax in float32, top-k, renormalised when ``norm_topk_prob``), with the
    experts of the tokens whose row of ``given [tokens, k]`` has no -1 taken from it."""
    hidden = hidden.reshape(-1, router.weight.shape[1])
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, router.top_k, dim=-1)
    if given is not None:
        replayed = (given >= 0).all(dim=-1, keepdim=True)
        top_i = torch.where(replayed, given.to(top_i.dtype), top_i)
        top_w = probs.gather(-1, top_i)
    if router.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return logits, top_w.to(logits.dtype), top_i


class RouterReplay:
    """Patches the routers of ``model`` so that :meth:`set` decides the experts (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError("--actor.router-replay needs a mixture-of-experts model: "
                             f"{type(model).__name__} has no MoE router in its decoder layers")
        for i, router in enumerate(self.routers):
            reason = self._unlike(router)
            if reason is not None:
                raise ValueError(f"--actor.router-replay: the router of MoE layer {i} ({type(router).__name__}) "
                                 f"{reason}; replay is built for Qwen3-MoE's softmax top-k router")
        self.top_k = int(self.routers[0].top_k)
        self.experts = int(self.routers[0].num_experts)
        self.routes: torch.Tensor | None = None
        for j, router in enumerate(self.routers):
            router.forward = types.MethodType(self._forward_of(j), router)

    @staticmethod
    def _unlike(router: torch.nn.Module) -> str | None:
        """Why ``router``'s own forward is not :func:`_route` (None: it is), on a probe input."""
        if router.weight.is_meta:
            return None  # nothing to compare on a meta device
        probe = torch.randn(5, router.weight.shape[1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(device=router.weight.device, dtype=router.weight.dtype)
        with torch.no_grad():
            try:
                theirs = router(probe)
            except Exception as e:  # noqa: BLE001 - the message names it
                return f"cannot run on a probe input ({type(e).__name__}: {e})"
            if not (isinstance(theirs, tuple) and len(theirs) == 3):
                return "does not return (logits, weights, experts)"
            mine = _route(router, probe, None)
            same = all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-6)
                       for a, b in zip(theirs, mine))
        return None if same else "computes something other than a softmax top-k over its logits"

    def _forward_of(self, j: int) -> Any:
        replay = self

        @torch.compiler.disable  # a graph break: the routes change every micro-batch
        def forward(router: torch.nn.Module, hidden_states: torch.Tensor):
            given = None if replay.routes is None else replay.routes[:, j]
            if given is not None and given.shape[0] != hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]:
                raise RuntimeError(f"router replay: {given.shape[0]} recorded tokens for a forward of "
                                   f"{hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]}")
            return _route(router, hidden_states, given)

        return forward

    def check(self, records: torch.Tensor) -> None:
        """A batch's ``routed_experts [B, T, MoE layers, top_k]`` (on the host, before staging: no device
        sync) fit this model: its MoE layers, its top-k, its experts."""
        if tuple(records.shape[2:]) != (len(self.routers), self.top_k):
            raise ValueError(f"router replay: records of shape {tuple(records.shape)} for a model of "
                             f"{len(self.routers)} MoE layers and top_k {self.top_k}")
        if records.numel() and int(records.max()) >= self.experts:
            raise ValueError(f"router replay: expert {int(records.max())} recorded, the model has {self.experts}")

    def set(self, routes: torch.Tensor | None) -> None:
        """The experts of the next forwards (and their recompute): ``[tokens, MoE layers, top_k]`` in the
        order the model flattens its input (rows, then columns), -1 rows route by own logits; None: all."""
        if routes is not None and tuple(routes.shape[1:]) != (len(self.routers), self.top_k):
            raise ValueError(f"router replay: routes of shape {tuple(routes.shape)} for a model of "
                             f"{len(self.routers)} MoE layers and top_k {self.top_k}")
        self.routes = routes


def routes_grid(routes: torch.Tensor, *, target_rows: torch.Tensor, target_cols: torch.Tensor,
                model_tokens: torch.Tensor, grid_rows: int, width: int) -> torch.Tensor:
    """``routes [B, T, layers, k]`` (response token t of row b) laid out as the forward's ``[R, W, layers,
    k]`` grid: the token at cell ``(target_rows, target_cols + 1)``, since ``target_*`` name the cell that
    predicts it (:class:`spmd_rl.engine.packing.FlatBatch`); only where ``model_tokens [B, T]``, every
    other cell -1 (route by own logits)."""
    grid = torch.full((grid_rows, width, *routes.shape[2:]), -1, dtype=routes.dtype)
    mine = model_tokens.bool()
    grid[target_rows[mine], target_cols[mine] + 1] = routes[mine]
    return grid


__all__ = ["RouterReplay", "find_routers", "routes_grid"]
