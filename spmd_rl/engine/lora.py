"""LoRA (``actor.lora.rank`` > 0): PEFT adapters on the FSDP engine's model, the frozen base as the
reference, merged weights for the rollout, and the adapters' own checkpoint and export formats.

    peft_model = apply_lora(model, cfg.actor.lora)     # before fully_shard; only the adapters train
    with adapters_off(model): ...                      # the frozen base (FSDPEngine.adapters_off)
    ref = FrozenBase(actor_engine)                     # the reference of a LoRA run: no weights of its own
    for name, tensor in merged_named_tensors(model, dtype=torch.bfloat16): ...   # HF names, W + s * B @ A
    merged = merge_adapters(base_state, adapter_state, scale=alpha / rank)      # export, no model
    save_peft_adapter(adapter_state, lora, out_dir, base_model=folder)          # PEFT's folder format

PEFT wraps each target ``nn.Linear`` in place: its weight moves to ``<module>.base_layer.weight`` and
the adapters are ``<module>.lora_A.default.weight`` ``[r, in]`` and ``<module>.lora_B.default.weight``
``[out, r]`` (B starts at zero, so step 0 is the base model). FSDP2 shards every parameter of a
decoder layer as one unit whatever its ``requires_grad``: it all-gathers the frozen and the trainable
ones together and reduce-scatters gradients of the trainable ones only, and asks a uniform dtype of
the trainable ones only, so on GPU the frozen base is kept in bf16 (the dtype it computes in under
mixed precision) and the adapters in fp32.

Merging happens shard by shard: FSDP shards ``W`` ``[out, in]`` and ``B`` ``[out, r]`` along dim 0 in
the same chunks, so a rank's rows of ``W + s * B @ A`` need only its own shards and the small ``A``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from spmd_rl.config import LoraConfig
    from spmd_rl.data.batch import RolloutBatch

ADAPTER = "default"
"""PEFT's adapter name; our parameter names carry it (``lora_A.default.weight``), PEFT's files do not."""
_BASE = ".base_layer"


def is_adapter_key(name: str) -> bool:
    """Whether a parameter (or checkpoint) name is a LoRA adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The Hugging Face name of a parameter of a PEFT-wrapped model (``.base_layer`` removed)."""
    return name.replace(_BASE + ".", ".")


def peft_targets(lora: LoraConfig) -> str | list[str]:
    return "all-linear" if tuple(lora.targets) == ("all-linear",) else list(lora.targets)


def peft_config(lora: LoraConfig, base_model: str | None = None) -> Any:
    """PEFT's ``LoraConfig`` of ``actor.lora`` (no dropout: the policy's log-probs must be deterministic)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=peft_targets(lora), lora_dropout=0.0,
                          bias="none", base_model_name_or_path=base_model)


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """Wrap ``model``'s target linear layers with adapters in place (PEFT ``get_peft_model``) and freeze
    everything else; returns the ``PeftModel`` (its ``disable_adapter()`` gives the base model).
    ``model`` stays the object to run and shard; its parameter names gain PEFT's infixes."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, peft_config(lora))
    except ValueError as e:  # no module matched the targets
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"actor.lora.targets={list(lora.targets)}: {e}. Linear layers of this model: {linear} "
                         "(or all-linear)") from e
    return peft_model


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block: every adapter layer computes its base layer only (PEFT's
    ``enable_adapters(False)``, what ``PeftModel.disable_adapter()`` does).

    PEFT also sets ``requires_grad=False`` on the adapters while they are off; under FSDP2 that is
    not harmless: FSDP2 makes each unsharded parameter once, at its first all-gather, with the
    ``requires_grad`` its shard has then, so a reference forward before the first update would leave
    the adapters without gradients for good. Their ``requires_grad`` is therefore put back before
    the block runs."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    for layer in layers:
        layer.enable_adapters(False)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (a collective when its mesh spans several ranks)."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()


def _merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
            dtype: torch.dtype) -> torch.Tensor:
    """The full ``W + scale * B @ A`` in ``dtype``, computed in fp32 on each rank's rows of ``W``."""
    a = _full(lora_a).float()
    if isinstance(weight, DTensor) and isinstance(lora_b, DTensor) and weight.placements == lora_b.placements:
        rows = (weight.to_local().float() + scale * (lora_b.to_local().float() @ a)).to(dtype)
        if weight.device_mesh.size() == 1:
            return rows
        return DTensor.from_local(rows, weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride()).full_tensor()
    return (_full(weight).float() + scale * (_full(lora_b).float() @ a)).to(dtype)


