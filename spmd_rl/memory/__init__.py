"""Each rank's GPU memory, estimated from the config, the plan and the model's shape before anything is
built; :func:`spmd_rl.plan.plan` refuses a run whose estimate exceeds its GPU (``--plan.no-memory-check``
starts it anyway). No torch: the layout tool prints it (``python -m spmd_rl.layout ... --memory``).

    p = plan(cfg, 8, model_shape=shape, device_bytes=143_771 * 2**20)   # p.memory: a MemoryEstimate
    p.memory.ranks[0].peak, .peak_phase, .largest()                    # bytes, "update", Part(...)
    print(p.memory.render())                                           # one table per pool

Per pool (its ranks are alike) the estimate lists the tensors a rank holds and the phases of a step they
are on the GPU in (``generate``, ``log-probs``, ``update``, ``critic update``); the peak is the largest
phase. The engine's and the rollout backend's registry entries say what they hold (``EngineSpec.memory``,
``BackendSpec.memory``), following their code, for a GPU run (bf16 compute):

* FSDP engine: fp32 weights, fp32 gradients (kept from one update to the next) and AdamW's two fp32
  moments over the shard size (``actor.fsdp.fsdp_size``); ``param_offload`` keeps weights and gradients
  on the GPU only for forwards and the update, ``optimizer_offload`` the moments for the update. In a
  pass: on one rank a bf16 copy of every fp32 weight (:mod:`spmd_rl.engine.mixed`) and its bf16
  gradients; under FSDP the gathered root and two layers (all layers without ``reshard_after_forward``
  or with ``gather_once`` on shards of one rank). LoRA: a bf16 base; fp32 weights, gradients and moments
  of the adapters only; no reference model. The critic is the same engine with a value head.
* megatron engine: bf16 weights and fp32 gradient buffers over tp x pp (experts over etp x ep x pp), the
  distributed optimizer's fp32 main weights and moments also over dp; pp micro-batches in flight.
* activations of a micro-batch (``actor.max_tokens_per_gpu`` tokens, else ``actor.micro_batch_size``
  rows of the longest prompt + response): what autograd keeps per token and layer (norm inputs and
  outputs, q / k / v, the attention output, the MLP's four intermediates or each routed expert's), only
  each layer's input under gradient checkpointing; the log-prob head's bf16 logits when it keeps them
  (``actor.fsdp.keep_logits_gib``, default 1/16 of the GPU), else one chunk.
* the built-in rollout: a bf16 copy of the model (kept through a level-1 sleep) and its slot KV cache
  as :meth:`spmd_rl.rollout.slots.SlotCache.memory_needed` sizes it (the batch bucket of a rank's rows
  x the longest prompt + ``rollout.max_new_tokens`` rounded up to 64), freed at sleep; vLLM: its
  ``rollout.gpu_memory_utilization`` of the GPU while it generates.
* the reference and a colocated teacher or reward model: fp32 weights sharded like the actor's (the
  megatron reference bf16), on the GPU unless their ``param_offload``; the largest of the step's
  no-grad forwards (bf16 copies or gathered layers, a layer's intermediates, a chunk of logits).

Left out: the CUDA context and NCCL's buffers (a few hundred MiB to ~2 GiB), what torch's allocator
reserves above what it allocates, CUDA graphs' pools, the batch's own tensors, and sliding windows
(counted as full-length layers). It estimates the peak torch allocates (``max_memory_allocated``);
docs/PERF.md ("Memory at plan time") compares it with measured peaks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .counts import GIB, lengths, micro_tokens
from .parts import (
    CRITIC, FSDP_MEMORY, GENERATE, LOGPROBS, MEGATRON_MEMORY, NATIVE_MEMORY, STEP, VLLM_MEMORY, EngineMemory, Part,
    Plan, Remedies, RolloutMemory, fsdp_trainable, frozen,
)

if TYPE_CHECKING:
    from spmd_rl.config import Config
    from spmd_rl.models.shape import ModelShape


@dataclass(frozen=True)
class RankMemory:
    """A rank of ``pool`` (all its ranks alike): its parts, and the share of a GPU it may use."""

    pool: str
    ranks: int
    phases: tuple[str, ...]
    parts: tuple[Part, ...]
    device_bytes: int | None = None
    """This rank's share of its GPU (with ``pools.colocate`` its pool's fraction); None: not known."""

    def total(self, phase: str) -> int:
        return sum(p.bytes for p in self.parts if phase in p.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    @property
    def over(self) -> bool:
        return self.device_bytes is not None and self.peak > self.device_bytes

    def largest(self) -> Part:
        """The largest part at the peak."""
        return max((p for p in self.parts if self.peak_phase in p.phases), key=lambda p: p.bytes)

    def render(self) -> str:
        unit, name = (GIB, "GiB") if self.peak >= GIB else (2 ** 20, "MiB")
        rows = [["part", *self.phases]]
        rows += [[p.name] + [f"{p.bytes / unit:.2f}" if ph in p.phases else "-" for ph in self.phases] for p in self.parts]
        rows.append(["total"] + [f"{self.total(ph) / unit:.2f}" for ph in self.phases])
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.phases) + 1)]
        lines = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
        device = "" if not self.device_bytes else (f" of the {self.device_bytes / GIB:.1f} GiB it may use "
                                                   f"({100 * self.peak / self.device_bytes:.0f} %)")
        title = f"{self.pool} pool ({self.ranks} rank{'s' if self.ranks > 1 else ''}), {name} per rank"
        tail = (f"peak {self.peak / unit:.2f} {name} in {self.peak_phase}{device}; largest part: "
                f"{self.largest().name} ({self.largest().bytes / unit:.2f} {name})")
        return "\n".join([title, *lines, tail])


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate of every pool's ranks (:func:`estimate_memory`)."""

    model: str
    ranks: tuple[RankMemory, ...]

    def render(self) -> str:
        return (f"memory per rank, estimated for {self.model} (what torch allocates at the peak; the CUDA context "
                "and fragmentation not counted):\n" + "\n\n".join(r.render() for r in self.ranks))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "pools": [
            {"pool": r.pool, "ranks": r.ranks, "device_bytes": r.device_bytes, "peak": r.peak,
             "peak_phase": r.peak_phase, "phases": {ph: r.total(ph) for ph in r.phases},
             "parts": {p.name: {"bytes": p.bytes, "phases": [ph for ph in r.phases if ph in p.phases]}
                       for p in r.parts}} for r in self.ranks]}


