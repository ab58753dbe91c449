"""Reward shaping on top of the scores: DAPO's soft overlong punishment.

    from spmd_rl.reward import overlong_penalty
    scores = scores + overlong_penalty(lengths, max_len=4096, buffer=512, factor=1.0)

torch is imported on first call, so importing :mod:`spmd_rl.reward` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union

if TYPE_CHECKING:
    import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: Union["torch.Tensor", Sequence[int]], *, max_len: int, buffer: int, factor: float
) -> "torch.Tensor":
    """DAPO's soft overlong punishment (Yu et al. 2025), one value per response.

    0 for lengths up to ``max_len - buffer``, then falling linearly to ``-factor`` at
    ``max_len``: ``min(-(length - (max_len - buffer)) / buffer * factor, 0)``. As in verl's
    ``dapo`` reward manager (``overlong_buffer_cfg``: ``len`` = buffer, ``penalty_factor`` =
    factor, ``max_resp_len`` = max_len) it is only clamped at 0 from above: a length beyond
    ``max_len`` (which a rollout capped at ``max_len`` never produces) keeps falling below
    ``-factor``. ``lengths`` are the valid response token counts; the result has the shape of
    ``lengths``, floating point (float32 unless ``lengths`` is float64), on its device.
    """
    import torch

    if buffer <= 0:
        raise ValueError(f"overlong buffer must be > 0, got {buffer}")
    if max_len < buffer:
        raise ValueError(f"max_len ({max_len}) must be >= the overlong buffer ({buffer})")
    lengths_t = torch.as_tensor(lengths)
    dtype = lengths_t.dtype if lengths_t.dtype == torch.float64 else torch.float32
    exceed = lengths_t.to(dtype) - float(max_len - buffer)
    # + 0.0 turns the -0.0 of lengths exactly at the threshold into 0.0.
    return (-exceed / float(buffer) * float(factor)).clamp(max=0.0) + 0.0
