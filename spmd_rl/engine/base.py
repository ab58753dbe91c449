"""What every training engine is to the rest of the program: the ``TrainEngine`` protocol, and the
pieces both engines share (the loss-function type, the LR schedule, the non-finite-update guard).

    engine: TrainEngine = build_engine("actor", ...)      # spmd_rl.engine: the registry
    logprobs, entropy = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=8)
    stats = engine.train_mini_batch(engine.micro_batches(mini, micro_batch_size=8), loss_fn,
                                    temperature=1.0, need_entropy_grad=False)
    rollout.load_weights(engine.named_full_tensors(dtype=torch.bfloat16))   # hot-swap
    dcp.save({"actor": engine.state_dict()}, ...); engine.load_state_dict(state)

The trainer, the checkpointer, the hot-swap and the export call nothing else. The actor and the
frozen reference are both engines (``trainable`` False: no optimizer, ``train_mini_batch`` refused).
Everything an engine receives is the same whatever its parallel layout: ``[B, T]`` response tensors
in row order, log-probs defined as ``log_softmax(logits / temperature)`` at the sampled token.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch

if TYPE_CHECKING:
    from spmd_rl.data.batch import RolloutBatch

log = logging.getLogger("spmd_rl")

LossFn = Callable[[torch.Tensor, "torch.Tensor | None", "RolloutBatch"], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(logprobs[B,T], entropy[B,T] | None, micro_batch) -> (loss, metrics)``; the loss is
already divided by the GLOBAL normaliser of the mini-batch, so losses of every micro-batch on every
rank add up to the mini-batch objective."""


class TrainEngine(Protocol):
    """A trained or frozen model under some parallel layout, as the trainer sees it.

    Every method is collective over the engine's ranks (the actor pool): call it on all of them.
    """

    config: Any
    """The Hugging Face model config (shapes for FLOP counts, vocabulary, window)."""

    def micro_batches(self, batch: RolloutBatch, *, micro_batch_size: int) -> list[RolloutBatch]:
        """Split one mini-batch into the micro-batches this engine runs (the same count on every rank)."""
        ...

    def compute_logprobs(self, batch: RolloutBatch, *, temperature: float, micro_batch_size: int,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response log-probs ``[B, T]`` (and entropy) of ``batch``, on every rank, in row order."""
        ...

    def train_mini_batch(self, micro_batches: list[RolloutBatch], loss_fn: LossFn, *, temperature: float,
                         need_entropy_grad: bool) -> dict[str, float]:
        """One optimizer step; returns ``grad_norm``, ``lr`` and ``skipped`` (1.0 when a non-finite
        gradient norm made the engine skip the step), the same on every rank."""
        ...

    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight as a full tensor under its Hugging Face name, one at a time."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (for ``torch.distributed.checkpoint``): this rank's shards and state."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, after DCP filled it in place."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights a checkpoint must also hold for ``spmd_rl.export``, when
        :meth:`state_dict` does not hold them under HF names; ``{}`` when it does. Never loaded."""
        ...

    def offload(self) -> None:
        """Between phases: move what is configured to the host (idempotent)."""
        ...

    def onload(self, *, optimizer: bool = False) -> None:
        """Back on the device for compute; the optimizer state too when ``optimizer``."""
        ...


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warmup, then constant or cosine down to
    ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class NonfiniteGuard:
    """Skips optimizer steps whose gradient norm is NaN/inf, at most ``limit`` in a row
    (``actor.skip_nonfinite_updates``), then stops the run with the cause.

    The gradient norm is reduced over every rank of the engine, so all ranks take the same branch.
    """

    def __init__(self, limit: int, role: str = "actor") -> None:
        """``role``: whose update it guards (``actor`` or ``critic``), named in the messages."""
        self.limit, self.role = limit, role
        self.streak = 0
        """Optimizer steps skipped in a row."""

    def skip(self, grad_norm: float, cause: Callable[[], str] | None = None) -> bool:
        """True when the step must be skipped (``grad_norm`` not finite); raises ``FloatingPointError``
        past the limit. ``cause`` explains the NaN (called only for a non-finite norm)."""
        if math.isfinite(grad_norm):
            self.streak = 0
            return False
        self.streak += 1
        why = cause() if cause is not None else "the loss or the model produced NaN/inf"
        if self.streak > self.limit:
            raise FloatingPointError(
                f"non-finite gradient norm ({grad_norm}) in the {self.role} update, {self.streak} update(s) in a row "
                f"({why}). Lower --{self.role}.lr, check the reward values, raise --actor.skip-nonfinite-updates "
                f"(now {self.limit}) to skip such updates, or resume from the last checkpoint; the optimizer "
                "step was skipped and no weights changed")
        log.warning("skipped a%s %s update with a non-finite gradient norm (%s in a row of at most %d): %s",
                    "n" if self.role == "actor" else "", self.role, self.streak, self.limit, why)
        return True


__all__ = ["LossFn", "NonfiniteGuard", "TrainEngine", "lr_lambda"]
