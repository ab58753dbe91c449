"""The numbers a memory estimate is made of (:mod:`spmd_rl.memory`), from a model's shape and the config,
each as the code it mirrors computes or allocates it: parameter counts, the activations a token keeps
for the backward, a micro-batch's tokens, the built-in rollout's KV cache, a forward's working set.

    parameter_counts(shape).total                          # == sum(p.numel()) of the built model
    activation_bytes(shape) * micro_tokens(cfg, 64, 8)[0]  # one micro-batch's activations
    kv_cache_bytes(cfg, shape, rows_per_call=256)          # SlotCache.memory_needed, summed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd_rl.config import Config
    from spmd_rl.models.shape import ModelShape

GIB = 2 ** 30
CHUNK_ELEMENTS = 2 ** 28  # the log-prob head's chunk (spmd_rl.engine.head.DEFAULT_CHUNK_ELEMENTS)
PREFILL_TOKENS = 16384  # the rollout's prefill group (spmd_rl.rollout.fast.FastDecoder)


@dataclass(frozen=True)
class Params:
    """Parameter counts of a causal LM from its shape (``tests/test_memory_estimate.py`` checks the total
    against built models)."""

    embed: int
    head: int
    """The LM head's matrix; 0 when tied to the embedding."""
    body: int
    """Decoder layers and the final norm."""
    experts: int
    """The routed experts' weights (inside ``body``)."""
    largest_layer: int

    @property
    def total(self) -> int:
        return self.embed + self.head + self.body


