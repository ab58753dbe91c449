"""FSDP2 engine: a Hugging Face causal LM sharded with ``fully_shard`` on the actor's mesh.

    engine = FSDPEngine(model_folder=..., mesh=plan.fsdp.build(...), device=env.device,
                        actor=cfg.actor, total_updates=..., trainable=True)
    logprobs, entropy = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)
    metrics = engine.train_mini_batch(micro_batches, loss_fn, temperature=1.0)
    for name, tensor in engine.named_full_tensors():   # hot-swap into the rollout engine
        ...

Every decoder layer is its own FSDP unit and the root holds embeddings, final norm and head. The
mesh is ``[fsdp]`` (ZeRO-3 over the pool) or ``[ddp, fsdp]`` (HSDP). Gradients are SUMMED across
ranks (divide factor 1): the trainer divides each micro-batch loss by the global token (or
sequence) count of the data-parallel mini-batch, so the sum is the exact global mean and FSDP must
not average a second time. On GPU parameters are kept in fp32 and computed in bf16 with fp32
gradient reduction; on CPU everything is fp32.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from spmd_rl.algo.losses import entropy_from_logits, logprobs_from_logits
from spmd_rl.config import ActorConfig, FsdpConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.models import load_causal_lm

LossFn = Callable[[torch.Tensor, torch.Tensor | None, RolloutBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(logprobs[B,T], entropy[B,T] | None, micro_batch) -> (loss, metrics)``."""


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; the FSDP engine supports decoder-only "
            "Hugging Face models of the Llama / Qwen / Mistral shape"
        )
    return list(layers)


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warmup, then constant or cosine."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class FSDPEngine:
    """Actor (trainable) or reference (frozen) model under FSDP2."""

    def __init__(
        self,
        *,
        model_folder: str,
        mesh: DeviceMesh,
        device: torch.device,
        fsdp: FsdpConfig,
        actor: ActorConfig | None = None,
        total_updates: int = 1,
        trainable: bool = True,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        pad_token_id: int = 0,
    ) -> None:
        if trainable and actor is None:
            raise ValueError("a trainable FSDPEngine needs the actor config section")
        self.device = device
        self.mesh = mesh
        self.trainable = trainable
        self.pad_token_id = pad_token_id
        self.param_offload = fsdp.param_offload
        self.optimizer_offload = fsdp.optimizer_offload
        self.on_gpu = device.type == "cuda"

        model = load_causal_lm(model_folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
        model.config.use_cache = False
        if gradient_checkpointing and trainable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not trainable:
            model.requires_grad_(False)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.on_gpu else MixedPrecisionPolicy()
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        model.to(device)
        model.train(trainable)
        self.model = model
        self.config = model.config

        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.grad_clip = 0.0
        if trainable:
            assert actor is not None
            self.grad_clip = actor.grad_clip
            self.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=actor.lr, betas=tuple(actor.betas), weight_decay=actor.weight_decay,
                # The fused/foreach paths need a device kernel for DTensor shards on every backend;
                # the plain loop is the one that runs everywhere.
                foreach=self.on_gpu,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer,
                lambda s: lr_lambda(s, warmup=actor.warmup_steps, total=total_updates,
                                    schedule=actor.lr_schedule, min_ratio=actor.min_lr_ratio),
            )
        if self.param_offload:
            self.offload()

    # ------------------------------------------------------------------ forward
    def _forward(self, micro: RolloutBatch, temperature: float, entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs; ``entropy`` is "none", "detached" (for metrics) or "grad" (for a bonus)."""
        inputs = micro.model_inputs(self.pad_token_id, self.device)
        t = inputs.response_len
        out = self.model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
            logits_to_keep=t + 1,
        )
        logits = out.logits[:, :-1, :].float()
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        response_ids = micro["response_ids"].to(self.device)
        logprobs = logprobs_from_logits(logits, response_ids)
        if entropy == "grad":
            return logprobs, entropy_from_logits(logits)
        if entropy == "detached":
            with torch.no_grad():
                return logprobs, entropy_from_logits(logits.detach())
        return logprobs, None

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B, T]`` (and entropy) of the batch's responses, in micro-batches.

        Every rank of the mesh must call this with the same number of micro-batches (FSDP
        all-gathers parameters per layer), which the trainer's equal row counts guarantee.
        """
        self.onload()
        was_training = self.model.training
        self.model.eval()
        logprobs, entropies = [], []
        for micro in batch.split(micro_batch_size):
            lp, ent = self._forward(micro, temperature, "detached" if with_entropy else "none")
            mask = micro["response_mask"].to(lp.device)
            logprobs.append(lp * mask)
            if ent is not None:
                entropies.append(ent * mask)
        self.model.train(was_training)
        if self.param_offload:
            self.offload()
        lp_all = torch.cat(logprobs) if logprobs else torch.zeros(0, batch.response_len)
        return lp_all, (torch.cat(entropies) if entropies else None)

    # ------------------------------------------------------------------ update
    def train_mini_batch(self, micro_batches: list[RolloutBatch], loss_fn: LossFn, *, temperature: float,
                         need_entropy_grad: bool) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; returns grad_norm and lr.

        ``loss_fn`` returns a loss already divided by the GLOBAL normaliser, so losses of all
        micro-batches on all ranks add up to the mini-batch objective.
        """
        assert self.optimizer is not None and self.scheduler is not None, "reference engine cannot train"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for micro in micro_batches:
            logprobs, entropy = self._forward(micro, temperature, "grad" if need_entropy_grad else "detached")
            loss, _ = loss_fn(logprobs, entropy, micro)
            loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self._clip_grad_norm(params)
        if not math.isfinite(grad_norm):
            # grad_norm is reduced over the whole mesh, so every rank takes this branch together.
            raise FloatingPointError(
                f"non-finite gradient norm ({grad_norm}) in the actor update: the loss or the "
                "model produced NaN/inf. Lower --actor.lr, check the reward values, or resume from "
                "the last checkpoint; the optimizer step was skipped and no weights changed"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def _clip_grad_norm(self, params: list[torch.nn.Parameter]) -> float:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=self.on_gpu)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm, foreach=self.on_gpu)
        return float(norm)

    # ------------------------------------------------------------------ weights out
    @torch.no_grad()
    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time (a collective per tensor: iterate on every rank).

        Peak extra memory is one full tensor, so the rollout engine can load weights without a
        second full model copy on the device.
        """
        self.onload()
        for name, param in self.model.named_parameters():
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, (tensor.to(dtype) if dtype is not None else tensor)
        if self.param_offload:
            self.offload()

    # ------------------------------------------------------------------ memory between phases
    def offload(self) -> None:
        """Move sharded parameters (and optimizer state) to CPU; a no-op on CPU runs."""
        if not self.on_gpu:
            return
        self.model.to("cpu")
        if self.optimizer is not None and self.optimizer_offload:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if not self.on_gpu:
            return
        self.model.to(self.device)
        if self.optimizer is not None:
            _move_optimizer_state(self.optimizer, self.device)

    def barrier(self) -> None:
        dist.barrier(group=self.mesh.get_group(self.mesh.mesh_dim_names[-1]) if self.mesh.ndim > 1 else self.mesh.get_group())


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
