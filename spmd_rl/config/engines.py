"""The training engines' config sections: ``actor`` (with its ``fsdp`` and ``megatron`` layouts and
``lora`` adapters), ``ref`` and ``critic``. Same conventions as :mod:`.sections`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .checks import _check


@dataclass(kw_only=True)
class FsdpConfig:
    fsdp_size: int = -1
    """Ranks that shard one copy of the parameters: -1 = the whole pool (1D `[fsdp]` mesh);
    smaller gives HSDP `[ddp, fsdp]` (shard inside a group, replicate across groups)."""
    ulysses_size: int = 1
    """Ulysses sequence-parallel degree: the pool becomes `[dp, sp]` with sp ranks contiguous."""
    param_offload: bool = False
    """Keep parameters (and gradients) on CPU between phases, moved to the device for each phase
    (GPU runs; a no-op on CPU runs, where they already live in host memory)."""
    optimizer_offload: bool = False
    """Keep AdamW state on CPU between updates (GPU runs; a no-op on CPU runs)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) instead of keeping them (ZeRO-2)."""
    wrap_one_rank: bool = False
    """Wrap the model in FSDP2 on a one-rank pool too. Off, one rank runs the plain module and casts
    its fp32 weights to bf16 copies once per pass over the micro-batches, FSDP2's mixed precision
    without its per-layer hooks and DTensors (`spmd_rl/engine/mixed.py`), bit for bit and faster
    where the update is bound by launches (small models; docs/PERF.md)."""
    gather_once: bool = True
    """Where a shard spans one rank (`fsdp_size` 1, or a one-rank pool with `wrap_one_rank`), gather
    (and cast to bf16) the parameters once per pass over the micro-batches instead of per micro-batch
    and layer, forward and backward: such a gather is a copy that frees nothing. Costs one bf16 copy
    of the model during the pass; no effect where shards span several ranks."""
    keep_logits_gib: float | None = None
    """Keep the log-prob head's raw logits from the forward for the backward when a micro-batch's take
    at most this many GiB, instead of recomputing their GEMM chunk by chunk (a `2 N V H` GEMM).
    None = 1/16 of the GPU's memory (0 on CPU); 0 = always recompute (the least memory)."""
    compile_layers: bool = False
    """`torch.compile` every decoder layer of the actor and reference models (in place: parameter
    names and checkpoints unchanged). Fuses the norms, RoPE and SwiGLU, which raises the MFU of a
    GPU-bound update and lowers its peak memory (docs/PERF.md); the first steps pay the compilation,
    and a CPU run needs a C++ compiler."""

    def __post_init__(self) -> None:
        _check(self.fsdp_size == -1 or self.fsdp_size >= 1, f"actor.fsdp.fsdp_size must be -1 or >= 1, got {self.fsdp_size}")
        _check(self.ulysses_size >= 1, f"actor.fsdp.ulysses_size must be >= 1, got {self.ulysses_size}")
        _check(self.keep_logits_gib is None or self.keep_logits_gib >= 0,
               f"actor.fsdp.keep_logits_gib must be >= 0 (or None for automatic), got {self.keep_logits_gib}")