def _widths(s: ModelShape) -> tuple[int, int, int, int]:
    """hidden, q width (heads x head_dim), k / v width, dense MLP width."""
    h = int(s.hidden or 0)
    d = int(s.head_dim or h // s.heads)
    return h, s.heads * d, s.kv_heads * d, int(s.intermediate or 0)


def parameter_counts(s: ModelShape) -> Params:
    h, q, kv, inter = _widths(s)
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv) * s.qkv_bias + h * s.o_bias + 2 * (q // s.heads) * s.qk_norm
    dense = attn + s.norms_per_layer * h + 3 * h * inter
    experts = s.experts * 3 * h * int(s.expert_intermediate or 0)
    shared = 3 * h * s.shared_expert_intermediate + h if s.shared_expert_intermediate else 0
    moe = attn + s.norms_per_layer * h + s.experts * h + experts + shared  # + the router
    embed = int(s.vocab or 0) * h
    return Params(embed=embed, head=0 if s.tied else embed, experts=s.moe_layers * experts,
                  body=(s.layers - s.moe_layers) * dense + s.moe_layers * moe + h,
                  largest_layer=moe if s.moe_layers else dense)


def projection_parameters(s: ModelShape) -> tuple[int, int]:
    """The weights of the attention and dense MLP projections (what ``--rollout.dtype fp8`` holds in FP8)
    and their output rows (one float32 scale each); routed experts and ``lm_head`` are not among them."""
    h, q, kv, inter = _widths(s)
    dense_layers = s.layers - s.moe_layers
    weights = s.layers * (2 * h * q + 2 * h * kv) + dense_layers * 3 * h * inter
    rows = s.layers * (q + 2 * kv + h) + dense_layers * (2 * inter + h)
    return weights, rows


def lora_parameters(s: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters, ``rank x (in + out)`` per target projection of every layer (routed experts are no
    ``nn.Linear``: MoE layers' MLPs get none; ``all-linear``: every projection)."""
    h, q, kv, inter = _widths(s)
    attn = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    mlp = {"gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h}
    names = set(attn) | set(mlp) if tuple(targets) == ("all-linear",) else set(targets)
    return rank * (s.layers * sum(n for k, n in attn.items() if k in names)
                   + (s.layers - s.moe_layers) * sum(n for k, n in mlp.items() if k in names))


def activation_bytes(s: ModelShape, *, checkpointing: bool = False) -> int:
    """Bytes one token keeps for the backward through every decoder layer (bf16; module docstring), plus the
    widest layer's that its backward works in (with checkpointing: each layer's input, one layer recomputed)."""
    h, q, kv, inter = _widths(s)
    attn = 4 * h + 2 * q + 2 * kv + (q + kv) * s.qk_norm  # norms' inputs and outputs, q k v, the output
    fp32 = 4 * (s.heads + 2)  # attention's log-sum-exp and the norms' statistics
    dense = 2 * (attn + 4 * inter) + fp32
    k, e = s.experts_per_token, int(s.expert_intermediate or 0)
    moe = 2 * (attn + k * (2 * h + 4 * e) + 4 * s.shared_expert_intermediate + s.experts) + 4 * s.experts + fp32
    widest = moe if s.moe_layers else dense
    kept = 2 * h * s.layers if checkpointing else (s.layers - s.moe_layers) * dense + s.moe_layers * moe
    return kept + widest + 4 * h


# --------------------------------------------------------------------------- the run's numbers


def lengths(cfg: Config) -> tuple[int, int, int]:
    """A training row's longest length, its response part, and the rollout's longest sequence."""
    episodes = cfg.env.enabled or cfg.agent.fn is not None
    prompt, new = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    response = cfg.env.max_tokens if episodes else new
    return prompt + response, response, prompt + (cfg.env.max_tokens if episodes else 0) + new


def micro_tokens(cfg: Config, rows: int, fixed_rows: int) -> tuple[int, int]:
    """Tokens and response positions of a rank's largest micro-batch out of ``rows`` rows: the token budget
    (``actor.max_tokens_per_gpu``; per rank of a sequence-parallel group) or ``fixed_rows`` longest rows."""
    row, response, _ = lengths(cfg)
    budget, sp = cfg.actor.max_tokens_per_gpu, cfg.actor.fsdp.ulysses_size
    tokens = min(budget * sp, rows * row) if budget is not None else min(fixed_rows, rows) * row
    return tokens // sp, tokens * response // row // sp


def kv_cache_bytes(cfg: Config, s: ModelShape, rows_per_call: int, *, rows: int | None = None) -> int:
    """The built-in rollout's cache, buffers and prefill activations for calls of ``rows_per_call`` rows
    (``SlotCache.memory_needed``, bf16); ``rows``: the cache's rows when not the call's batch bucket."""
    h, q, kv, inter = _widths(s)
    bs = cfg.rollout.batch_size
    buckets = [1 << i for i in range(bs.bit_length()) if (1 << i) < bs] + [bs]
    rows = rows or next(b for b in buckets if b >= min(rows_per_call, bs))
    slots = -(-lengths(cfg)[2] // 64) * 64
    buffers = rows * int(s.vocab or 0) * 8 + (rows_per_call + 1) * slots * 20 + rows * 64  # tokens, log-probs, mask, uniforms
    width = max(q + 2 * kv, 2 * inter if s.moe_layers < s.layers else 0, h)  # the widest fused GEMM
    return 4 * kv * s.layers * rows * slots + buffers + min(PREFILL_TOKENS, rows * slots) * (4 * h + 2 * width) * 2


def forward_bytes(s: ModelShape, tokens: int, positions: int) -> int:
    """A no-grad forward's working set: a layer's widest intermediates and one chunk of bf16 logits."""
    h, q, kv, inter = _widths(s)
    width = max(2 * inter, 2 * s.experts_per_token * int(s.expert_intermediate or 0), q + 2 * kv)
    chunk = max(1, CHUNK_ELEMENTS // max(int(s.vocab or 1), 1))
    return tokens * (4 * h + width) * 2 + min(positions, chunk) * int(s.vocab or 0) * 2


def head_bytes(cfg: Config, s: ModelShape, positions: int, device_bytes: int | None, *, trainable: bool) -> int:
    """The log-prob head in the update (:class:`~spmd_rl.engine.head.ChunkedLogprobs`): its bf16 logits kept for
    the backward when they fit its budget (or are one chunk), else one chunk recomputed; a chunk's bf16
    gradient; and a trainable head's weight gradient, summed over chunks in fp32 next to each chunk's bf16
    part and cast to bf16 at the end."""
    vocab, h = int(s.vocab or 0), int(s.hidden or 0)
    chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    gib = cfg.actor.fsdp.keep_logits_gib
    keep = int(gib * GIB) if gib is not None else (device_bytes or 0) // 16
    kept = positions * vocab * 2 if positions <= chunk or positions * vocab * 2 <= keep else min(positions, chunk) * vocab * 2
    weight = 0 if not trainable else vocab * h * (2 if positions <= chunk else 8)
    return kept + min(positions, chunk) * vocab * 2 + weight


__all__ = ["GIB", "Params", "activation_bytes", "forward_bytes", "head_bytes", "kv_cache_bytes", "lengths",
           "lora_parameters", "micro_tokens", "parameter_counts"]
