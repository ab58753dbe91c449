"""``RolloutBatch``: the responses of one step as they move through the seven stages.

One row per response (one episode, in multi-turn runs: its response holds the model's turns and the
environment's messages between them, ``context_mask``). Tensors are ``[B]`` or ``[B, T]`` (T =
response tokens, right-padded);
prompts stay as token lists since their lengths differ. All ``rollout.n`` responses of a prompt
share a ``group_index`` (the prompt's position in the step's global batch) and stay on one rank,
so group advantages are computed locally.

    batch = RolloutBatch.from_generation(out, group_index=..., pad_token_id=...)
    for micro in batch.split(8):
        inputs = micro.model_inputs(pad_token_id)   # left-padded prompt + right-padded response
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


def pad_columns(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``t [B, T, ...]`` right-padded on dim 1 to ``width`` columns with ``value``."""
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=value)


@dataclass
class ModelInputs:
    """A padded micro-batch ready for a causal LM: ``[pad.. prompt | response ..pad]``.

    Every response starts at column ``prompt_width``; the logits that predict the response are
    positions ``prompt_width - 1 .. prompt_width + T - 2``, which is the last ``T + 1`` positions
    without the final one, so engines can ask the model for only those (``logits_to_keep``).
    """

    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    prompt_width: int
    response_len: int


@dataclass
class RolloutBatch:
    prompts: list[list[int]]
    """Prompt token ids per row (repeated for the n responses of a prompt)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row tensors: response_ids, response_mask, rollout_logprobs, group_index, scores, ..."""
    extras: dict[str, list[Any]] = field(default_factory=dict)
    """Per-row Python values (sample index, answer) that travel with the rows."""

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if value.shape[0] != len(self):
            raise ValueError(f"batch field {key!r} has {value.shape[0]} rows, batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def present_mask(self) -> torch.Tensor:
        """``[B, T]``, 1 on every response token there is: the model's and, in a multi-turn episode,
        the environment's and tools' (``context_mask``), always a prefix of the row. What attention,
        positions and packing see; ``response_mask`` marks the model's tokens only, the ones the
        loss, advantages and metrics count."""
        mask = self.tensors["response_mask"]
        if "context_mask" not in self.tensors:
            return mask
        return mask + self.tensors["context_mask"].to(device=mask.device, dtype=mask.dtype)

    @property
    def response_len(self) -> int:
        return int(self.tensors["response_ids"].shape[1])

    # ------------------------------------------------------------------ slicing
    def select(self, rows: list[int] | range) -> "RolloutBatch":
        rows = list(rows)
        index = torch.tensor(rows, dtype=torch.long)
        return RolloutBatch(
            prompts=[self.prompts[i] for i in rows],
            tensors={k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()},
            extras={k: [v[i] for i in rows] for k, v in self.extras.items()},
        )

    def split(self, size: int) -> Iterator["RolloutBatch"]:
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    def chunks(self, count: int) -> list["RolloutBatch"]:
        """``count`` contiguous, equal parts (the caller guarantees divisibility)."""
        if len(self) % count:
            raise ValueError(f"cannot split {len(self)} rows into {count} equal parts")
        size = len(self) // count
        return [self.select(range(i * size, (i + 1) * size)) for i in range(count)]

    @staticmethod
    def concat(parts: list["RolloutBatch"], pad_token_id: int) -> "RolloutBatch":
        """Join batches row-wise, right-padding ``[B, T, ...]`` tensors to the longest T (with the pad id
        for ``response_ids``, -1 for ``routed_experts``, 0 for the others)."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return RolloutBatch(prompts=[])
        width = max(p.response_len for p in parts)
        tensors: dict[str, torch.Tensor] = {}
        for key in parts[0].tensors:
            pieces = []
            for p in parts:
                t = p.tensors[key]
                if t.dim() >= 2 and t.shape[1] < width:
                    fill = {"response_ids": pad_token_id, "routed_experts": -1}.get(key, 0)
                    t = pad_columns(t, width, fill)
                pieces.append(t)
            tensors[key] = torch.cat(pieces)
        extras = {k: [x for p in parts for x in p.extras[k]] for k in parts[0].extras}
        return RolloutBatch(prompts=[x for p in parts for x in p.prompts], tensors=tensors, extras=extras)

    def to(self, device: torch.device) -> "RolloutBatch":
        return RolloutBatch(self.prompts, {k: v.to(device) for k, v in self.tensors.items()}, self.extras)

    # ------------------------------------------------------------------ model inputs
    def model_inputs(self, pad_token_id: int, device: torch.device | None = None) -> ModelInputs:
        """Left-pad the prompts, append the right-padded responses, and build positions."""
        response_ids = self.tensors["response_ids"]
        response_mask = self.present_mask
        rows, t = response_ids.shape
        width = max(len(p) for p in self.prompts)
        lengths = torch.tensor([len(p) for p in self.prompts], dtype=torch.long)
        prompt_mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
        prompt_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        # the mask's ones, row by row, are each prompt's columns in order: one scatter for the batch
        prompt_ids[prompt_mask.bool()] = torch.tensor([tok for p in self.prompts for tok in p], dtype=torch.long)
        input_ids = torch.cat([prompt_ids, response_ids.cpu().long()], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask.cpu().long()], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        dev = device or response_ids.device
        return ModelInputs(
            input_ids=input_ids.to(dev),
            attention_mask=attention_mask.to(dev),
            position_ids=position_ids.to(dev),
            prompt_width=width,
            response_len=t,
        )