# --------------------------------------------------------------------------- the estimate and the refusal


def _global_pool(cfg: Config, p: Plan, s: ModelShape, engine: EngineMemory, rollout: RolloutMemory,
                 device_bytes: int | None, shape_of: Callable[[str], ModelShape | None]) -> list[Part]:
    """An actor rank: the actor, the rollout when colocated, the reference, the critic, a colocated teacher
    or reward model, and the largest of the step's no-grad forwards."""
    parts, own_forward = engine.actor(cfg, p, s, device_bytes)
    if not p.rollout_separate:
        parts += rollout.parts(cfg, p, s, device_bytes, pool=False)
    rows = cfg.data.train_batch_size // p.dp_size * cfg.rollout.n
    forwards = [own_forward * _needs_old_logprobs(cfg)]
    if not cfg.actor.lora.enabled and (cfg.algo.use_kl_loss or cfg.algo.kl_in_reward):
        weights, forward = engine.reference(cfg, p, s, *micro_tokens(cfg, rows, cfg.ref.micro_batch_size))
        parts.append(weights)
        forwards.append(forward)
    if cfg.algo.adv_estimator == "gae":
        critic = (shape_of(cfg.critic.model.path) if cfg.critic.model.path else None) or s
        parts += fsdp_trainable(cfg, p, critic, device_bytes, critic=True)[0]
    for name, path, offload, mbs in (("teacher", cfg.teacher.model.path, cfg.teacher.param_offload,
                                      cfg.teacher.micro_batch_size),
                                     ("reward", cfg.reward.model.path, cfg.reward.model.param_offload,
                                      cfg.reward.model.micro_batch_size)):
        other = shape_of(path) if path and p.pool_optional(name) is None else None
        if other is not None and other.hidden:  # colocated: FSDP over the global pool
            weights, forward = frozen("teacher" if name == "teacher" else "reward model", other, p.global_pool.size,
                                      offload, *micro_tokens(cfg, rows, mbs), classifier=name == "reward")
            parts.append(weights)
            forwards.append(forward)
    parts.append(Part("largest no-grad forward", max(forwards), frozenset({LOGPROBS})))
    return [part for part in parts if part.bytes > 0]


