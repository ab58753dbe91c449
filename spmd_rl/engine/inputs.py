"""A micro-batch's forward inputs for the FSDP engine, built on the host and put on the device up front.

    staged = [stage(m, device=dev, pad_token_id=0, packed=True) for m in micro_batches]  # before any forward
    out = model(input_ids=staged[0].input_ids, position_ids=staged[0].position_ids, spmd_attn=staged[0].attn, ...)

:func:`stage` lays the micro-batch out as a ``[R, W]`` grid (:func:`spmd_rl.engine.packing.flatten`,
padded or packed), finds the positions the LM head scores (those predicting a valid response
token; under Ulysses only this rank's column slice ``[lo, lo + W/k)``) and their labels, and the
attention layout (flash varlen runs, or the dense block-causal mask on CPU). On GPU every tensor
goes to the device from pinned memory without blocking (:func:`to_device`): a copy from pageable
memory first waits for all the work queued on the device, so copying inputs between forwards would
leave the GPU idle once per tensor and micro-batch while the host caught up (docs/PERF.md). Staging all
micro-batches before the first forward keeps the queue full.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.data.batch import RolloutBatch

from . import packing, ulysses
from .routing import routes_grid


@dataclass
class Staged:
    """One micro-batch's forward inputs on the device."""

    micro: RolloutBatch  # the micro-batch with its tensors on the device (what loss functions get)
    input_ids: torch.Tensor  # [R, W/k] this rank's columns of the grid
    position_ids: torch.Tensor
    attn: ulysses.AttnSpec
    sel: tuple[torch.Tensor, torch.Tensor]  # scored positions (row, column) in this rank's slice
    labels: torch.Tensor  # [N] the token each scored position predicts
    rows: torch.Tensor  # [B, T] -> the grid cell of every response position
    cols: torch.Tensor
    grid_rows: int
    width: int  # W/k
    index: torch.Tensor | None  # the micro-batch's rows in its batch, when given
    routes: torch.Tensor | None = None  # [R, W/k, MoE layers, top_k] the recorded experts (router replay)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor bound for a GPU goes through pinned memory, without blocking."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def stage(micro: RolloutBatch, *, device: torch.device, pad_token_id: int, packed: bool, flash: bool = False,
          sp_size: int = 1, sp_rank: int = 0, sp_group: dist.ProcessGroup | None = None,
          rows: list[int] | None = None, routes: bool = False) -> Staged:
    """The forward inputs of ``micro`` on ``device`` (module docstring); ``flash``: varlen runs for the
    flash kernel instead of a dense mask; ``rows``: the micro-batch's rows in its batch (kept as
    :attr:`Staged.index`); ``routes``: the rows' ``routed_experts`` laid out as the grid (router replay;
    None when the rows carry none, e.g. validation)."""
    flat = packing.flatten(micro, pad_token_id=pad_token_id, packed=packed, multiple=sp_size)
    width = flat.width // sp_size
    lo = sp_rank * width
    valid = micro["response_mask"].cpu().bool()
    pos_rows, pos_cols = flat.target_rows[valid], flat.target_cols[valid]
    mine = (pos_cols >= lo) & (pos_cols < lo + width)
    sel_rows, sel_cols = pos_rows[mine], pos_cols[mine] - lo  # in this rank's [R, W/k] slice

    def put(t: torch.Tensor) -> torch.Tensor:
        return to_device(t, device)

    if flash:
        cu, longest = ulysses.varlen_runs(flat.segment_ids)
        attn = ulysses.AttnSpec(cu_seqlens=put(cu), max_seqlen=longest, sp_group=sp_group)
    else:  # [R, 1, W, W], built on the device
        attn = ulysses.AttnSpec(mask=ulysses.block_causal_mask(put(flat.segment_ids)), sp_group=sp_group)
    grid = None
    if routes and "routed_experts" in micro:  # the generated tokens' experts, at their cells of this rank's slice
        grid = routes_grid(micro["routed_experts"], target_rows=flat.target_rows, target_cols=flat.target_cols,
                           model_tokens=micro["response_mask"].cpu(), grid_rows=flat.input_ids.shape[0],
                           width=flat.width)[:, lo:lo + width]
    tensors = {k: put(v) for k, v in micro.tensors.items() if k != "routed_experts"}
    return Staged(
        micro=RolloutBatch(micro.prompts, tensors, micro.extras),
        input_ids=put(flat.input_ids[:, lo:lo + width]), position_ids=put(flat.position_ids[:, lo:lo + width]),
        attn=attn, sel=(put(sel_rows), put(sel_cols)), labels=put(flat.labels[:, lo:lo + width][sel_rows, sel_cols]),
        rows=put(flat.target_rows), cols=put(flat.target_cols), grid_rows=flat.input_ids.shape[0], width=width,
        index=None if rows is None else put(torch.tensor(rows, dtype=torch.long)),
        routes=None if grid is None else put(grid.contiguous()))


__all__ = ["Staged", "stage", "to_device"]
