"""FLOPs of decoder-only LMs, counted from the config, for per-phase MFU.

    fm = FlopsModel.from_config(model.config)
    fm.forward([p + r for p, r in zip(prompts, responses)], head_tokens=sum(responses))  # one forward
    3 * fm.forward(...)                                  # a training pass (backward = 2 x forward)
    fm.rollout(prompt_lens, response_lens)               # prefill + decode of those responses
    model_flops_per_token(config, seq_len=512)           # the classic 6N + 12 L H s estimate

What is counted: the FLOPs of matrix multiplications, 2 per multiply-add, that a causal LM needs
for the work (bias adds, norms, activations, RoPE and softmax are left out, as in every MFU
convention):

* body: every token goes through each layer's q, k, v, o projections (with grouped-query
  attention k and v are ``kv_heads * head_dim`` wide) and its MLP: gate, up and down for gated
  (Llama / Qwen / Mistral) MLPs, up and down otherwise. A mixture-of-experts layer costs its router
  (``hidden x experts``), ``experts_per_token`` expert MLPs and, where the model has one, the shared
  expert and its one-output gate: only ACTIVE experts count;
* attention: ``QK^T`` and ``AV`` are ``2 * 2 * heads * head_dim`` FLOPs per (query, key) pair and
  layer, over the pairs a causal sequence of length s really has, ``s (s + 1) / 2`` (what a varlen
  flash kernel computes; padding and the masked upper triangle are waste, not work);
* head: ``2 * vocab * hidden`` per position whose logits are needed. Input embeddings are a
  lookup (0 FLOPs), so tied and untied heads cost the same.

The trainer's forward runs the head only on positions that predict a response token; the rollout
runs it once per generated token. Gradient-checkpointing and chunked-head recomputation are not
counted (MFU counts the model's FLOPs, not the extra ones an implementation spends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

# Model types whose MLP is up + down only; everything else is assumed Llama-like (gate, up, down).
UNGATED_MLP = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2"}


def _cfg(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"model config {type(config).__name__} has none of the attributes {names}; "
                     "the FLOPs counter supports decoder-only Llama / Qwen / Mistral-shaped models "
                     "(dense or mixture-of-experts)")


def _is_moe_layer(text: Any, index: int, experts: int) -> bool:
    if experts <= 0 or index in (getattr(text, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    return (index + 1) % step == 0


@dataclass(frozen=True)
class FlopsModel:
    """The numbers of a model that its FLOPs depend on (see the module docstring)."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    body_macs: int
    """Multiply-adds one token spends in the matmuls of all layers (active experts only)."""

    @classmethod
    def from_config(cls, config: Any) -> "FlopsModel":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "kv_lora_rank", None) is not None or getattr(text, "q_lora_rank", None) is not None:
            raise ValueError(f"model type {getattr(text, 'model_type', '?')!r} uses multi-head latent attention, "
                             "which the FLOPs counter does not model; MFU needs a Llama / Qwen / Mistral shape")
        hidden = int(_cfg(text, "hidden_size", "n_embd", "d_model"))
        layers = int(_cfg(text, "num_hidden_layers", "n_layer"))
        heads = int(_cfg(text, "num_attention_heads", "n_head"))
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        vocab = int(_cfg(text, "vocab_size"))
        dense_inter = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
        mats = 2 if getattr(text, "model_type", "") in UNGATED_MLP else 3  # up, down (+ gate)
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o, k, v
        experts = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0)
        active = int(getattr(text, "num_experts_per_tok", None) or 0)
        if experts and not active:
            raise ValueError(f"model config has {experts} experts but no num_experts_per_tok")
        expert_inter = int(getattr(text, "moe_intermediate_size", None) or dense_inter)
        shared_inter = int(getattr(text, "shared_expert_intermediate_size", None) or 0)
        body = 0
        for index in range(layers):
            if _is_moe_layer(text, index, experts):
                mlp = hidden * experts + active * mats * hidden * expert_inter  # router + active experts
                if shared_inter:
                    mlp += mats * hidden * shared_inter + hidden  # shared expert + its sigmoid gate
            else:
                mlp = mats * hidden * dense_inter
            body += attn + mlp
        return cls(layers=layers, hidden=hidden, heads=heads, head_dim=head_dim, vocab=vocab, body_macs=body)

    def attention(self, seq_lens: Iterable[int]) -> float:
        """``QK^T`` + ``AV`` FLOPs of causal sequences (``s (s + 1) / 2`` pairs each)."""
        pairs = sum(s * (s + 1) // 2 for s in seq_lens)
        return float(4 * self.layers * self.heads * self.head_dim * pairs)

    def forward(self, seq_lens: Iterable[int], *, head_tokens: int) -> float:
        """FLOPs of one forward over causal sequences of these lengths, with the head (logits) run
        on ``head_tokens`` positions."""
        seq_lens = list(seq_lens)
        return float(2 * self.body_macs * sum(seq_lens) + 2 * self.vocab * self.hidden * head_tokens) \
            + self.attention(seq_lens)

    def rollout(self, prompt_lens: Iterable[int], response_lens: Iterable[int]) -> float:
        """Generating ``r`` tokens after a ``p``-token prompt: prefill and decode feed ``p + r - 1``
        tokens (the last sampled token is never fed back), each attending to all earlier ones, and
        the head runs ``r`` times (prefill's last position, then every decode step)."""
        total = 0.0
        for p, r in zip(prompt_lens, response_lens):
            if r > 0:
                total += self.forward([p + r - 1], head_tokens=r)
        return total


def model_flops_per_token(config: Any, *, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) as ``6 * N + 12 * L * H * seq_len`` (PaLM).

    ``N`` is :attr:`FlopsModel.body_macs` plus the output projection ``vocab * hidden``; the second
    term is attention over the full (not causally halved) ``seq_len`` with ``H = heads * head_dim``.
    A rough per-token figure; per-phase MFU uses :class:`FlopsModel` on the real lengths.
    """
    fm = FlopsModel.from_config(config)
    n_matmul = fm.body_macs + fm.vocab * fm.hidden
    return float(6 * n_matmul + 12 * fm.layers * fm.heads * fm.head_dim * seq_len)


__all__ = ["FlopsModel", "UNGATED_MLP", "model_flops_per_token"]