def merged_named_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of a PEFT-wrapped (and FSDP-sharded) model under its Hugging Face name, adapters
    merged (``W + scale * B @ A``), one full tensor at a time: a collective per tensor, so iterate on
    every rank. ``dtype`` None keeps the adapters' dtype for merged weights and the stored one for the rest."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, param in model.named_parameters():
        if is_adapter_key(name):
            continue  # merged into their base weight
        owner = name[: -len(".weight")].removesuffix(_BASE) if name.endswith(_BASE + ".weight") else None
        if owner in layers:
            layer = layers[owner]
            lora_a, lora_b = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
            yield hf_name(name), _merged(param.detach(), lora_a, lora_b, float(layer.scaling[ADAPTER]),
                                         dtype or lora_b.dtype)
            continue
        tensor = param.detach()
        if dtype is not None:
            tensor = tensor.to(dtype)  # a DTensor stays a DTensor: each rank casts its shard before the gather
        yield hf_name(name), _full(tensor)


class FrozenBase:
    """The reference of a LoRA run: the actor's own model with its adapters switched off, so the KL
    term needs no second copy of the weights. Only what the trainer asks of a reference."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.config = actor.config

    def micro_batches(self, batch: RolloutBatch, *, micro_batch_size: int) -> list[RolloutBatch]:
        return self.actor.micro_batches(batch, micro_batch_size=micro_batch_size)

    def compute_logprobs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.actor.adapters_off():
            return self.actor.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size,
                                               with_entropy=with_entropy)

    def offload(self) -> None:
        """Nothing of its own: the actor's weights follow the actor's settings."""

    def onload(self, *, optimizer: bool = False) -> None:
        """Nothing of its own (see :meth:`offload`)."""


# ---------------------------------------------------------------------- checkpoints, no model
def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], *,
                   scale: float) -> dict[str, torch.Tensor]:
    """HF-named full weights: ``base`` (the model folder's) with every adapter pair of ``adapters``
    (checkpoint names, ``<module>.lora_A.default.weight``) merged into ``<module>.weight`` in fp32."""
    merged = dict(base)
    suffix_a = f".lora_A.{ADAPTER}.weight"
    for name, lora_a in adapters.items():
        if not name.endswith(suffix_a):
            continue
        module = name[: -len(suffix_a)]
        lora_b = adapters.get(f"{module}.lora_B.{ADAPTER}.weight")
        key = f"{module}.weight"
        if lora_b is None or key not in base:
            raise ValueError(f"adapter {name}: no {'lora_B' if lora_b is None else 'base weight ' + key} to merge with")
        merged[key] = (base[key].float() + scale * (lora_b.float() @ lora_a.float())).to(base[key].dtype)
    return merged


def peft_adapter_state(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint adapter names as PEFT's ``adapter_model.safetensors`` keys
    (``base_model.model.<module>.lora_A.weight``: the wrapper's prefix, no adapter name)."""
    return {"base_model.model." + name.replace(f".{ADAPTER}.", "."): t.contiguous()
            for name, t in adapters.items() if is_adapter_key(name)}


def save_peft_adapter(adapters: dict[str, torch.Tensor], lora: LoraConfig, out_dir: str | os.PathLike, *,
                      base_model: str | None = None) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` in ``out_dir``: what
    ``PeftModel.from_pretrained(base, out_dir)`` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    peft_config(lora, base_model).save_pretrained(str(out))  # adapter_config.json
    save_file(peft_adapter_state(adapters), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


__all__ = ["ADAPTER", "FrozenBase", "adapters_off", "apply_lora", "hf_name", "is_adapter_key", "merge_adapters",
           "merged_named_tensors", "peft_adapter_state", "peft_config", "save_peft_adapter"]
