"""Micro-batch layouts for the FSDP engine: padded or packed rows, fixed or token-budget batches.

    rows = micro_batch_rows(lengths, micro_batch_size=8, max_tokens=None, group=g)  # fixed: 8 rows each
    rows = micro_batch_rows(lengths, micro_batch_size=8, max_tokens=4096, group=g)  # dynamic
    flat = flatten(micro, pad_token_id=0, packed=True, multiple=sp)                # what the model eats

``flatten`` turns a :class:`RolloutBatch` micro-batch into a ``[R, W]`` grid plus, for every
response token ``(b, t)``, the grid position whose logits predict it:

* padded (``packed=False``): one row per response, ``[pad.. prompt | response ..pad]`` exactly as
  :meth:`RolloutBatch.model_inputs` builds it;
* packed (``packed=True``): each sequence is its prompt followed by its valid response tokens, no
  padding; sequences are placed first-fit-decreasing into rows of width W = the longest sequence,
  positions restart at 0 per sequence and ``segment_ids`` tell sequences apart, so the attention
  mask is block-diagonal causal. Attention costs at most what padding costs (each row is no wider
  than a padded row) and the per-token work (MLP, projections, head) runs on real tokens only.

W is rounded up to a multiple of ``multiple`` (the Ulysses degree) so sp ranks get equal slices.
The tokens present in a row's response (:attr:`RolloutBatch.present_mask`: the model's, and in a
multi-turn episode the environment's between its turns) are a prefix, which packing relies on.

Dynamic micro-batches (``max_tokens`` set) group rows by their real token count (prompt +
response) so each micro-batch stays within the budget, balanced by longest-first greedy
assignment. FSDP needs every rank to run the same number of forward/backward passes, so the
count is the maximum over ``group`` (an all-reduce); a rank with fewer long rows spreads its rows
over that many micro-batches. The loss stays exact: it is normalised by the global token count of
the mini-batch, not per micro-batch.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_rl.data.batch import RolloutBatch


@dataclass
class FlatBatch:
    """A micro-batch laid out as a ``[R, W]`` grid for the model (W a multiple of the sp degree)."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W]
    segment_ids: torch.Tensor  # [R, W]: sequence index inside the row; -1 = padding
    labels: torch.Tensor  # [R, W]: the next token, i.e. what the logits at each position predict
    target_rows: torch.Tensor  # [B, T]: row of the position that predicts response token (b, t)
    target_cols: torch.Tensor  # [B, T]: its column (0 where the response mask is 0)
    packed: bool

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _labels(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    return torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=pad_token_id)


def flatten(micro: RolloutBatch, *, pad_token_id: int, packed: bool, multiple: int = 1) -> FlatBatch:
    """The model inputs of ``micro`` in the padded or packed layout (CPU tensors)."""
    return _packed(micro, pad_token_id, multiple) if packed else _padded(micro, pad_token_id, multiple)


def _padded(micro: RolloutBatch, pad_token_id: int, multiple: int) -> FlatBatch:
    inputs = micro.model_inputs(pad_token_id, torch.device("cpu"))
    extra = _round_up(inputs.input_ids.shape[1], multiple) - inputs.input_ids.shape[1]
    ids = torch.nn.functional.pad(inputs.input_ids, (0, extra), value=pad_token_id)
    mask = torch.nn.functional.pad(inputs.attention_mask, (0, extra), value=0)
    pos = torch.nn.functional.pad(inputs.position_ids, (0, extra), value=0)
    rows, t = len(micro), inputs.response_len
    cols = torch.arange(t) + inputs.prompt_width - 1  # position i predicts token i + 1
    return FlatBatch(
        input_ids=ids, position_ids=pos, segment_ids=torch.where(mask.bool(), 0, -1), labels=_labels(ids, pad_token_id),
        target_rows=torch.arange(rows)[:, None].expand(rows, t).contiguous(),
        target_cols=cols[None].expand(rows, t).contiguous(), packed=False,
    )


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of capacity ``width`` (each length <= width)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(width - lengths[i])
    return bins


