"""The contract every rollout engine meets: :class:`RolloutEngine` and its :class:`GenerationOutput`.

    engine = build_rollout("native", model_folder=folder, device=device, dtype=torch.bfloat16, ...)
    engine.wake_up()
    engine.load_weights(actor.iter_full_weights())          # hot-swap: HF names, full tensors
    out = engine.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=256, seed=step_seed)
    engine.sleep(level=1)                                   # give the device back to the actor

Log-probs returned by an engine are defined exactly as the trainer recomputes them:
``log_softmax(logits / T)`` at the chosen token, ``T = temperature`` (1.0 when greedy), taken from
the full distribution BEFORE top-k / top-p filtering, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

import torch


@dataclass
class GenerationOutput:
    """Responses of one ``generate`` call, ``B = len(prompts) * n`` rows, prompt-major.

    Row ``i * n + j`` is the ``j``-th response to prompt ``i``. ``T`` is the longest response
    produced (at most ``max_new_tokens``). All tensors are on the CPU.
    """

    prompt_ids: list[list[int]]
    """Prompt token ids of each row (length B: row ``i * n + j`` holds prompt ``i``)."""
    response_ids: torch.LongTensor
    """[B, T] generated tokens, right-padded with the pad id."""
    response_mask: torch.Tensor
    """[B, T] float 1.0 on generated tokens (including the EOS token when one was produced), 0 after."""
    logprobs: torch.Tensor
    """[B, T] float32 sampling log-probs of the chosen tokens (see module docstring); 0 where masked."""
    truncated: torch.BoolTensor
    """[B] True where the response reached max_new_tokens without producing an EOS token."""
    weight_swaps: torch.Tensor | None = None
    """[B, T] long: how many weight swaps of a partial rollout came before each token was sampled
    (0 = the weights the call started with); None when the call took no ``swap`` callback."""
    routed_experts: torch.Tensor | None = None
    """[B, T, MoE layers, top_k] int16: the experts each MoE layer chose for each generated token, -1
    where masked (router replay, ``actor.router_replay``); None when the engine records none."""

    @property
    def response_lengths(self) -> torch.LongTensor:
        """[B] number of generated tokens per row."""
        return self.response_mask.sum(-1).long()

    def __post_init__(self) -> None:
        b, t = self.response_ids.shape
        if len(self.prompt_ids) != b:
            raise ValueError(f"GenerationOutput: {len(self.prompt_ids)} prompt rows for {b} response rows")
        for name in ("response_mask", "logprobs"):
            shape = tuple(getattr(self, name).shape)
            if shape != (b, t):
                raise ValueError(f"GenerationOutput.{name} has shape {shape}, expected {(b, t)}")
        if tuple(self.truncated.shape) != (b,):
            raise ValueError(f"GenerationOutput.truncated has shape {tuple(self.truncated.shape)}, expected {(b,)}")


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation engine colocated with the actor, taking turns on the device."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_tokens: int,
        seed: int,
    ) -> GenerationOutput:
        """Sample ``n`` responses per prompt (prompt-major rows); ``temperature == 0`` is greedy.

        The same ``seed`` (and the same engine settings) gives the same responses.
        """
        ...

    @property
    def needs_weights(self) -> bool:
        """True when the engine holds no valid weights (vLLM after a level-2 sleep, which discards
        them): the caller must :meth:`load_weights` before :meth:`generate`."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors with Hugging Face parameter names into the engine's own weights.

        Tensors arrive one by one (streamed), are cast to the engine's dtype and device, and never
        require a second full copy of the model.
        """
        ...

    def sleep(self, level: int) -> None:
        """Give device memory back: 1 frees the KV cache and workspaces, 2 also the weights."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep`; a no-op when awake."""
        ...

    def close(self) -> None:
        """Release everything; the engine is unusable afterwards."""
        ...


def check_sampling_args(
    prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
) -> None:
    """Validate ``generate`` arguments with errors that name the config flags."""
    if n < 1:
        raise ValueError(f"rollout.n must be >= 1, got {n}")
    if temperature < 0:
        raise ValueError(f"rollout.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"rollout.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"rollout.top_k must be >= 0, got {top_k}")
    if max_new_tokens < 1:
        raise ValueError(f"rollout.max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("generate: got no prompts")
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"generate: prompts {empty[:5]} are empty (0 tokens); every prompt needs at least one token")


__all__ = ["GenerationOutput", "RolloutEngine", "check_sampling_args"]
