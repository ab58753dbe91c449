"""A Hugging Face model under FSDP2 over a device mesh, or the plain module on one rank: the one
wrapping both the training engine (:class:`~spmd_rl.engine.fsdp.FSDPEngine`) and the reward model
(:class:`~spmd_rl.reward.model.RewardModel`) use.

    copies = shard_model(model, mesh=mesh, compute_dtype=torch.bfloat16, sharded=mesh.size() > 1)
    with copies.swapped() if copies is not None else nullcontext():   # the plain module's pass
        out = model(...)

Sharded: every decoder layer (``model.<base_model_prefix>.layers``) is its own FSDP unit and the root
holds the rest (embeddings, final norm, head); parameters stay fp32 and compute in ``compute_dtype``
with fp32 gradient reduction. Gradients are SUMMED across ranks (divide factor 1, sum reduction on
the wire, which gloo also runs): the trainer divides each loss by the global count itself.
Not sharded: the plain module, which computes in ``compute_dtype`` through the returned
:class:`~spmd_rl.engine.mixed.ComputeCopies` (FSDP2's mixed precision without FSDP2).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from spmd_rl.engine.mixed import ComputeCopies


def decoder_layers(model: torch.nn.Module, *, required: bool = True) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face model (``model.<base_model_prefix>.layers``); without them
    a ValueError, or ``[]`` when not ``required`` (the root is then the only FSDP unit)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if layers is None:
        if not required:
            return []
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; the FSDP engine supports decoder-only "
            "Hugging Face models of the Llama / Qwen / Mistral shape"
        )
    return list(layers)


def shard_model(model: torch.nn.Module, *, mesh: DeviceMesh, compute_dtype: torch.dtype, sharded: bool,
                reshard_after_forward: bool = True, compile_layers: bool = False,
                layers_required: bool = True) -> ComputeCopies | None:
    """Wrap ``model`` in place (module docstring); returns the compute copies of the plain module when
    not ``sharded``, else None. ``compile_layers``: each decoder layer through ``torch.compile`` in
    place (module identity and parameter names stay), sharded or not."""
    mp = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
          if compute_dtype != torch.float32 else MixedPrecisionPolicy())
    for layer in decoder_layers(model, required=layers_required):
        if compile_layers:
            layer.compile(dynamic=True)
        if sharded:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if not sharded:
        return ComputeCopies(model, compute_dtype)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return None


__all__ = ["decoder_layers", "shard_model"]