@dataclass(kw_only=True)
class MegatronConfig:
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (interleaved schedule); 1 = off."""
    cp: int = 1
    """Context-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE models)."""
    etp: int | None = None
    """Expert tensor-parallel degree; None = equal to tp."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order of the parallel axes, fastest-varying first, as megatron-core takes it."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the tp group."""
    param_offload: bool = False
    """Keep the parameters in host memory between phases (their gradient buffers are freed), moved
    back to the device for each forward or update, in place and exactly (pinned memory on GPU; on CPU
    runs the same swap between host buffers, which frees nothing)."""
    optimizer_offload: bool = False
    """Keep the distributed optimizer's fp32 main weights and AdamW moments in host memory between
    updates (as `actor.megatron.param_offload`)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep"):
            value = getattr(self, name)
            _check(value >= 1, f"actor.megatron.{name} must be >= 1, got {value}")
        _check(self.etp is None or self.etp >= 1, f"actor.megatron.etp must be >= 1, got {self.etp}")
        axes = self.order.split("-")
        _check(
            sorted(axes) == sorted(["tp", "cp", "ep", "dp", "pp"]),
            f"actor.megatron.order must name tp, cp, ep, dp, pp once each separated by '-', got {self.order!r}",
        )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama / Qwen / Mistral decoder layer: attention and MLP projections."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r: train low-rank adapters `W + (alpha / r) * B @ A` on `actor.lora.targets` (PEFT)
    instead of every weight; the frozen base is the reference (no second model for the KL term),
    hot-swaps send merged weights and checkpoints hold the adapters only. 0 = off (full fine-tuning).
    FSDP engine only."""
    alpha: float = 16.0
    """LoRA alpha: the adapters' update is scaled by `alpha / rank`."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Module names (last part of the name) that get adapters, as PEFT's `target_modules`; `all-linear`
    = every linear layer but the LM head."""

    def __post_init__(self) -> None:
        _check(self.rank >= 0, f"actor.lora.rank must be >= 0 (0 = off), got {self.rank}")
        _check(self.alpha > 0, f"actor.lora.alpha must be > 0, got {self.alpha}")
        _check(len(self.targets) >= 1, "actor.lora.targets must name at least one module (or all-linear)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """What ``B @ A`` is multiplied by (PEFT's ``scaling`` without rsLoRA)."""
        return self.alpha / self.rank


@dataclass(kw_only=True)
class ActorConfig:
    engine: Literal["fsdp", "megatron"] = "fsdp"
    """Training engine: FSDP2 (`actor.fsdp.*`; any causal LM) or megatron-core (`actor.megatron.*`; model types
    llama (incl. llama3 RoPE scaling), mistral, qwen2, qwen3, qwen3_moe, mixtral; others are refused at start)."""
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `actor.lr`."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """LR after warmup: constant, or cosine decay to `actor.min_lr_ratio * actor.lr`."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of the peak LR."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    skip_nonfinite_updates: int = 0
    """Optimizer steps in a row with a NaN/inf gradient norm that are skipped (gradients dropped,
    weights and LR schedule unchanged, counted in `actor/skipped_updates`, the cause logged) before
    the run stops with an error; 0 = stop at the first. The FSDP engine also replays the mini-batch
    to name the module or autograd node that made the first NaN."""
    ppo_mini_batch_size: int = 8
    """Prompts per optimizer step (times `rollout.n` responses), over the whole world."""
    micro_batch_size: int = 8
    """Responses per forward/backward per rank (ignored when `actor.max_tokens_per_gpu` is set)."""
    ppo_epochs: int = 1
    """Passes over the step's data."""
    use_packing: bool = False
    """Pack each micro-batch's sequences (prompt + response) without padding into rows with
    per-sequence positions and causal attention inside each sequence (torch's flash varlen kernel on
    GPU, a block-diagonal SDPA mask on CPU); same loss, fewer wasted tokens. Applies to the actor's
    and the reference's forwards. With `actor.max_tokens_per_gpu` it is the fast setting on GPU,
    where few large micro-batches also save per-layer collectives (docs/PERF.md). FSDP engine only."""
    max_tokens_per_gpu: int | None = None
    """Dynamic micro-batches: rows grouped so each forward holds at most this many prompt + response
    tokens per GPU (x `actor.fsdp.ulysses_size` per sequence-parallel group), balanced, with the
    same micro-batch count on every rank; also used for the old and reference log-prob forwards.
    Unset = `actor.micro_batch_size` rows per micro-batch."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    """FSDP2 engine layout and memory options."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """megatron-core engine layout."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (`actor.lora.rank` > 0)."""
    router_replay: bool = False
    """MoE router replay ("R3"): the rollout records, for every generated token and every MoE layer, the
    experts its router chose, and the actor's log-prob and update forwards route those tokens to exactly
    those experts (gate weights from the trainer's own router logits over them); prompt and environment
    tokens route by the trainer's logits. Removes the routing part of the rollout/trainer mismatch
    (docs/OFFPOLICY.md). Needs an MoE model (Qwen3-MoE routers), the built-in
    rollout's fast decode, single-turn rounds (not `rollout.stream`, not episodes); the reference and
    the critic route by their own logits."""

    def __post_init__(self) -> None:
        _check(math.isfinite(self.lr) and self.lr > 0, f"actor.lr must be a finite number > 0, got {self.lr}")
        _check(all(math.isfinite(b) and 0 <= b < 1 for b in self.betas),
               f"actor.betas must be two numbers in [0, 1), got {' '.join(f'{b:g}' for b in self.betas)}")
        _check(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
               f"actor.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        _check(self.warmup_steps >= 0, f"actor.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(0 <= self.min_lr_ratio <= 1, f"actor.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(math.isfinite(self.grad_clip) and self.grad_clip >= 0, f"actor.grad_clip must be >= 0, got {self.grad_clip}")
        _check(self.skip_nonfinite_updates >= 0,
               f"actor.skip_nonfinite_updates must be >= 0, got {self.skip_nonfinite_updates}")
        _check(self.ppo_mini_batch_size >= 1, f"actor.ppo_mini_batch_size must be >= 1, got {self.ppo_mini_batch_size}")
        _check(self.micro_batch_size >= 1, f"actor.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        _check(self.ppo_epochs >= 1, f"actor.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        _check(self.max_tokens_per_gpu is None or self.max_tokens_per_gpu >= 1,
               f"actor.max_tokens_per_gpu must be >= 1 (or unset), got {self.max_tokens_per_gpu}")


@dataclass(kw_only=True)
class RefConfig:
    param_offload: bool = False
    """Keep the frozen reference model on CPU between its forward passes (GPU runs; a no-op on
    CPU runs). Independent of `actor.fsdp.param_offload`."""
    micro_batch_size: int = 16
    """Responses per reference forward per rank."""


@dataclass(kw_only=True)
class CriticModelConfig:
    path: str | None = None
    """The value model's starting weights: a Hugging Face folder (a causal LM, a token classifier such
    as a saved critic, or a one-output reward model, whose `score` head is then kept), a local `.gguf`
    file or a built-in name; None = the actor's `model.path`. Its decoder runs with a new one-output
    `score` head (`AutoModelForTokenClassification`, num_labels=1) unless the folder has one. It must
    share the actor's tokenizer."""
    trust_remote_code: bool = False
    """Allow custom modeling code from the critic's folder."""


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's value model (`algo.adv_estimator=gae`): trained by its own FSDP engine on the actor's
    ranks and layout (`actor.fsdp.*`, `actor.use_packing`, `actor.max_tokens_per_gpu`), on the actor's
    mini-batches (`actor.ppo_mini_batch_size`), with AdamW and the actor's betas, LR schedule and
    non-finite-update guard."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    lr: float = 1e-5
    """Peak learning rate of the critic's AdamW."""
    weight_decay: float = 0.0
    """The critic's AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `critic.lr`."""
    grad_clip: float = 1.0
    """Clip the critic's global gradient norm to this value (0 = off)."""
    cliprange_value: float = 0.5
    """Value clipping: a prediction's error also counts clipped to within this distance of the value
    it had when the batch was scored, and the larger of the two errors is taken (PPO's clipped value loss)."""
    micro_batch_size: int = 8
    """Responses per value forward/backward per rank (ignored when `actor.max_tokens_per_gpu` is set)."""
    ppo_epochs: int | None = None
    """Passes of the critic over the step's data; None = `actor.ppo_epochs`."""

    def __post_init__(self) -> None:
        _check(math.isfinite(self.lr) and self.lr > 0, f"critic.lr must be a finite number > 0, got {self.lr}")
        _check(self.warmup_steps >= 0, f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.grad_clip >= 0, f"critic.grad_clip must be >= 0, got {self.grad_clip}")
        _check(self.cliprange_value >= 0, f"critic.cliprange_value must be >= 0, got {self.cliprange_value}")
        _check(self.micro_batch_size >= 1, f"critic.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        _check(self.ppo_epochs is None or self.ppo_epochs >= 1,
               f"critic.ppo_epochs must be >= 1 (or unset: the actor's), got {self.ppo_epochs}")