def _packed(micro: RolloutBatch, pad_token_id: int, multiple: int) -> FlatBatch:
    response_ids, mask = micro["response_ids"].cpu(), micro.present_mask.cpu()
    rows, t = response_ids.shape
    resp_lens = mask.sum(1).long().tolist()
    prompt_lens = [len(p) for p in micro.prompts]
    lengths = [p + r for p, r in zip(prompt_lens, resp_lens)]
    width = _round_up(max(lengths), multiple)
    bins = first_fit_decreasing(lengths, width)
    bin_of, slot, offset = [0] * rows, [0] * rows, [0] * rows  # each sequence's grid row, index in it, start column
    for r, members in enumerate(bins):
        col = 0
        for s, i in enumerate(members):
            bin_of[i], slot[i], offset[i] = r, s, col
            col += lengths[i]
    # Whole-batch index arithmetic (a few tensor ops, not a handful per sequence): every real token's
    # place in the flattened grid, prompt tokens and valid response tokens (a prefix of each row) apart.
    b, s_, o = (torch.tensor(x, dtype=torch.long) for x in (bin_of, slot, offset))
    p, n = torch.tensor(prompt_lens, dtype=torch.long), torch.tensor(resp_lens, dtype=torch.long)
    start = b * width + o  # flat index of each sequence's first token

    def spread(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (sequence, index inside) per token
        seq = torch.repeat_interleave(torch.arange(rows), counts)
        return seq, torch.arange(len(seq)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)

    p_seq, p_at = spread(p)
    r_seq, r_at = spread(n)
    p_dst, r_dst = start[p_seq] + p_at, start[r_seq] + p[r_seq] + r_at
    ids = torch.full((len(bins) * width,), pad_token_id, dtype=torch.long)
    pos = torch.zeros(len(bins) * width, dtype=torch.long)
    seg = torch.full((len(bins) * width,), -1, dtype=torch.long)
    ids[p_dst] = torch.tensor([tok for prompt in micro.prompts for tok in prompt], dtype=torch.long)
    ids[r_dst] = response_ids.long()[mask.bool()]
    pos[p_dst], pos[r_dst] = p_at, p[r_seq] + r_at
    seg[p_dst], seg[r_dst] = s_[p_seq], s_[r_seq]
    ids, pos, seg = (x.view(len(bins), width) for x in (ids, pos, seg))
    j = torch.arange(t)[None]
    valid = j < n[:, None]  # position o + p - 1 + j predicts response token j
    target_rows = torch.where(valid, b[:, None], 0)
    target_cols = torch.where(valid, j + (o + p - 1)[:, None], 0)
    return FlatBatch(input_ids=ids, position_ids=pos, segment_ids=seg, labels=_labels(ids, pad_token_id),
                     target_rows=target_rows, target_cols=target_cols, packed=True)


# --------------------------------------------------------------------------- micro-batches


def row_tokens(batch: RolloutBatch) -> list[int]:
    """Real tokens per row: prompt + valid response."""
    resp = batch.present_mask.sum(1).long().tolist()
    return [len(p) + r for p, r in zip(batch.prompts, resp)]


def balanced_partition(lengths: list[int], count: int) -> list[list[int]]:
    """``count`` non-empty groups of row indices (count <= len) with near-equal token sums.

    Longest row first into the currently lightest group; each group keeps its rows in order.
    """
    if not 1 <= count <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} rows into {count} non-empty micro-batches")
    heap = [(0, g) for g in range(count)]
    groups: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], g))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _fits(groups: list[list[int]], lengths: list[int], max_tokens: int) -> bool:
    # a row longer than the budget is allowed alone (config validation normally rules it out)
    return all(len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups)


def min_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """Fewest balanced groups that keep every group within ``max_tokens``."""
    count = max(1, math.ceil(sum(lengths) / max_tokens))
    while count < len(lengths) and not _fits(balanced_partition(lengths, count), lengths, max_tokens):
        count += 1
    return min(count, len(lengths))


def micro_batch_rows(lengths: list[int], *, micro_batch_size: int, max_tokens: int | None,
                     group: dist.ProcessGroup | None) -> list[list[int]]:
    """Row indices of each micro-batch; the same number of micro-batches on every rank of ``group``.

    Fixed (``max_tokens`` None): contiguous runs of ``micro_batch_size`` rows (equal row counts on
    all ranks give equal counts). Dynamic: token-budget groups, count all-reduced to the maximum.
    Collective over ``group`` when dynamic.
    """
    n = len(lengths)
    if max_tokens is None:
        return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
    count = torch.tensor([min_micro_batches(lengths, max_tokens) if n else 0], dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    count_i = int(count.item())
    if count_i > n:
        raise ValueError(
            f"dynamic micro-batches: another rank needs {count_i} micro-batches but this rank has only {n} rows; "
            "every rank must hold the same number of rows"
        )
    return balanced_partition(lengths, count_i) if n else []


__all__ = ["FlatBatch", "balanced_partition", "first_fit_decreasing", "flatten", "micro_batch_rows",
           "min_micro_batches", "row_tokens"]
