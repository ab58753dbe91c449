"""FSDP2 engine: a Hugging Face causal LM sharded with ``fully_shard`` on the actor's mesh.

On a mesh of one rank (one GPU, no Ulysses) the model is not wrapped: it stays the plain module,
whose fp32 weights are cast to bf16 compute copies once per pass (:mod:`spmd_rl.engine.mixed`,
FSDP2's mixed precision without its per-layer hooks and DTensors; ``actor.fsdp.wrap_one_rank``
wraps it anyway). Everything below holds on both; what is FSDP's alone says so.

    engine = FSDPEngine(model_folder=..., mesh=plan.fsdp.build(...), device=env.device,
                        actor=cfg.actor, total_updates=..., trainable=True)
    logprobs, entropy = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)
    micro_batches = engine.micro_batches(mini_batch, micro_batch_size=8)   # fixed or token budget
    metrics = engine.train_mini_batch(micro_batches, loss_fn, temperature=1.0)
    for name, tensor in engine.named_full_tensors():   # hot-swap into the rollout engine
        ...
    state = engine.state_dict()                         # sharded, for torch.distributed.checkpoint
    engine.load_state_dict(state)

Every decoder layer is its own FSDP unit and the root holds embeddings, final norm and head
(:mod:`spmd_rl.engine.sharding`, which the reward model shares). The
mesh is ``[fsdp]`` (ZeRO-3 over the pool) or ``[ddp, fsdp]`` (HSDP). Gradients are SUMMED across
ranks (divide factor 1): the trainer divides each micro-batch loss by the global token (or
sequence) count of the data-parallel mini-batch, so the sum is the exact global mean and FSDP must
not average a second time. On GPU parameters are kept in fp32 and computed in bf16 with fp32
gradient reduction; on CPU everything is fp32.

Ulysses sequence parallelism (``sp_group``), packed sequences (``use_packing``) and token-budget
micro-batches (``max_tokens_per_gpu``) live in :mod:`spmd_rl.engine.ulysses` and
:mod:`spmd_rl.engine.packing`. Whatever the layout, the model runs our attention function over the
causal runs of each row, padding being a run of its own (torch's flash varlen kernel on GPU, a
block-diagonal SDPA mask on CPU): no query row is ever fully masked. Every forward returns
``[B, T]`` response log-probs whatever the layout, so loss functions never see it. The LM head is a :class:`~spmd_rl.engine.head.LogprobHead`: it
scores only response positions, a chunk of positions at a time. On GPU AdamW is the fused kernel.

Around one call: all its micro-batches are staged on the device before the first forward
(:mod:`spmd_rl.engine.inputs`). On a one-rank FSDP mesh gradients are reduced after the last
micro-batch only, on more ranks after each (:meth:`FSDPEngine._gradient_sync`). Where a shard spans
one rank (``actor.fsdp.gather_once``, default on) the parameters are gathered once per pass over the
micro-batches instead of a cast and copy per layer and micro-batch (:meth:`FSDPEngine._one_pass`).
``actor.fsdp.compile_layers`` compiles each decoder layer in place. A non-finite gradient norm skips
the optimizer step (:class:`~spmd_rl.engine.base.NonfiniteGuard`, at most
``actor.skip_nonfinite_updates`` in a row) after replaying the mini-batch under
:class:`~spmd_rl.engine.nanwatch.NonfiniteWatch`, whose report names where the NaN was made.
``named_full_tensors`` casts shards before the gather (no collective on a one-rank mesh).
``offload`` / ``onload`` move the sharded parameters (``actor.fsdp.param_offload``,
``ref.param_offload``) and the AdamW state (``actor.fsdp.optimizer_offload``) to the CPU between
phases and back; both are idempotent and no-ops on CPU runs. The same class is the actor, the
frozen reference (``trainable=False``) and the critic (``value_model=True``: values in place of
log-probs, :mod:`spmd_rl.engine.value`).

Mixture-of-experts models (a config with ``output_router_logits``: Qwen3-MoE, Qwen2-MoE, Mixtral) train
their expert MLPs through Hugging Face's forward (its grouped-GEMM experts where transformers picks
them); in training forwards the model also returns its router load-balancing loss (HF's
``aux_loss``, over every token of the micro-batch's grid, padding included), reported as
``moe_aux_loss`` and added to the loss times ``moe_aux_coef`` (``algo.moe_aux_coef``, default 0 = report
only), averaged over the micro-batches and ranks of the update.

With ``actor.router_replay`` the actor's routers take the experts the rollout recorded for each generated
token (:mod:`spmd_rl.engine.routing`): :meth:`_stage` lays them out as the forward's grid and
:meth:`_forward` sets them, until the next forward (the backward may recompute this one).

With ``lora`` (``actor.lora``, :mod:`spmd_rl.engine.lora`) only PEFT's adapters train and sit in the
optimizer; the frozen base is sharded like any weight (bf16 on GPU) and is the reference
(:meth:`FSDPEngine.adapters_off`); ``named_full_tensors`` yields merged weights under HF names; the
checkpoint state holds the adapters and their optimizer state only.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from spmd_rl.config import ActorConfig, FsdpConfig, LoraConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.engine import attention, host_memory, norms, packing, ulysses
from spmd_rl.engine import lora as lora_utils
from spmd_rl.engine.base import LossFn, NonfiniteGuard, lr_lambda
from spmd_rl.engine.head import HeadRequest, LogprobHead, default_chunk_tokens, fused_available, keep_logits_bytes
from spmd_rl.engine.inputs import Staged, stage
from spmd_rl.engine.fsdp_state import FSDPCheckpointing, FSDPOffload, FSDPWeights
from spmd_rl.engine.nanwatch import NonfiniteWatch
from spmd_rl.engine.routing import RouterReplay
from spmd_rl.engine.sharding import decoder_layers, shard_model
from spmd_rl.engine.value import ValueHead, load_value_model
from spmd_rl.models import load_causal_lm

log = logging.getLogger("spmd_rl")

class FSDPEngine(FSDPCheckpointing, FSDPOffload, FSDPWeights):
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
        group: dist.ProcessGroup | None = None,
        sp_group: dist.ProcessGroup | None = None,
        use_packing: bool = False,
        max_tokens_per_gpu: int | None = None,
        param_offload: bool | None = None,
        logits_chunk_tokens: int | None = None,
        value_model: bool = False,
        seed: int = 0,
        moe_aux_coef: float = 0.0,
        lora: LoraConfig | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """``group``: every rank running this engine in lockstep (the pool; None = the world);
        dynamic micro-batch counts are agreed over it. ``sp_group``: this rank's Ulysses group
        (None or size 1 = off). ``param_offload`` overrides ``fsdp.param_offload`` (the reference
        engine follows ``ref.param_offload``). ``logits_chunk_tokens``: positions per chunk of the
        log-prob head (None = 1 GiB of fp32 logits per chunk, see :mod:`spmd_rl.engine.head`).
        ``value_model``: the critic, a one-output token classifier whose values take the place of
        log-probs everywhere (:mod:`spmd_rl.engine.value`; a new head is initialised from ``seed``).
        ``moe_aux_coef``: weight of an MoE model's router load-balancing loss (module docstring).
        ``lora``: train adapters of this rank instead of the weights (None or rank 0 = full fine-tuning).
        ``compute_dtype``: the dtype forwards and backwards compute in (None = bf16 on GPU, fp32 on CPU;
        the weights, gradients and optimizer state stay fp32)."""
        if trainable and actor is None:
            raise ValueError("a trainable FSDPEngine needs the actor config section")
        self.device = device
        self.mesh = mesh
        self.trainable = trainable
        self.pad_token_id = pad_token_id
        self.param_offload = fsdp.param_offload if param_offload is None else param_offload
        self.optimizer_offload = fsdp.optimizer_offload
        self.on_gpu = device.type == "cuda"
        self.compute_dtype = compute_dtype or (torch.bfloat16 if self.on_gpu else torch.float32)
        self._params_on_device = self._optimizer_on_device = True
        self.group = group
        if not self.on_gpu:  # before the model loads: freed host memory goes back (engine/host_memory.py)
            host_memory.tune_malloc()
        self._set_sequence_layout(sp_group, use_packing=use_packing, max_tokens_per_gpu=max_tokens_per_gpu)
        # the actor's forwards route generated tokens to the rollout's experts (actor.router_replay)
        self._replay_routes = bool(actor is not None and actor.router_replay and trainable and not value_model)
        model = self._prepare_model(model_folder, fsdp=fsdp, value_model=value_model, seed=seed,
                                    trust_remote_code=trust_remote_code, logits_chunk_tokens=logits_chunk_tokens,
                                    moe_aux_coef=moe_aux_coef, gradient_checkpointing=gradient_checkpointing,
                                    lora=lora)
        self._shard(model, fsdp)
        self._build_optimizer(actor, total_updates=total_updates, role="critic" if value_model else "actor")
        self.offload()

    def _set_sequence_layout(self, sp_group: dist.ProcessGroup | None, *, use_packing: bool,
                             max_tokens_per_gpu: int | None) -> None:
        """How a micro-batch's rows are laid out: the Ulysses group, packing, the token budget, and
        the attention kernel over the causal runs of each row."""
        self.sp_size = dist.get_world_size(sp_group) if sp_group is not None else 1
        self.sp_group = sp_group if self.sp_size > 1 else None
        self.sp_rank = dist.get_rank(sp_group) if self.sp_group is not None else 0
        self.use_packing = use_packing
        self.max_tokens_per_gpu = max_tokens_per_gpu
        # Attention is always our own function over the causal runs of each row (padding is a run of its
        # own): torch's flash varlen kernel on GPU, SDPA with the block-causal mask on CPU. Stock SDPA with
        # a padding mask can pick cuDNN attention on a GPU, whose backward can make NaN gradients
        # (docs/RESULTS.md); its left padding also makes fully masked query rows.
        self.flash_varlen = self.on_gpu and ulysses.flash_varlen_available()
        ulysses.register_attention()

    def _prepare_model(self, model_folder: str, *, fsdp: FsdpConfig, value_model: bool, seed: int,
                       trust_remote_code: bool, logits_chunk_tokens: int | None, moe_aux_coef: float,
                       gradient_checkpointing: bool, lora: LoraConfig | None) -> torch.nn.Module:
        """The model in fp32 on the host with this engine's pieces installed (attention, norms, the
        log-prob or value head, gradient checkpointing, LoRA adapters), frozen unless trainable."""
        if value_model:
            model = load_value_model(model_folder, dtype=torch.float32, seed=seed, trust_remote_code=trust_remote_code,
                                     attn_implementation=ulysses.ATTENTION_NAME)
        else:
            model = load_causal_lm(model_folder, dtype=torch.float32, trust_remote_code=trust_remote_code,
                                   attn_implementation=ulysses.ATTENTION_NAME)
        if self.sp_group is not None:
            ulysses.check_heads(model.config, self.sp_size)
        model.config.use_cache = False
        # RoPE on the projections' own layout, no transposed copies (engine/attention.py); others keep HF's
        self.natural_attention = attention.install(model)
        norms.install_norms(model)  # one fused kernel per RMSNorm (engine/norms.py); Gemma keeps HF's
        ulysses.annotate_windows(model)  # before compile: no guard on layer_idx (one graph for all layers)
        # MoE: the router's load-balancing loss (HF's aux_loss) in training forwards
        self.router_aux = getattr(model.config, "output_router_logits", None) is not None
        self.moe_aux_coef = moe_aux_coef
        self.replay = RouterReplay(model) if self._replay_routes else None  # engine/routing.py
        if not self.natural_attention:
            log.info("FSDPEngine: %s keeps Hugging Face's attention forward (model_type %r is not one of %s)",
                     type(model).__name__, getattr(model.config, "model_type", None), attention.SUPPORTED_MODEL_TYPES)
        # log-probs at the requested positions, chunked over the vocab; or the critic's values there
        self._head = ValueHead.replace(model) if value_model else LogprobHead.replace(model)
        self.logits_chunk_tokens = logits_chunk_tokens or default_chunk_tokens(int(model.config.vocab_size))
        self.fused_head = fused_available(self.device)  # compiled vocabulary kernels on CUDA (engine/head.py)
        self.keep_logits_bytes = keep_logits_bytes(fsdp.keep_logits_gib, self.device)
        if gradient_checkpointing and self.trainable:
            # newer transformers call it activation_checkpointing_enable and warn on the old name
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.trainable:
            model.requires_grad_(False)
        self.lora = lora if lora is not None and lora.enabled and self.trainable else None
        self.peft = lora_utils.apply_lora(model, self.lora) if self.lora is not None else None
        if self.peft is not None and self.compute_dtype != torch.float32:
            for p in model.parameters():  # the frozen base computes in bf16 anyway: store it so
                if not p.requires_grad:
                    p.data = p.data.to(self.compute_dtype)
        return model

    def _shard(self, model: torch.nn.Module, fsdp: FsdpConfig) -> None:
        """``model`` under FSDP2 over the mesh, or the plain module with compute copies on one rank
        (:func:`~spmd_rl.engine.sharding.shard_model`, as the reward model), moved to the device."""
        self.reduce_every_micro_batch = self.mesh.size() > 1  # see _gradient_sync
        # one rank: the plain module with compute copies of its weights (engine/mixed.py), not FSDP
        self.sharded = fsdp.wrap_one_rank or self.mesh.size() > 1 or self.sp_group is not None
        # a shard dimension of one rank: FSDP's per-layer gather is a copy (see _one_pass)
        self.gather_once = (self.sharded and fsdp.gather_once and self.mesh.shape[-1] == 1
                            and hasattr(FSDPModule, "set_reshard_after_forward"))
        self._reshard_after_forward = fsdp.reshard_after_forward
        self.copies = shard_model(model, mesh=self.mesh, compute_dtype=self.compute_dtype, sharded=self.sharded,
                                  reshard_after_forward=fsdp.reshard_after_forward,
                                  compile_layers=fsdp.compile_layers)
        model.to(self.device)
        model.train(self.trainable)
        self.model = model
        self.config = model.config

    def _build_optimizer(self, actor: ActorConfig | None, *, total_updates: int, role: str) -> None:
        """AdamW over the trainable parameters and its LR schedule (none for a frozen engine), the
        gradient clip and the non-finite-update guard."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.grad_clip = 0.0
        self.nonfinite = NonfiniteGuard(actor.skip_nonfinite_updates if actor is not None else 0, role=role)
        self.actor = actor  # this run's optimizer settings, which replace a checkpoint's (load_state_dict)
        if not self.trainable:
            return
        assert actor is not None
        self.grad_clip = actor.grad_clip
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=actor.lr, betas=tuple(actor.betas), weight_decay=actor.weight_decay,
            # fused on GPU (one kernel over all DTensor shards); the plain loop on CPU, where
            # the fused/foreach paths lack kernels for DTensor shards
            fused=self.on_gpu, foreach=False,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, warmup=actor.warmup_steps, total=total_updates,
                                schedule=actor.lr_schedule, min_ratio=actor.min_lr_ratio),
        )

    # ------------------------------------------------------------------ forward
    def _stage(self, micro: RolloutBatch, rows: list[int] | None = None) -> Staged:
        """The micro-batch's forward inputs on the device (:mod:`spmd_rl.engine.inputs`); callers stage
        all their micro-batches before the first forward, so no host-to-device copy waits for the GPU."""
        if self.replay is not None and "routed_experts" in micro:
            self.replay.check(micro["routed_experts"])
        return stage(micro, device=self.device, pad_token_id=self.pad_token_id, packed=self.use_packing,
                     flash=self.flash_varlen, sp_size=self.sp_size, sp_rank=self.sp_rank, sp_group=self.sp_group,
                     rows=rows, routes=self.replay is not None)

    def _forward(self, staged: Staged, temperature: float, entropy: str,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs ``[B, T]`` (0 where the response mask is 0); ``entropy`` is "none",
        "detached" (for metrics) or "grad" (for a bonus); an MoE model's router load-balancing loss in
        forwards that record gradients (else None).

        Under Ulysses the log-probs of each rank's slice are all-gathered over the sp group (gradient:
        own slice only). The head runs only on positions that predict a valid response token,
        chunked over them so the full-vocabulary logits never exist for the whole micro-batch
        (:class:`LogprobHead`).
        """
        sel = staged.sel
        self._head.request = HeadRequest(positions=sel, labels=staged.labels, entropy=entropy,  # type: ignore[arg-type]
                                         temperature=temperature if temperature > 0 else 1.0,
                                         chunk_tokens=self.logits_chunk_tokens, fused=self.fused_head,
                                         keep_bytes=self.keep_logits_bytes)
        aux = {"output_router_logits": True} if self.router_aux and torch.is_grad_enabled() else {}
        if self.replay is not None:  # kept set until the next forward: the backward may recompute this one
            self.replay.set(None if staged.routes is None else staged.routes.flatten(0, 1))
        try:
            out = self.model(
                input_ids=staged.input_ids,
                attention_mask=None,  # our attention takes its layout from spmd_attn
                position_ids=staged.position_ids,
                use_cache=False,
                spmd_attn=staged.attn,
                **aux,
            )
        finally:
            self._head.request = None
        scored = out.logits[0]  # [N, 2]: (log-prob, entropy) per selected position
        mask = staged.micro["response_mask"]

        def to_responses(values: torch.Tensor) -> torch.Tensor:  # [N] -> [B, T]
            local = values.new_zeros(staged.grid_rows, staged.width).index_put(sel, values)
            full = ulysses.gather_sequence(local, self.sp_group, dim=1)
            return full[staged.rows, staged.cols] * mask

        logprobs = to_responses(scored[:, 0])
        return (logprobs, (None if entropy == "none" else to_responses(scored[:, 1])),
                getattr(out, "aux_loss", None) if aux else None)

    def micro_batches(self, batch: RolloutBatch, *, micro_batch_size: int) -> list[RolloutBatch]:
        """Split ``batch`` into micro-batches: ``micro_batch_size`` rows each, or, with
        ``max_tokens_per_gpu``, token-budget groups (budget x sp degree per sp group). Every rank
        of ``group`` gets the same count (collective when dynamic)."""
        return [batch.select(rows) for rows in self._micro_rows(batch, micro_batch_size)]

    def _micro_rows(self, batch: RolloutBatch, micro_batch_size: int) -> list[list[int]]:
        budget = None if self.max_tokens_per_gpu is None else self.max_tokens_per_gpu * self.sp_size
        return packing.micro_batch_rows(packing.row_tokens(batch), micro_batch_size=micro_batch_size,
                                        max_tokens=budget, group=self.group)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B, T]`` (and entropy) of the batch's responses, in micro-batches, in row order.

        Every rank of the mesh must call this (FSDP all-gathers parameters per layer); the
        micro-batch count is the same on every rank (see :meth:`micro_batches`).
        """
        self.onload()
        was_training = self.model.training
        if was_training:  # a walk over every module: not for the reference, which never trains
            self.model.eval()
        logprobs = torch.zeros(len(batch), batch.response_len, device=self.device)
        entropies = torch.zeros_like(logprobs) if with_entropy else None
        staged = [self._stage(batch.select(rows), rows) for rows in self._micro_rows(batch, micro_batch_size)]
        with self._one_pass():
            for micro in staged:
                lp, ent, _ = self._forward(micro, temperature, "detached" if with_entropy else "none")
                logprobs[micro.index] = lp
                if entropies is not None and ent is not None:
                    entropies[micro.index] = ent
        if was_training:
            self.model.train()
        self.offload()
        return logprobs, entropies

    # ------------------------------------------------------------------ update
    def train_mini_batch(self, micro_batches: list[RolloutBatch], loss_fn: LossFn, *, temperature: float,
                         need_entropy_grad: bool) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; returns grad_norm and lr (and ``moe_aux_loss``, this
        rank's mean over its micro-batches, for an MoE model).

        ``loss_fn`` returns a loss already divided by the GLOBAL normaliser, so losses of all
        micro-batches on all ranks add up to the mini-batch objective. It gets each micro-batch with
        its tensors on the device; a ``.item()`` in it waits for the device (metrics are best kept
        as tensors until the step ends).
        """
        assert self.optimizer is not None and self.scheduler is not None, "reference engine cannot train"
        self.onload(optimizer=True)  # the caller calls offload() after its last mini-batch
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        bad_losses = torch.zeros((), dtype=torch.long, device=self.device)  # summed without a sync per micro-batch
        staged = [self._stage(micro) for micro in micro_batches]
        aux_sum = torch.zeros((), device=self.device)
        with self._one_pass():  # ends before the optimizer step: the next forward gathers the new weights
            for i, micro in enumerate(staged):
                self._gradient_sync(last=i == len(staged) - 1)
                logprobs, entropy, aux = self._forward(micro, temperature, "grad" if need_entropy_grad else "detached")
                loss, _ = loss_fn(logprobs, entropy, micro.micro)
                loss = loss + self._aux_term(aux, len(staged), aux_sum)
                bad_losses += ~torch.isfinite(loss.detach())
                loss.backward()
                if self.copies is not None:
                    self.copies.grads_to_weights()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = self._clip_grad_norm(params)
        lr = self.optimizer.param_groups[0]["lr"]
        # grad_norm is reduced over the whole mesh, so every rank takes the same branch
        def cause() -> str:
            return (self._nonfinite_cause(int(bad_losses), len(micro_batches)) + "; "
                    + self._replay_nonfinite(micro_batches, loss_fn, temperature, need_entropy_grad))

        stats = {"grad_norm": grad_norm, "lr": lr}
        if self.router_aux:
            stats["moe_aux_loss"] = float(aux_sum) / max(len(staged), 1)
        if self.nonfinite.skip(grad_norm, cause):
            self.optimizer.zero_grad(set_to_none=True)
            return {**stats, "skipped": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        return {**stats, "skipped": 0.0}

    def _aux_term(self, aux: torch.Tensor | None, micro_batches: int, total: torch.Tensor | None = None,
                  ) -> torch.Tensor | float:
        """The router loss's share of one micro-batch's loss: ``moe_aux_coef * aux`` over the micro-batches
        and the ranks whose gradients FSDP sums, so the update gets the mean's gradient; adds ``aux`` to
        ``total`` (for the metric)."""
        if aux is None:
            return 0.0
        if total is not None:
            total += aux.detach()
        return self.moe_aux_coef * aux / (micro_batches * self.mesh.size()) if self.moe_aux_coef else 0.0

    def _gradient_sync(self, *, last: bool) -> None:
        """On a one-rank mesh, reduce gradients only after the last micro-batch: FSDP2 then sums the
        micro-batches' gradients unsharded in its reduce dtype (fp32 on GPU) and runs its reduce path
        (cast and copy into a flat buffer, copy out, accumulate into the shards) once per step instead
        of once per micro-batch. With more ranks, every micro-batch's reduce-scatter overlaps the next
        one's compute and keeps the gradients sharded, so it stays."""
        if self.sharded and not self.reduce_every_micro_batch:
            self.model.set_requires_gradient_sync(last)

    @contextmanager
    def _one_pass(self) -> Iterator[None]:
        """One pass over micro-batches. On one rank (not :attr:`sharded`) the modules hold compute copies
        of the weights for the pass (:class:`~spmd_rl.engine.mixed.ComputeCopies`); with
        :attr:`gather_once`, the parameters are gathered once.

        Where a shard spans one rank, FSDP2's all-gather is a cast and a copy per parameter (about
        3,400 small kernels per 1.5B step of three micro-batches, forward and backward) that frees
        nothing. So the layers and the root (embeddings, final norm, head) keep their gathered bf16
        parameters after forward and after backward until the pass ends, when every module
        reshards: the optimizer step then updates the fp32 shards and the next pass gathers the new
        values. Gradient reduction is unchanged (:meth:`_gradient_sync`). The NaN replay runs after
        the pass, with FSDP's per-layer gathers (on one rank, with compute copies of its own)."""
        if self.copies is not None:
            with self.copies.swapped():
                yield
            return
        if not self.gather_once:
            yield
            return
        # the layers and the root (embeddings, final norm, head), each without recursing
        units = [m for m in decoder_layers(self.model) if isinstance(m, FSDPModule)] + [self.model]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        self.model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_reshard_after_forward(self._reshard_after_forward, recurse=False)
            self.model.set_reshard_after_backward(True)
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _nonfinite_cause(self, bad_losses: int, micro_batches: int) -> str:
        """Where the NaN/inf came from, as far as this rank can tell: its losses, then the first
        parameters whose local gradient shard is not finite."""
        names = []
        for name, p in self.model.named_parameters():
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                names.append(name)
        where = f"non-finite gradients in {len(names)} parameter shard(s) on this rank"
        where += f", first: {', '.join(names[:4])}" if names else " (the non-finite part is on other ranks)"
        return f"{bad_losses} of {micro_batches} micro-batch losses non-finite on this rank; {where}"

    def _replay_nonfinite(self, micro_batches: list[RolloutBatch], loss_fn: LossFn, temperature: float,
                          need_entropy_grad: bool) -> str:
        """Run the mini-batch again under a :class:`NonfiniteWatch` and say where its first NaN/inf
        was made (module in the forward, autograd node in the backward). Every rank replays all its
        micro-batches, so FSDP's collectives stay matched; the gradients are thrown away."""
        self.optimizer.zero_grad(set_to_none=True)
        found = []
        with self.copies.swapped() if self.copies is not None else nullcontext():
            for i, micro in enumerate(micro_batches):
                self._gradient_sync(last=i == len(micro_batches) - 1)
                with NonfiniteWatch(self.model) as watch:
                    staged = self._stage(micro)
                    logprobs, entropy, aux = self._forward(staged, temperature, "grad" if need_entropy_grad else "detached")
                    loss, _ = loss_fn(logprobs, entropy, staged.micro)
                    loss = loss + self._aux_term(aux, len(micro_batches))
                    watch.track(loss)
                    loss.backward()
                if watch.found:
                    found.append(f"micro-batch {i + 1} of {len(micro_batches)} ({len(micro)} responses): {watch.report()}")
        if not found:
            return "a replay of this rank's micro-batches made no NaN/inf (not reproducible here, or on other ranks)"
        return "replayed: " + found[0] + (f" (and {len(found) - 1} more micro-batch(es))" if len(found) > 1 else "")

    def _clip_grad_norm(self, params: list[torch.nn.Parameter]) -> float:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=self.on_gpu)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm, foreach=self.on_gpu)
        return float(norm)
