"""The FSDP engine's state: checkpoints (:class:`FSDPCheckpointing`), memory between phases
(:class:`FSDPOffload`) and its weights as full tensors (:class:`FSDPWeights`), mixed into
:class:`~spmd_rl.engine.fsdp.FSDPEngine` as the megatron engine's are
(:mod:`spmd_rl.engine.megatron.reshard`, :mod:`spmd_rl.engine.megatron.offload`).

    state = engine.state_dict()     # this rank's shards under HF names, for torch.distributed.checkpoint
    engine.load_state_dict(state)   # after DCP filled it in place; this run's optimizer settings apply
    engine.offload()                # between phases (actor.fsdp.param_offload / optimizer_offload)
    engine.onload(optimizer=True)   # before an update
    for name, t in engine.named_full_tensors(torch.bfloat16): ...   # to the rollout (every rank iterates)

They read the engine's attributes: ``model``, ``optimizer``, ``scheduler``, ``actor``, ``peft``,
``device``, ``on_gpu``, ``param_offload``, ``optimizer_offload`` and the two ``_*_on_device`` flags.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from spmd_rl.engine import host_memory
from spmd_rl.engine import lora as lora_utils


class FSDPCheckpointing:
    """``state_dict`` / ``load_state_dict`` for ``torch.distributed.checkpoint`` (resharding on load)."""

    def state_dict(self) -> dict[str, object]:
        """``{"model", "optimizer", "scheduler"}`` for ``torch.distributed.checkpoint``.

        Model and optimizer entries are this rank's DTensor shards under HF parameter names (no
        gather; plain tensors on one rank), so DCP can reload them on another world size or mesh.
        A trainable engine whose optimizer has not stepped yet gets its state created first (a
        zero-lr step, weights unchanged) so that a load has tensors to fill. The reference engine has only ``model``.
        Tensors stay where they are (offloaded ones on the CPU); DCP writes them from there.
        """
        # with LoRA: the adapters only (the base comes from the model folder, unchanged)
        options = StateDictOptions(full_state_dict=False, cpu_offload=False, ignore_frozen_params=self.peft is not None)
        if self.optimizer is not None and not self.optimizer.state:
            self.onload(optimizer=True)  # that zero-lr step runs where parameters and state meet
        if self.optimizer is None:
            model_sd, _ = get_state_dict(self.model, [], options=options)
            return {"model": model_sd}
        assert self.scheduler is not None
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if self.peft is not None:  # a tied head's second name survives ignore_frozen_params
            model_sd = {k: v for k, v in model_sd.items() if lora_utils.is_adapter_key(k)}
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Nothing: :meth:`state_dict`'s ``model`` holds the weights under HF names already."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` returned (after DCP filled it in place), then offload
        as configured (the optimizer puts loaded state next to its parameters, on the device)."""
        # LoRA: the state holds exactly the adapters state_dict() asked DCP for; the base is not in it
        options = StateDictOptions(full_state_dict=False, strict=self.peft is None, ignore_frozen_params=self.peft is not None)
        self.onload(optimizer=True)
        if self.optimizer is None:
            set_state_dict(self.model, [], model_state_dict=state["model"], optim_state_dict={}, options=options)  # type: ignore[arg-type]
        else:
            assert self.scheduler is not None
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],  # type: ignore[arg-type]
                           optim_state_dict=state["optimizer"], options=options)  # type: ignore[arg-type]
            self.scheduler.load_state_dict(state["scheduler"])  # type: ignore[arg-type]
            self._apply_optimizer_settings()
        self.offload()

    def _apply_optimizer_settings(self) -> None:
        """After a load: this run's ``actor.lr``, ``betas`` and ``weight_decay`` replace the saved ones
        (the optimizer's param groups and the scheduler's base LR hold the saving run's), and the LR
        continues from the saved update count on this run's schedule (warmup, shape, floor, length:
        the scheduler's lambda is this run's, with its ``total_updates``). ``grad_clip`` is read from
        this run's config at every step already."""
        assert self.optimizer is not None and self.scheduler is not None and self.actor is not None
        actor, sched = self.actor, self.scheduler
        sched.base_lrs = [actor.lr] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, sched.lr_lambdas):
            group.update(initial_lr=actor.lr, lr=actor.lr * factor(sched.last_epoch), betas=tuple(actor.betas),
                         weight_decay=actor.weight_decay)
        sched._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what get_last_lr() reports


class FSDPOffload:
    """Sharded parameters and AdamW state to the CPU between phases and back (GPU runs)."""

    def offload(self) -> None:
        """Between phases: sharded parameters (and gradients) to CPU when ``param_offload``,
        optimizer state to CPU when ``optimizer_offload`` (on CPU runs everything lives in host memory
        already: see the end). Idempotent.

        torch's allocator returns its cached blocks to the driver only when something moved: after
        every phase that would cost a small model's step a visible share of its time plus the next
        phase's fresh allocations, and within the process the allocator frees its cache itself before it fails an allocation.
        A rollout that allocates outside it (vLLM waking up) empties the cache itself. On CPU runs the
        gradients go (every update starts from none; between phases nothing reads them) and the free
        pages of malloc's heaps go back to the system (:func:`~spmd_rl.engine.host_memory.trim`)."""
        if not self.on_gpu:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            host_memory.trim()
            return
        moved = False
        if self.param_offload and self._params_on_device:
            self.model.to("cpu")  # FSDP2 re-points its shards; Parameter objects (optimizer refs) survive
            self._params_on_device, moved = False, True
        if self.optimizer_offload and self.optimizer is not None and self._optimizer_on_device:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
            self._optimizer_on_device, moved = False, True
        if moved:
            torch.cuda.empty_cache()

    def onload(self, *, optimizer: bool = False) -> None:
        """Parameters back on the device for compute; optimizer state too when ``optimizer``
        (only the update needs it). Idempotent; a no-op on CPU runs."""
        if not self.on_gpu:
            return
        if not self._params_on_device:
            self.model.to(self.device)
            self._params_on_device = True
        if optimizer and self.optimizer is not None and not self._optimizer_on_device:
            _move_optimizer_state(self.optimizer, self.device)
            self._optimizer_on_device = True


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    # blocking both ways: a non-blocking copy into pageable host memory may be read before it lands
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":  # AdamW keeps `step` on CPU
                state[key] = value.to(device)


class FSDPWeights:
    """The weights out: full HF-named tensors for the rollout and a LoRA run's base model."""

    @torch.no_grad()
    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time (a collective per tensor: iterate on every rank).

        Peak extra memory is one full tensor, so the rollout engine can load weights without a
        second full model copy on the device. Shards are cast to ``dtype`` BEFORE the gather
        (half the traffic and the temporary for fp32 -> bf16); on a one-rank mesh the shard is
        the whole tensor and no collective runs.
        """
        self.onload()
        if self.peft is not None:  # W + scale * B @ A under the HF names
            yield from lora_utils.merged_named_tensors(self.model, dtype)
            self.offload()
            return
        for name, param in self.model.named_parameters():
            tensor = param.detach()
            if dtype is not None:
                tensor = tensor.to(dtype)  # a DTensor stays a DTensor: each rank casts its shard
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()
            yield name, tensor
        self.offload()

    @contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The frozen base model inside the block (adapters off, :func:`~spmd_rl.engine.lora.adapters_off`):
        a LoRA run's reference."""
        if self.peft is None:
            raise ValueError("adapters_off() needs a LoRA engine (actor.lora.rank > 0)")
        with lora_utils.adapters_off(self.model):
            yield
