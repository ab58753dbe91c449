"""MoE router replay ("R3", ``--actor.router-replay``) in the megatron engine: each token the rollout
generated goes to the experts the rollout's router chose for it (:mod:`spmd_rl.engine.routing` is the
FSDP engine's side and says why).

    replay = MegatronRouterReplay(chunks, layers=L, top_k=k, experts=E, config=tf_config)  # GPTModel per vpp stage
    grid = grid_routes(micro, rows=B, width=W, starts=prompt_lengths)   # [B, W, L, k], -1: no record
    routes = replay.layout(grid, held_cols=..., tp=..., tp_rank=..., sequence_parallel=...)  # this rank's order
    replay.set(i, routes)            # before chunk i's forward of a micro-batch; None: own logits

Hook: megatron-core 0.16's ``TopKRouter`` keeps a ``router_replay`` object that
``topk_routing_with_score_function`` asks for the top-k (``get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)``). megatron-core's own ``RouterReplay`` (behind
``moe_enable_routing_replay``) replaces the experts of EVERY token of a forward; here prompt tokens,
environment tokens and padding must keep routing by the trainer's logits, so each router gets a
:class:`_LayerReplay` in its place (the config flag stays off: megatron registers nothing global) that
computes megatron's own top-k and then, for the tokens with a record (no -1 in their row), takes the
recorded experts and gathers their scores. The scores are what megatron's top-k ran on: the router
logits when the top-k is renormalised (``moe_router_pre_softmax`` False; megatron then takes the softmax
of the gathered logits = the softmax over all experts gathered at the recorded ones and renormalised,
as Qwen3-MoE with ``norm_topk_prob`` / Mixtral), or the softmax over all experts (pre-softmax, Qwen3-MoE
without ``norm_topk_prob``: the recorded experts' probabilities as they are). The gate weights are thus
the trainer's own, with their gradient; the routing map and the token dispatch follow the replayed
experts. No load-balancing loss is configured (``moe_router_load_balancing_type`` "none").

Token order: a router sees the hidden states ``[S, B, H]`` its MoE layer gets, flattened sequence-major
(token ``s * B + b``). :meth:`MegatronRouterReplay.layout` puts the records in that order: the grid's
columns this cp rank holds (:func:`~spmd_rl.engine.megatron.context.chunk_columns`: two chunks, in local
order), transposed to ``[S, B]``, and under sequence parallelism this tp rank's ``S / tp`` slice (the
embedding scatters the sequence over tp before the first layer; pipeline stages receive it already
split). Expert parallelism changes nothing here: every rank routes its own tokens before the dispatch.
Each chunk's routers take the layers they are (megatron numbers a chunk's layers globally); the engine
sets them in its forward step, just before that chunk runs that micro-batch, so the interleaved
schedule's order does not matter. The backward replays nothing: the engine does not recompute
activations (the routing is in the saved graph); a config that recomputes is refused.
"""

from __future__ import annotations

import inspect

import torch


class _LayerReplay:
    """One router's hook (module docstring); ``given [tokens, k]`` int, a row with -1: own top-k."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.given: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        given = self.given
        if given is None:
            return values, indices
        if given.shape != indices.shape:
            raise RuntimeError(f"router replay: {tuple(given.shape)} recorded experts for MoE layer {self.layer}, "
                               f"whose router routes {tuple(indices.shape)} (tokens, top_k) on this rank")
        replayed = (given >= 0).all(dim=-1, keepdim=True)
        indices = torch.where(replayed, given.to(indices.device, indices.dtype), indices)
        return scores.gather(1, indices), indices


class MegatronRouterReplay:
    """The replay hooks of the actor's routers, per model chunk (module docstring)."""

    def __init__(self, chunks: list[torch.nn.Module], *, layers: int, top_k: int, experts: int, config) -> None:
        from megatron.core.transformer.moe import moe_utils

        if "router_replay" not in inspect.signature(moe_utils.topk_routing_with_score_function).parameters:
            raise ValueError("--actor.router-replay with --actor.engine megatron needs megatron-core >= 0.16 (its "
                             "router's replay hook); use --actor.engine fsdp or a newer megatron-core")
        if getattr(config, "recompute_granularity", None) is not None or getattr(config, "moe_router_fusion", False):
            raise ValueError("router replay: the megatron engine sets the recorded experts per forward; activation "
                             "recompute (which routes again in the backward) and the fused TE router are not supported")
        self.layers, self.top_k, self.experts = layers, top_k, experts
        self.hooks: list[list[_LayerReplay]] = []
        for chunk in chunks:
            hooks = []
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is None or not hasattr(router, "router_replay"):
                    raise ValueError(f"router replay: layer {layer.layer_number} of the megatron model has no MoE "
                                     "router; replay needs every layer routed (as the engine converts them)")
                router.router_replay = hook = _LayerReplay(layer.layer_number - 1)  # global, from 1
                hooks.append(hook)
            self.hooks.append(hooks)

    def layout(self, grid: torch.Tensor, *, held_cols: torch.Tensor | None, tp: int, tp_rank: int,
               sequence_parallel: bool) -> torch.Tensor:
        """``grid [B, W, layers, k]`` (the engine's rows and columns) -> ``[tokens, layers, k]`` in the order
        this rank's routers see the tokens (module docstring)."""
        if tuple(grid.shape[2:]) != (self.layers, self.top_k):
            raise ValueError(f"router replay: records of {tuple(grid.shape[2:])} (MoE layers, top_k) for a model of "
                             f"{self.layers} MoE layers and top_k {self.top_k}")
        if grid.numel() and int(grid.max()) >= self.experts:
            raise ValueError(f"router replay: expert {int(grid.max())} recorded, the model has {self.experts}")
        if held_cols is not None:  # context parallel: this cp rank's two chunks, in its local order
            grid = grid[:, held_cols]
        seq = grid.transpose(0, 1)  # [S, B, ...] as the hidden states
        if sequence_parallel and tp > 1:
            part = seq.shape[0] // tp
            seq = seq[tp_rank * part:(tp_rank + 1) * part]
        return seq.reshape(-1, self.layers, self.top_k).contiguous()

    def set(self, chunk: int, routes: torch.Tensor | None) -> None:
        """The experts of the next forward of chunk ``chunk`` (its vpp stage): ``routes [tokens, layers, k]``
        from :meth:`layout` (a row of -1: own logits), or None (every token by its own logits)."""
        for hook in self.hooks[chunk]:
            hook.given = None if routes is None else routes[:, hook.layer]


def grid_routes(micro, *, rows: int, width: int, starts: list[int]) -> torch.Tensor:
    """``micro["routed_experts"] [b, T, layers, k]`` at the engine's grid ``[rows, width, layers, k]``:
    response token t of row i at column ``starts[i] + t`` where the response mask is set; -1 elsewhere
    (prompts, environment tokens, padding rows and columns)."""
    routes = micro["routed_experts"]
    if routes.shape[:2] != micro["response_ids"].shape:
        raise ValueError(f"router replay: routed_experts of shape {tuple(routes.shape)} for responses of "
                         f"{tuple(micro['response_ids'].shape)}")
    grid = torch.full((rows, width, *routes.shape[2:]), -1, dtype=routes.dtype)
    mask = micro["response_mask"].cpu() > 0
    for i, start in enumerate(starts):
        cols = mask[i].nonzero().squeeze(1)
        grid[i, start + cols] = routes[i, cols].cpu()
    return grid


__all__ = ["MegatronRouterReplay", "grid_routes"]
