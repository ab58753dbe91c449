"""Resumable epoch-wise prompt sampler (rank 0 draws the step's prompt indices from it).

Each epoch is a fresh permutation of ``range(num_items)`` from a ``torch.Generator`` seeded by
``(seed, epoch)``, so the order depends only on those two numbers and a checkpointed
``(epoch, position)`` reproduces every future batch exactly::

    sampler = PromptSampler(len(train), batch_size=cfg.data.train_batch_size, seed=cfg.data.seed)
    idx = sampler.next_batch()            # list[int]; may span an epoch boundary
    state = sampler.state_dict()          # {"epoch", "position", "num_items", "seed"}
    PromptSampler(len(train), batch_size, seed).load_state_dict(state)
"""

from __future__ import annotations

from typing import Any

import torch

from spmd_rl.seeds import epoch_seed


class PromptSampler:
    """Draws batches of item indices, epoch after epoch, without replacement within an epoch."""

    def __init__(self, num_items: int, batch_size: int, seed: int) -> None:
        if num_items < 1:
            raise ValueError(f"PromptSampler needs at least one prompt, got num_items={num_items}")
        if batch_size < 1:
            raise ValueError(f"data.train_batch_size must be >= 1, got {batch_size}")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation used in ``epoch`` (a pure function of ``seed`` and ``epoch``)."""
        g = torch.Generator()
        g.manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_items, generator=g).tolist()

    def _current(self) -> list[int]:
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        return self._order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` indices; a batch that runs past the epoch's end continues in the
        next epoch's permutation."""
        out: list[int] = []
        while len(out) < self.batch_size:
            order = self._current()
            take = min(self.batch_size - len(out), self.num_items - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = None
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the prompt set and seed must be the ones it was saved with."""
        missing = [k for k in ("epoch", "position") if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}; keys present: {sorted(state)}")
        num_items = state.get("num_items", self.num_items)
        if num_items != self.num_items:
            raise ValueError(
                f"sampler state was saved with {num_items} prompts but this run has {self.num_items}; "
                f"the prompt data (data.path / data.task / data.val_size / data.max_prompt_length) changed"
            )
        seed = state.get("seed", self.seed)
        if seed != self.seed:
            raise ValueError(f"sampler state was saved with data.seed={seed} but this run has data.seed={self.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_items:
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}, num_items={self.num_items}")
        self.epoch, self.position, self._order = epoch, position, None


__all__ = ["PromptSampler"]
