"""Megatron engine: the actor (or frozen reference) as a megatron-core GPT model with tensor,
pipeline (+ virtual), and expert parallelism, behind the same interface as ``FSDPEngine``.

    engine = MegatronEngine(model_folder=..., device=env.device, layout=plan.megatron,
                            megatron=cfg.actor.megatron, actor=cfg.actor, total_updates=..., seed=...)
    logprobs, entropy = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)
    metrics = engine.train_mini_batch(engine.micro_batches(mini, micro_batch_size=8), loss_fn, ...)
    for name, tensor in engine.named_full_tensors(): ...   # full HF tensors on every rank

Data: every rank of a data-parallel group (its tp x pp ranks) holds the same rows. A micro-batch
becomes a ``[B, W]`` grid with each row ``prompt + response`` starting at column 0 and padded on the
right, so causal attention needs no mask and positions are ``0..W-1``; all micro-batches of one call
share ``B`` and ``W`` (megatron's pipeline schedules send fixed-shape activations), padded with empty
rows when the last is short and ``W`` rounded up to a multiple of tp (sequence parallelism). With
context parallelism (cp > 1) ``W`` is a multiple of 2 * cp (and of cp * tp) and each cp rank gets
its two balanced chunks of every row (:mod:`.context`); each computes the log-probs of the response
positions it holds, and their sum over cp gives every cp rank the whole ``[B, T]`` in sequence order,
so the loss and ``compute_logprobs`` are as without cp. The engine never packs rows.

MoE router replay (``actor.router_replay``, the actor only): :meth:`MegatronEngine._grids` lays each
micro-batch's ``routed_experts`` out in the token order every router of this rank sees (the cp rank's
chunks, ``[S, B]``, the tp rank's slice under sequence parallelism) and the forward step hands them
to the routers of the chunk it runs, which take the recorded experts for generated tokens with gate
weights from their own logits (:mod:`.replay`, through megatron-core's router replay hook).

Training runs megatron-core's ``get_forward_backward_func`` (1F1B, or interleaved with vpp). The
trainer's ``loss_fn`` runs on the last pipeline stage on vocab-parallel log-probs
(:mod:`.vocab`); its loss is already divided by the GLOBAL token count, so the engine sets
``calculate_per_token_loss`` (no division by micro-batch count), makes megatron's DDP SUM gradients
over data-parallel ranks (scaling factor 1) and ignores the token total the schedule passes to
``finalize_model_grads``. The distributed optimizer (ZeRO-1 over dp) applies AdamW with weight decay
on every parameter and the same LR schedule as the FSDP engine; the gradient norm is checked for
NaN/inf before the step (the step is skipped up to ``actor.skip_nonfinite_updates`` times in a row,
then an error). On CUDA parameters are bf16 (megatron ``Float16Module``) with fp32 main weights in
the optimizer, seeded from the loaded fp32 weights (not from their bf16 rounding, see
``MegatronEngine._main_params_from``); on CPU everything is fp32.

``compute_logprobs`` runs on every rank and broadcasts the last stage's log-probs over the pipeline
group. ``state_dict`` holds every weight, fp32 main weight and AdamW moment under its megatron name
in the whole model with its full shape, as the rectangles this rank owns (:mod:`.reshard`), so DCP
resumes a checkpoint on any other tp / pp / vpp / dp / ep layout; ``export_weights`` gives the full
HF-named weights on global rank 0, which the checkpoint keeps once for ``python -m spmd_rl.export``.
The embedding's padding row gets no gradient (as HF's ``padding_idx``). ``offload`` / ``onload``
move the parameters and gradient buffers (``actor.megatron.param_offload``, ``ref.param_offload``)
and the distributed optimizer's main weights and moments (``actor.megatron.optimizer_offload``) to
host memory between phases and back, exactly (:mod:`.offload`). The groups are built over the
global pool, also next to pools of other roles (:mod:`.groups`). Tests: ``tests/test_megatron_parity.py`` (TP2, TP2+SP, PP2, TP2xPP2, PP2xVPP2, EP2 updates
against one process; log-probs against the FSDP engine; HF round trip), ``test_megatron_e2e.py``
(torchrun run, exact resume, HF export, a reward pool), ``test_megatron_pools.py`` (rollout and teacher
pools: the colocated run's metrics, the rollout's weights bit for bit), ``test_megatron_state.py`` (offload, resume
on other layouts), ``test_megatron_router_replay.py`` (router replay against the FSDP engine's on 1 rank,
tp 2 + sp, pp 2 x vpp 2, ep 2, cp 2) and ``test_megatron_bf16.py`` (the bf16 path emulated on
CPU); ``bench/megatron_gpu_check.py`` compares it with the FSDP engine in bf16 on GPUs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from spmd_rl.config import ActorConfig, MegatronConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.dims import MegatronLayout
from spmd_rl.engine import packing
from spmd_rl.engine.base import LossFn, NonfiniteGuard, lr_lambda
from spmd_rl.engine.megatron.context import chunk_columns, sum_shares
from spmd_rl.engine.megatron.convert import export_hf_weights, load_hf_weights
from spmd_rl.engine.megatron.groups import init_model_parallel
from spmd_rl.engine.megatron.model import ModelSpec, build_chunks, check_layout, transformer_config
from spmd_rl.engine.megatron.offload import HostParking, MegatronOffload
from spmd_rl.engine.megatron.replay import MegatronRouterReplay, grid_routes
from spmd_rl.engine.megatron.reshard import MegatronCheckpointing, param_range
from spmd_rl.engine.megatron.vocab import vocab_parallel_logprobs
from spmd_rl.models import check_sliding_window, load_causal_lm

log = logging.getLogger("spmd_rl")


@dataclass
class _Grid:
    """One micro-batch as the model sees it."""

    micro: RolloutBatch
    tokens: torch.Tensor  # [B, W / cp] long: this cp rank's chunks
    positions: torch.Tensor  # [B, W / cp]: their global positions
    rows: torch.Tensor  # [N] grid row of each response position's predictor (N = B*T without cp)
    cols: torch.Tensor  # [N] its column in this rank's tokens
    labels: torch.Tensor  # [N]
    real: int  # rows 0..real-1 are the micro-batch, the rest padding
    held: torch.Tensor | None = None  # cp > 1: which of the B*T response positions this cp rank holds (N of them)
    routes: torch.Tensor | None = None  # router replay: [tokens, MoE layers, top_k] in this rank's router order


def batch_p2p_comm_for(layout: MegatronLayout) -> bool:
    """megatron's batched p2p sends to the next and receives from the previous stage in one
    ``batch_isend_irecv``; with pp == 2 and vpp those are the same peer and on gloo the two
    messages can pair up wrongly (silently wrong losses seen in testing), so they go one by one."""
    return not (layout.pp == 2 and layout.vpp > 1)


class MegatronEngine(MegatronCheckpointing, MegatronOffload):
    """Actor (trainable) or reference (frozen) model on megatron-core."""

    def __init__(
        self,
        *,
        model_folder: str,
        device: torch.device,
        layout: MegatronLayout,
        megatron: MegatronConfig,
        actor: ActorConfig | None = None,
        total_updates: int = 1,
        trainable: bool = True,
        trust_remote_code: bool = False,
        pad_token_id: int = 0,
        seed: int = 0,
        param_offload: bool | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """``param_offload`` overrides ``megatron.param_offload`` (the reference follows
        ``ref.param_offload``). ``group``: the actor pool's group (None = the world)."""
        if trainable and actor is None:
            raise ValueError("a trainable MegatronEngine needs the actor config section")
        init_model_parallel(layout, seed=seed)
        self.device = device
        self.layout = layout
        self.group = group
        self.trainable = trainable
        self.pad_token_id = pad_token_id
        self.on_gpu = device.type == "cuda"
        chunks = self._load_chunks(model_folder, megatron=megatron, trust_remote_code=trust_remote_code)
        # the actor's forwards route generated tokens to the rollout's experts (actor.router_replay, .replay)
        self.replay = None
        if trainable and actor is not None and actor.router_replay:
            if not self.spec.experts:
                raise ValueError("--actor.router-replay needs a mixture-of-experts model; "
                                 f"{self.spec.family} is dense: drop --actor.router-replay")
            self.replay = MegatronRouterReplay(chunks, layers=self.spec.layers, top_k=self.spec.top_k,
                                               experts=self.spec.experts, config=self.tf_config)
        # the loaded fp32 weights, kept through the bf16 cast (the same tensors: no copy) to seed the
        # optimizer's fp32 main weights (see _main_params_from)
        fp32_weights = {p: p.data for chunk in chunks for p in chunk.parameters()} if self.on_gpu and trainable else {}
        if self.on_gpu:
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(self.tf_config, chunk) for chunk in chunks]
        self._read_parallel_state()

        self.optimizer = None
        self.updates = 0
        self.param_offload = megatron.param_offload if param_offload is None else param_offload
        self.optimizer_offload = megatron.optimizer_offload and trainable
        self._parked_params = HostParking(pin=self.on_gpu)
        self._parked_optimizer = HostParking(pin=self.on_gpu)
        self.nonfinite = NonfiniteGuard(actor.skip_nonfinite_updates if actor is not None else 0)
        self.actor = actor
        self.total_updates = total_updates
        if trainable:
            assert actor is not None
            self.model = self._wrap_ddp(chunks)
            self.optimizer = self._build_optimizer(actor)
            if fp32_weights:
                self._main_params_from(fp32_weights)
            del fp32_weights
        else:
            for chunk in chunks:
                chunk.requires_grad_(False)
            self.model = chunks
        self.offload()

    # ------------------------------------------------------------------ setup
    def _load_chunks(self, model_folder: str, *, megatron: MegatronConfig, trust_remote_code: bool,
                     ) -> list[torch.nn.Module]:
        """This rank's model chunks with the Hugging Face weights loaded, on the device (fp32): the
        model's spec checked against the layout, megatron-core's transformer config, the padding
        row of the embedding kept frozen."""
        hf_model = load_causal_lm(model_folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
        self.config = hf_model.config
        self.spec = ModelSpec.from_hf(self.config)
        check_layout(self.spec, self.layout)
        padding_idx = getattr(hf_model.get_input_embeddings(), "padding_idx", None)
        hf_state = {name: p.detach() for name, p in hf_model.named_parameters()}  # tied: embed only
        self.hf_shapes = {name: t.shape for name, t in hf_state.items()}
        self.tf_config = transformer_config(
            self.spec, self.layout, params_dtype=torch.float32, bf16=self.on_gpu,
            sequence_parallel=megatron.sequence_parallel, batch_p2p_comm=batch_p2p_comm_for(self.layout))
        chunks = build_chunks(self.spec, self.layout, self.tf_config)
        load_hf_weights(chunks, self.spec, hf_state)
        if padding_idx is not None:
            for chunk in chunks:
                if chunk.pre_process:
                    chunk.embedding.register_forward_hook(_PaddingRowFrozen(padding_idx), with_kwargs=True)
        del hf_model, hf_state
        for chunk in chunks:
            chunk.to(self.device)
        return chunks

    def _read_parallel_state(self) -> None:
        """This rank's tp / pp groups and place from megatron-core's parallel state, and the shapes
        that follow from the layout (vocabulary shard, layers per chunk)."""
        from megatron.core import parallel_state as ps

        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.vocab_local = self.spec.padded_vocab(self.layout.tp) // self.layout.tp
        self.layers_per_chunk = self.spec.layers // (self.layout.pp * self.layout.vpp)

    def _wrap_ddp(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
            check_for_nan_in_grad=False, average_in_collective=False)

        def finalize(model, num_tokens=None, **kwargs):  # the loss is globally normalised already
            return finalize_model_grads(model, None, **kwargs)

        self.tf_config.finalize_model_grads_func = finalize
        return [DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=chunk,
                                        disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]

    def _build_optimizer(self, actor: ActorConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=actor.lr, min_lr=actor.lr * actor.min_lr_ratio, weight_decay=actor.weight_decay,
            adam_beta1=actor.betas[0], adam_beta2=actor.betas[1], adam_eps=1e-8, clip_grad=actor.grad_clip,
            bf16=self.on_gpu, params_dtype=torch.bfloat16 if self.on_gpu else torch.float32,
            use_distributed_optimizer=True)
        # weight decay on every parameter, as the FSDP engine's AdamW: {} = no per-parameter overrides
        # (megatron-core >= 0.15); older releases take a no-weight-decay predicate instead
        import inspect

        from spmd_rl.engine.megatron.groups import world_of

        with world_of(self.layout.size, self.group):  # it gathers its parameter groups over the "world"
            if "config_overrides" in inspect.signature(get_megatron_optimizer).parameters:
                return get_megatron_optimizer(config, self.model, config_overrides={})
            return get_megatron_optimizer(config, self.model, no_weight_decay_cond=lambda name, param: False)

    @torch.no_grad()
    def _main_params_from(self, fp32_weights: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        """Set the optimizer's fp32 main weights to the loaded fp32 weights.

        megatron-core's distributed optimizer creates its main weights by upcasting the bf16 model
        parameters, i.e. from the checkpoint ROUNDED to bf16. Every main weight then starts exactly
        on a bf16 grid point, and the bf16 compute weight (the main weight rounded) changes only once
        the accumulated updates pass half a bf16 step (2^-9 relative: ~1e-4 for a weight of 0.05, or
        ~50 AdamW steps of lr 2e-6). The FSDP engine keeps the checkpoint's fp32 weights, which lie
        anywhere between grid points, so a small step moves the bf16 compute weights by the step on
        average from the first update. On a checkpoint whose fp32 weights lie off the bf16 grid
        (SmolLM2-135M, a dequantised GGUF) at lr 2e-6 a megatron actor seeded from the rounded
        weights barely moves (docs/RESULTS.md, "Megatron engine on GPUs"). Each main weight is this
        rank's shard (its range in the flattened parameter) of one model parameter."""
        for opt, model_param, main_param in self._main_params():
            start, end = param_range(opt, model_param)
            source = fp32_weights[model_param].reshape(-1)[start:end]
            main_param.copy_(source.to(main_param.device, main_param.dtype))

    def _main_params(self) -> Iterator[tuple[object, torch.nn.Parameter, torch.Tensor]]:
        """``(distributed optimizer, model parameter, its main parameter)``: the main parameter is
        this dp rank's range of the flattened parameter, fp32 (a copy for bf16 parameters, a view of
        the parameter for fp32 ones), and the key of its AdamW state."""
        assert self.optimizer is not None
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for models, mains in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                  (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for model_group, main_group in zip(models, mains):
                    yield from ((opt, m, main) for m, main in zip(model_group, main_group))

    def _chunks(self) -> list[torch.nn.Module]:
        """The GPTModel of every chunk (under DDP / Float16Module wrappers)."""
        out = []
        for m in self.model:
            while not hasattr(m, "decoder"):
                m = m.module
            out.append(m)
        return out

    # ------------------------------------------------------------------ data
    def micro_batches(self, batch: RolloutBatch, *, micro_batch_size: int) -> list[RolloutBatch]:
        """``micro_batch_size`` rows each, in order (the last may be shorter)."""
        return list(batch.split(micro_batch_size))

    def _grids(self, micros: list[RolloutBatch]) -> tuple[list[_Grid], int, int]:
        if self.layout.vpp > 1 and len(micros) % self.layout.pp:
            # the interleaved schedule runs micro-batches in groups of pp: add empty ones (no rows,
            # no loss) up to a multiple of pp
            micros = micros + [micros[0].select([])] * (self.layout.pp - len(micros) % self.layout.pp)
        rows = max(len(m) for m in micros)
        if self.spec.sliding_window is not None:
            longest = max(max(packing.row_tokens(m)) for m in micros if len(m))
            check_sliding_window(longest, self.spec.sliding_window, engine="megatron")
        width = max(max(len(p) for p in m.prompts) + m.response_len for m in micros if len(m))
        cp = self.layout.cp
        # tp: sequence parallelism splits each cp rank's W / cp tokens over tp; cp: 2 * cp equal chunks
        unit = math.lcm(2 * cp, cp * self.layout.tp) if cp > 1 else self.layout.tp
        width = -(-width // unit) * unit
        held_cols = local_of = None
        if cp > 1:
            from megatron.core import parallel_state as ps

            held_cols = chunk_columns(width, cp, ps.get_context_parallel_rank())  # global columns, local order
            local_of = torch.full((width,), -1, dtype=torch.long)
            local_of[held_cols] = torch.arange(len(held_cols))
        grids = []
        for micro in micros:
            t = micro.response_len
            tokens = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
            starts = torch.ones(rows, dtype=torch.long)  # padding rows: any valid predictor position
            for i, prompt in enumerate(micro.prompts):
                tokens[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
                tokens[i, len(prompt):len(prompt) + t] = micro["response_ids"][i]
                starts[i] = len(prompt)
            labels = torch.full((rows, t), self.pad_token_id, dtype=torch.long)
            labels[:len(micro)] = micro["response_ids"]
            cols = (starts[:, None] - 1 + torch.arange(t)[None]).reshape(-1)
            grid_rows, labels = torch.arange(rows).repeat_interleave(t), labels.reshape(-1)
            positions, held = torch.arange(width), None
            if local_of is not None:  # this cp rank's chunks; the response positions whose predictor they hold
                tokens, positions = tokens[:, held_cols], held_cols
                held = (local_of[cols] >= 0).nonzero().squeeze(1)
                grid_rows, cols, labels = grid_rows[held], local_of[cols[held]], labels[held]
                held = held.to(self.device)
            routes = None
            if self.replay is not None and "routed_experts" in micro:  # None (e.g. validation): own logits
                recorded = grid_routes(micro, rows=rows, width=width, starts=starts[:len(micro)].tolist())
                routes = self.replay.layout(recorded, held_cols=held_cols, tp=self.layout.tp, tp_rank=self.tp_rank,
                                            sequence_parallel=bool(self.tf_config.sequence_parallel)).to(self.device)
            grids.append(_Grid(
                micro=micro, tokens=tokens.to(self.device),
                positions=positions.expand(rows, -1).contiguous().to(self.device),
                rows=grid_rows.to(self.device), cols=cols.to(self.device), labels=labels.to(self.device),
                real=len(micro), held=held, routes=routes))
        return grids, rows, width

    def _response_logprobs(self, logits: torch.Tensor, grid: _Grid, temperature: float, entropy: str
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[real, T]`` log-probs (0 where the response mask is 0) and entropy from ``[B, W/cp, V/tp]``
        logits (with cp > 1 the same on every cp rank, in sequence order)."""
        picked = logits[grid.rows, grid.cols].float()
        if temperature > 0 and temperature != 1.0:
            picked = picked / temperature
        if entropy == "detached":
            logp, _ = vocab_parallel_logprobs(picked, grid.labels, group=self.tp_group, entropy=False,
                                              vocab_start=self.tp_rank * self.vocab_local, vocab=self.spec.vocab)
            with torch.no_grad():
                _, ent = vocab_parallel_logprobs(picked.detach(), grid.labels, group=self.tp_group, entropy=True,
                                                 vocab_start=self.tp_rank * self.vocab_local, vocab=self.spec.vocab)
        else:
            logp, ent = vocab_parallel_logprobs(picked, grid.labels, group=self.tp_group, entropy=entropy == "grad",
                                                vocab_start=self.tp_rank * self.vocab_local, vocab=self.spec.vocab)
        t = grid.micro.response_len
        if grid.held is not None:  # every cp rank: all B*T positions, each from the rank holding it
            from megatron.core import parallel_state as ps

            size, group = grid.tokens.shape[0] * t, ps.get_context_parallel_group()
            logp = sum_shares(logp, grid.held, size, group=group)
            ent = sum_shares(ent, grid.held, size, group=group) if ent is not None else None
        mask = grid.micro["response_mask"].to(self.device)
        logp = logp.view(-1, t)[:grid.real] * mask
        ent = ent.view(-1, t)[:grid.real] * mask if ent is not None else None
        return logp, ent

    def _run(self, grids: list[_Grid], rows: int, width: int, loss: Callable, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            grid = next(data_iterator)
            if self.replay is not None:  # this chunk's routers, for this micro-batch (kept: nothing recomputes)
                self.replay.set(next(i for i, m in enumerate(self.model) if m is model), grid.routes)
            output = model(grid.tokens, grid.positions, None)
            return output, lambda out: loss(out, grid)

        many = len(self.model) > 1
        iterators = [iter(grids) for _ in self.model] if many else iter(grids)
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators, model=self.model if many else self.model[0],
            num_microbatches=len(grids), seq_length=width, micro_batch_size=rows, forward_only=forward_only)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B, T]`` (and entropy) of the batch's responses on every rank (computed on the
        last pipeline stage, broadcast over the pipeline group)."""
        self.onload()
        for m in self.model:
            m.eval()
        grids, rows, width = self._grids(self.micro_batches(batch, micro_batch_size=micro_batch_size))
        zero = torch.zeros((), device=self.device)

        def loss(output, grid):
            logp, ent = self._response_logprobs(output, grid, temperature, "detached" if with_entropy else "none")
            return zero, torch.ones((), dtype=torch.int, device=self.device), {"logp": logp, "ent": ent}

        outputs = self._run(grids, rows, width, loss, forward_only=True)
        for m in self.model:
            m.train(self.trainable)
        shape = (len(batch), batch.response_len)
        logprobs = torch.cat([o["logp"] for o in outputs]) if self.is_last_stage else torch.empty(shape, device=self.device)
        entropy = None
        if with_entropy:
            entropy = torch.cat([o["ent"] for o in outputs]) if self.is_last_stage else torch.empty(shape, device=self.device)
        if self.layout.pp > 1:
            dist.broadcast(logprobs, src=self.pp_ranks[-1], group=self.pp_group)
            if entropy is not None:
                dist.broadcast(entropy, src=self.pp_ranks[-1], group=self.pp_group)
        self.offload()
        return logprobs, entropy

    # ------------------------------------------------------------------ update
    def train_mini_batch(self, micro_batches: list[RolloutBatch], loss_fn: LossFn, *, temperature: float,
                         need_entropy_grad: bool) -> dict[str, float]:
        """One optimizer step over ``micro_batches``; returns grad_norm and lr (same on every rank)."""
        assert self.optimizer is not None and self.actor is not None, "reference engine cannot train"
        self.onload(optimizer=True)  # the caller calls offload() after its last mini-batch
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        grids, rows, width = self._grids(micro_batches)

        def loss(output, grid):
            if grid.real == 0:  # an empty micro-batch of the interleaved schedule: no loss, no metrics
                return output.float().sum() * 0.0, torch.ones((), dtype=torch.int, device=self.device), {}
            logp, ent = self._response_logprobs(output, grid, temperature, "grad" if need_entropy_grad else "detached")
            value, _ = loss_fn(logp, ent, grid.micro)
            return value, torch.ones((), dtype=torch.int, device=self.device), {}

        self._run(grids, rows, width, loss, forward_only=False)
        actor = self.actor
        lr = actor.lr * lr_lambda(self.updates, warmup=actor.warmup_steps, total=self.total_updates,
                                  schedule=actor.lr_schedule, min_ratio=actor.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = actor.weight_decay * group.get("wd_mult", 1.0)
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        # the norm is reduced over every model- and data-parallel rank: all take the same branch; a skipped
        # step's gradients are dropped by the next call's zero_grad, the LR schedule does not advance
        if self.nonfinite.skip(grad_norm):
            return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
        if actor.grad_clip > 0:  # as megatron's own step: every optimizer (dense, expert) by the total norm
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, max_norm=actor.grad_clip, total_norm=grad_norm)
        self.optimizer.step_with_ready_grads()
        self.updates += 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights out
    @torch.no_grad()
    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one conversion unit at a time, on every rank (collective)."""
        self.onload()
        yield from export_hf_weights(self._chunks(), self.spec, self.hf_shapes,
                                     layers_per_chunk=self.layers_per_chunk, dtype=dtype)
        self.offload()


class _PaddingRowFrozen:
    """Forward hook of megatron's embedding: positions holding the padding token pass no gradient to
    the embedding table, as Hugging Face's ``nn.Embedding(padding_idx=...)`` does (its padding row
    never trains; a sampled padding token inside a response would otherwise move it). The output is
    ``[S, B, H]``, or this tp rank's ``S / tp`` slice under sequence parallelism."""

    def __init__(self, padding_idx: int) -> None:
        self.padding_idx = padding_idx

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        ids = args[0] if args else kwargs["input_ids"]
        pad = (ids == self.padding_idx).t().contiguous()  # [S, B]; contiguous, or where() may return transposed strides
        if output.shape[0] != pad.shape[0]:  # sequence parallel: this rank's slice of the sequence
            local = output.shape[0]
            start = ps.get_tensor_model_parallel_rank() * local
            pad = pad[start:start + local]
        return torch.where(pad.unsqueeze(-1), output.detach(), output)