def _needs_old_logprobs(cfg: Config) -> bool:
    """Whether the actor runs a forward for the old log-probs (``Trainer.need_old_logprobs``)."""
    updates = cfg.actor.ppo_epochs * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)
    return updates > 1 or cfg.algo.kl_in_reward or cfg.algo.rollout_rs is not None or cfg.algo.rollout_is_batch_normalize


def estimate_memory(cfg: Config, p: Plan, shape: ModelShape, *, engine: EngineMemory, rollout: RolloutMemory,
                    device_bytes: int | None = None,
                    shape_of: Callable[[str], ModelShape | None] | None = None) -> MemoryEstimate | None:
    """Each pool's per-rank estimate (module docstring); None when the shape lacks the hidden size or the
    vocabulary. ``device_bytes``: one GPU's memory; ``shape_of``: reads the teacher's, the critic's and the
    reward model's shapes (default :func:`~spmd_rl.models.shape.read_model_shape`)."""
    if not shape.hidden or not shape.vocab:
        return None
    if shape_of is None:
        from spmd_rl.models.shape import read_model_shape

        def shape_of(path: str) -> ModelShape | None:
            return read_model_shape(path, cache_dir=cfg.model.cache_dir)

    def share(pool: str) -> int | None:  # with pools.colocate, a pool's processes each get their share
        return None if device_bytes is None else int(device_bytes * p.memory_fractions.get(pool, 1.0))

    phases = tuple(ph for ph in STEP if ph != CRITIC or cfg.algo.adv_estimator == "gae")
    ranks = [RankMemory("global", p.global_pool.size, phases,
                        tuple(_global_pool(cfg, p, shape, engine, rollout, device_bytes, shape_of)), share("global"))]
    if p.rollout_separate:
        ranks.append(RankMemory("rollout", p.rollout_pool.size, (GENERATE,),
                                tuple(rollout.parts(cfg, p, shape, device_bytes, pool=True)), share("rollout")))
    for name, path, mbs in (("teacher", cfg.teacher.model.path, cfg.teacher.micro_batch_size),
                            ("reward", cfg.reward.model.path, cfg.reward.model.micro_batch_size)):
        spec = p.pool_optional(name)
        other = shape_of(path) if spec is not None and path else None
        if spec is not None and other is not None and other.hidden:
            rows = -(-cfg.data.train_batch_size * cfg.rollout.n // spec.size)
            weights, forward = frozen("teacher" if name == "teacher" else "reward model", other, spec.size, False,
                                      *micro_tokens(cfg, rows, mbs), classifier=name == "reward")
            ranks.append(RankMemory(name, spec.size, (LOGPROBS,), (weights, Part("forward", forward, frozenset({LOGPROBS}))),
                                    share(name)))
    return MemoryEstimate(model=shape.source, ranks=tuple(ranks))


def remedies(cfg: Config, engine: EngineMemory, rollout: RolloutMemory) -> Remedies:
    """Single changes that lower a rank's memory: the engine's and the backend's, then the common ones."""
    out = engine.remedies(cfg)
    if not cfg.model.checkpointing_on("cuda"):
        out.append(("--model.gradient-checkpointing True", {"model.gradient_checkpointing": True}))
    budget = cfg.actor.max_tokens_per_gpu
    if budget is not None and budget // 2 * cfg.actor.fsdp.ulysses_size >= lengths(cfg)[0]:
        out.append((f"--actor.max-tokens-per-gpu {budget // 2}", {"actor.max_tokens_per_gpu": budget // 2}))
    elif budget is None and cfg.actor.micro_batch_size > 1:
        half = cfg.actor.micro_batch_size // 2
        out.append((f"--actor.micro-batch-size {half}", {"actor.micro_batch_size": half}))
    if not cfg.ref.param_offload and not cfg.actor.lora.enabled and cfg.algo.use_kl_loss:
        out.append(("--ref.param-offload", {"ref.param_offload": True}))
    if cfg.rollout.sleep_level_on("cuda") < 2:
        out.append(("--rollout.sleep-level 2", {"rollout.sleep_level": 2}))
    return out + rollout.remedies(cfg)


def _changed(cfg: Config, changes: dict[str, Any]) -> Config:
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *path, name = dotted.split(".")
        target = out
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    return out


def check_memory(cfg: Config, p: Plan, shape: ModelShape, *, engine: EngineMemory, rollout: RolloutMemory,
                 device_bytes: int | None) -> None:
    """ValueError when a pool's estimated peak (``p.memory``) exceeds its share of the GPU: the numbers, the
    largest parts, the single changes that would fit (each estimated again), ``--plan.no-memory-check``."""
    over = next((r for r in p.memory.ranks if r.over), None) if p.memory is not None else None
    if over is None:
        return

    def peak(changes: dict[str, Any]) -> RankMemory | None:
        redo = estimate_memory(_changed(cfg, changes), p, shape, engine=engine, rollout=rollout,
                               device_bytes=device_bytes)
        return next((r for r in redo.ranks if r.pool == over.pool), None) if redo is not None else None

    parts = sorted((x for x in over.parts if over.peak_phase in x.phases), key=lambda x: -x.bytes)
    top = ", then ".join(f"{x.name} ({x.bytes / GIB:.1f} GiB)" for x in parts[:3])
    options, together, fits = remedies(cfg, engine, rollout), {}, []
    for flag, changes in options:
        together.update(changes)
        rank = peak(changes)
        if rank is not None and not rank.over:
            fits.append(f"{flag} ({rank.peak / GIB:.1f} GiB)")
    if fits:
        advice = "each of these alone fits: " + "; ".join(fits)
    else:
        every = peak(together)
        advice = "no single flag fits it" + (f" (all of {', '.join(f for f, _ in options)} together: "
                                             f"{every.peak / GIB:.1f} GiB)" if every is not None else "")
    device = (over.device_bytes or 0) / GIB
    raise ValueError(
        f"out of GPU memory: a {over.pool}-pool rank needs an estimated {over.peak / GIB:.1f} GiB in its "
        f"{over.peak_phase} phase, above the {device:.1f} GiB it has; the largest parts are {top}; {advice}; or more "
        f"ranks, over which the weights, gradients and optimizer state are sharded. `python -m spmd_rl.layout "
        f"... --memory --device-gib {device:.1f}` prints the table; --plan.no-memory-check starts the run anyway")


def device_memory(device: str, local_rank: int, local_world_size: int, colocate: int) -> int | None:
    """The memory of the GPU this process will use (``trainer.device``, ``pools.colocate``), None on CPU
    runs; read before the process group, without allocating on the GPU."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    from spmd_rl.distributed.pools import gpu_of

    gpu = gpu_of(local_rank, local_world_size, colocate)
    return None if gpu >= torch.cuda.device_count() else int(torch.cuda.get_device_properties(gpu).total_memory)


__all__ = ["FSDP_MEMORY", "GIB", "MEGATRON_MEMORY", "NATIVE_MEMORY", "VLLM_MEMORY", "EngineMemory", "MemoryEstimate",
           "Part", "RankMemory", "RolloutMemory", "check_memory", "device_memory", "estimate_memory", "remedies"]
