"""What each training engine and rollout backend holds on a GPU, in :class:`Part` s with the phases of a
step they are there in; the registries hand these to the estimate (``EngineSpec.memory``,
``BackendSpec.memory``), so nothing in :mod:`spmd_rl.memory` branches on an engine's name.

    parts, forward = FSDP_MEMORY.actor(cfg, plan, shape, device_bytes)   # the actor's parts, its forward
    NATIVE_MEMORY.parts(cfg, plan, shape, device_bytes, pool=False)      # a colocated rollout's
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .counts import (
    Params, activation_bytes, forward_bytes, head_bytes, kv_cache_bytes, lora_parameters, micro_tokens,
    parameter_counts, projection_parameters,
)

if TYPE_CHECKING:
    from spmd_rl.config import Config
    from spmd_rl.models.shape import ModelShape

GENERATE, LOGPROBS, UPDATE, CRITIC = "generate", "log-probs", "update", "critic update"
STEP = (GENERATE, LOGPROBS, UPDATE, CRITIC)
Plan = Any
"""A :class:`spmd_rl.plan.Plan` (not imported: ``plan()`` imports this package)."""
Remedies = list[tuple[str, dict[str, Any]]]
"""Changes that lower a rank's memory: (the flags as typed, {dotted config field: value})."""


@dataclass(frozen=True)
class Part:
    """One thing on the GPU: its bytes and the phases of a step it is there in."""

    name: str
    bytes: int
    phases: frozenset[str]



def _phases(everywhere: bool, some: tuple[str, ...]) -> frozenset[str]:
    return frozenset(STEP if everywhere else some)


def _mini_batch_rows(cfg: Config, p: Plan) -> int:
    return cfg.actor.ppo_mini_batch_size // p.dp_size * cfg.rollout.n


# --------------------------------------------------------------------------- what each engine holds


def fsdp_trainable(cfg: Config, p: Plan, s: ModelShape, device_bytes: int | None, *,
                   critic: bool = False) -> tuple[list[Part], int]:
    """The FSDP engine's actor (or critic: a value head, no LoRA): its parts, and the transient of its own
    no-grad forward (the old log-probs)."""
    f, params = cfg.actor.fsdp, parameter_counts(s)
    if critic:
        params = Params(params.embed, int(s.hidden or 0), params.body, params.experts, params.largest_layer)
    lora = 0 if critic or not cfg.actor.lora.enabled else cfg.actor.lora.rank
    trained = lora_parameters(s, lora, cfg.actor.lora.targets) if lora else params.total
    shard, name, work = p.fsdp.fsdp_size, "critic" if critic else "actor", CRITIC if critic else UPDATE
    sharded = f.wrap_one_rank or p.fsdp.size > 1 or f.ulysses_size > 1
    if not sharded:  # the plain module's bf16 copies of its fp32 weights (a LoRA base is bf16 already)
        copies = 2 * trained
    elif not f.reshard_after_forward or (shard == 1 and f.gather_once):
        copies = 2 * (params.total + trained * bool(lora))
    else:  # the root (embeddings, head) and two layers gathered at a time
        copies = 2 * (params.embed + params.head + 2 * params.largest_layer)
    tokens, positions = micro_tokens(cfg, _mini_batch_rows(cfg, p),
                                     cfg.critic.micro_batch_size if critic else cfg.actor.micro_batch_size)
    acts = tokens * activation_bytes(s, checkpointing=cfg.model.checkpointing_on("cuda"))
    # the backward's bf16 gradients of the layers while their activations go (one rank), or a layer's bf16 and
    # fp32 unsharded gradients at a time (FSDP); the head's are the logits part's
    layers = 0 if lora else 2 * (params.total - params.embed - params.head)
    backward = max(0, layers - acts) if not sharded else 12 * params.largest_layer * (lora == 0)
    held = _phases(not f.param_offload, (LOGPROBS, work))
    parts = [Part(f"{name} weights", (4 * trained + 2 * params.total * bool(lora)) // shard, held),
             Part(f"{name} gradients", 4 * trained // shard, held),
             Part(f"{name} optimizer state", 8 * trained // shard, _phases(not f.optimizer_offload, (work,))),
             Part(f"{name} {'gathered weights' if sharded else 'bf16 copies'}", copies, frozenset({work})),
             Part(f"{name} activations", acts, frozenset({work})),
             Part(f"{name} backward gradients", backward, frozenset({work}))]
    if not critic:
        parts.append(Part("log-prob head", head_bytes(cfg, s, positions, device_bytes, trainable=not lora), frozenset({UPDATE})))
    rows = cfg.data.train_batch_size // p.dp_size * cfg.rollout.n
    return parts, copies + forward_bytes(s, *micro_tokens(cfg, rows, cfg.actor.micro_batch_size))


def frozen(name: str, s: ModelShape, shard: int, offload: bool, tokens: int, positions: int, *,
           bf16: bool = False, classifier: bool = False) -> tuple[Part, int]:
    """A frozen model (reference, teacher, reward model): its weights (fp32, or bf16 under megatron) over
    ``shard`` ranks, and its forward's transient (bf16 copies on one rank, else the root and two layers)."""
    params = parameter_counts(s)
    total = params.total - params.head + int(s.hidden or 0) if classifier else params.total
    copies = 0 if bf16 else 2 * (total if shard == 1 else params.embed + params.head + 2 * params.largest_layer)
    weights = Part(f"{name} weights", (2 if bf16 else 4) * total // shard, _phases(not offload, (LOGPROBS,)))
    return weights, copies + forward_bytes(s, tokens, 0 if classifier else positions)


def _fsdp_reference(cfg: Config, p: Plan, s: ModelShape, tokens: int, positions: int) -> tuple[Part, int]:
    return frozen("reference", s, p.fsdp.fsdp_size, cfg.ref.param_offload, tokens, positions)


def _fsdp_remedies(cfg: Config) -> Remedies:
    f, out = cfg.actor.fsdp, []
    if not (f.param_offload and f.optimizer_offload):
        out.append(("--actor.fsdp.param-offload --actor.fsdp.optimizer-offload",
                    {"actor.fsdp.param_offload": True, "actor.fsdp.optimizer_offload": True}))
    if not cfg.actor.lora.enabled:
        out.append(("--actor.lora.rank 16", {"actor.lora.rank": 16}))
    return out


def megatron_actor(cfg: Config, p: Plan, s: ModelShape, device_bytes: int | None) -> tuple[list[Part], int]:
    """The megatron engine's actor (module docstring); its no-grad forward's transient is not counted."""
    m, lay, params = cfg.actor.megatron, p.megatron, parameter_counts(s)
    vocab = params.embed + params.head if lay.pp == 1 else max(params.embed, params.head or params.embed)
    dense = (params.body - params.experts) / lay.pp / lay.tp + vocab / lay.tp
    experts = params.experts / lay.pp / (lay.ep * lay.etp)
    rows = _mini_batch_rows(cfg, p)
    tokens, _ = micro_tokens(cfg, rows, cfg.actor.micro_batch_size)
    in_flight = min(lay.pp, -(-rows // cfg.actor.micro_batch_size))
    split = lay.tp if m.sequence_parallel else 1  # hidden-sized activations split over tp only with sp
    acts = tokens / lay.cp * activation_bytes(s) / lay.pp / split * in_flight
    held = _phases(not m.param_offload, (LOGPROBS, UPDATE))
    return [Part("actor weights", int(2 * (dense + experts)), held),
            Part("actor gradients", int(4 * (dense + experts)), held),
            Part("actor optimizer state", int(12 * (dense / lay.dp_size + experts / lay.expert_dp_size)),
                 _phases(not m.optimizer_offload, (UPDATE,))),
            Part("actor activations", int(acts), frozenset({UPDATE})),
            Part("log-prob head", int(tokens / lay.cp * int(s.vocab or 0) / lay.tp * 8), frozenset({UPDATE}))], 0


def _megatron_reference(cfg: Config, p: Plan, s: ModelShape, tokens: int, positions: int) -> tuple[Part, int]:
    return frozen("reference", s, p.megatron.tp * p.megatron.pp, cfg.ref.param_offload, tokens, positions, bf16=True)


def _megatron_remedies(cfg: Config) -> Remedies:
    m = cfg.actor.megatron
    if m.param_offload and m.optimizer_offload:
        return []
    return [("--actor.megatron.param-offload --actor.megatron.optimizer-offload",
             {"actor.megatron.param_offload": True, "actor.megatron.optimizer_offload": True})]


@dataclass(frozen=True)
class EngineMemory:
    """What a training engine holds (``EngineSpec.memory``): ``actor(cfg, plan, shape, device_bytes)`` ->
    (parts, its no-grad forward's transient), ``reference(cfg, plan, shape, tokens, positions)`` -> (weights,
    forward transient), ``remedies(cfg)`` -> its flags that lower memory."""

    actor: Callable[..., tuple[list[Part], int]]
    reference: Callable[..., tuple[Part, int]]
    remedies: Callable[[Config], Remedies]


FSDP_MEMORY = EngineMemory(actor=fsdp_trainable, reference=_fsdp_reference, remedies=_fsdp_remedies)
MEGATRON_MEMORY = EngineMemory(actor=megatron_actor, reference=_megatron_reference, remedies=_megatron_remedies)


def _native_rollout(cfg: Config, p: Plan, s: ModelShape, device_bytes: int | None, *, pool: bool) -> list[Part]:
    """The built-in rollout: a bf16 copy kept through a level-1 sleep, its KV cache freed at any sleep (a
    rollout pool never sleeps); rows: the larger of a round's and validation's on one rank."""
    level = 0 if pool else cfg.rollout.sleep_level_on("cuda")
    rows = p.rollout_prompts_per_replica * cfg.rollout.n
    if cfg.trainer.val_every > 0 and not pool:  # validation generates on the same engine; its cache only grows
        rows = max(rows, -(-cfg.data.val_size // p.rollout_dp_size) * cfg.trainer.val_n)
    weights = 2 * parameter_counts(s).total
    if cfg.rollout.dtype == "fp8":  # the projections at one byte a weight, plus a float32 scale per row
        projections, rows_out = projection_parameters(s)
        weights += 4 * rows_out - projections
    cache = kv_cache_bytes(cfg, s, rows, rows=cfg.rollout.batch_size if pool and cfg.rollout.stream else None)
    parts = [Part("rollout weights", weights, _phases(level < 2, (GENERATE,))),
             Part("rollout KV cache", cache, _phases(level == 0, (GENERATE,)))]
    return parts + [Part("rollout staging copy", weights, frozenset({GENERATE}))] * (pool and cfg.rollout.stage_weights)


def _vllm_rollout(cfg: Config, p: Plan, s: ModelShape, device_bytes: int | None, *, pool: bool) -> list[Part]:
    share = int(cfg.rollout.gpu_memory_utilization * (device_bytes or 0))  # weights and cache, within its share
    level = 0 if pool else cfg.rollout.sleep_level_on("cuda")
    return [Part("rollout (vLLM's share)", share, _phases(level == 0, (GENERATE,)))]


@dataclass(frozen=True)
class RolloutMemory:
    """What a rollout backend holds (``BackendSpec.memory``): ``parts(cfg, plan, shape, device_bytes, pool=)``
    (``pool``: on a rollout pool of its own), ``remedies(cfg)``."""

    parts: Callable[..., list[Part]]
    remedies: Callable[[Config], Remedies]


NATIVE_MEMORY = RolloutMemory(parts=_native_rollout, remedies=lambda cfg: [
    (f"--rollout.batch-size {cfg.rollout.batch_size // 2}", {"rollout.batch_size": cfg.rollout.batch_size // 2})
] * (cfg.rollout.batch_size > 1))
VLLM_MEMORY = RolloutMemory(parts=_vllm_rollout, remedies=lambda cfg: [
    (f"--rollout.gpu-memory-utilization {cfg.rollout.gpu_memory_utilization / 2:g}",
     {"rollout.gpu_memory_utilization": cfg.rollout.gpu_memory_utilization / 2})])



__all__ = ["CRITIC", "FSDP_MEMORY", "GENERATE", "LOGPROBS", "MEGATRON_MEMORY", "NATIVE_MEMORY", "STEP", "UPDATE",
           "VLLM_MEMORY", "EngineMemory", "Part", "Remedies", "RolloutMemory", "fsdp_trainable", "frozen",
           "megatron_actor"]
