"""Layout-free checkpoints of the megatron engine: every weight and every AdamW tensor under its
megatron GLOBAL name with its full (un-split) shape, each rank holding the rectangles it owns, so
DCP reads any saved layout into any other (tp, pp, vpp, dp, ep) one.

    out = {}
    add_pieces(out, segments(name, param, ...), param.view(-1), 0, param.numel(), prefix="")
    state = {"weights": as_pieces(out), ...}       # MegatronEngine.state_dict (with "optim")
    dcp.save(state, ...)  /  dcp.load(state, ...)  # in place, on any layout

Names: a chunk's ``decoder.layers.{i}`` becomes the model's global layer number (pp and vpp
offsets), an expert's ``local_experts.{j}`` its global expert number (ep offset). Shapes: a tp-split
parameter (``tensor_model_parallel``, split along ``partition_dim``) is stored whole; the fused
gate/up projection of SwiGLU (``linear_fc1``: [gate shard; up shard] per tp rank, so its concatenation
over tp depends on tp) is stored as two tensors, ``.../gate`` and ``.../up``; the embedding and the
output layer keep their ``spec.vocab`` real rows (the padding rows depend on tp, and never train).
Every tensor is stored 2-D (1-D ones as ``[n, 1]``). With tied embeddings and pp > 1 the last stage's
copy of the embedding is read from the embedding's entries and not written (the two copies are equal).

AdamW's state lives in the distributed optimizer as one contiguous range of each flattened tp-local
parameter per data-parallel rank; a range becomes at most three rectangles per stored tensor (a
partial first row, whole rows, a partial last row). Together the ranks cover each tensor once, as
DCP requires. The entries per parameter: ``param`` (the fp32 main weight on GPU; the weight itself
on CPU), ``exp_avg``, ``exp_avg_sq``; AdamW's step count is restored from the engine's update count.

A rectangle set is a :class:`Pieces`: a tensor subclass with no data of its own that implements the
three hooks DCP calls on DTensors (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), its rectangles being views into the real tensors: a load writes them in
place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


class Pieces(torch.Tensor):
    """Rectangles of one global tensor held by this rank, for DCP (see the module docstring)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor, bool]]):
        first = pieces[0][1]
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=first.dtype, device=first.device)
        self.pieces = {tuple(off): t for off, t, _ in pieces}
        self.written = [tuple(off) for off, _, write in pieces if write]  # the others are only read
        return self

    def __repr__(self) -> str:  # the wrapper has no data to print
        return f"Pieces(shape={tuple(self.shape)}, {len(self.pieces)} rectangles)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"Pieces is a checkpoint view, not a tensor: {func} is not supported")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape),
                              properties=TensorProperties.create_from_tensor(t), size=self.shape))
                for off, t in ((off, self.pieces[off]) for off in self.written)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape) for off, t in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[tuple(index.offset)]


@dataclass(frozen=True)
class Segment:
    """A block of a flattened tp-local parameter that is a rectangle of one global 2-D tensor."""

    key: str
    base: int  # its first element in the flattened local parameter
    rows: int
    cols: int
    row0: int  # its place in the global tensor
    col0: int
    shape: tuple[int, int]  # the global tensor's
    row_limit: int  # global rows from here on are padding: not stored
    write: bool = True  # False: a copy whose entries another rank writes (tied output layer)


def global_name(name: str, chunk: torch.nn.Module, *, expert_offset: int) -> str:
    """The megatron name of a chunk's parameter in the whole model (see the module docstring)."""
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
    m = _EXPERT.search(name)
    if m:
        name = name[:m.start()] + f".local_experts.{int(m.group(1)) + expert_offset}." + name[m.end():]
    return name


def segments(name: str, param: torch.Tensor, *, tp_rank: int, tp_size: int, vocab: int, gated: bool,
             tied_copy: bool = False) -> list[Segment]:
    """How ``param`` (tp-local, under its global ``name``) lies in the stored global tensors."""
    if param.dim() > 2:
        raise ValueError(f"{name}: {param.dim()}-D parameters are not supported by the layout-free checkpoint")
    rows, cols = (param.shape[0], 1) if param.dim() == 1 else tuple(param.shape)
    split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
    dim = getattr(param, "partition_dim", 0) if split else 0
    if split and dim not in (0, 1):
        raise ValueError(f"{name}: split along dim {dim}; the layout-free checkpoint handles dims 0 and 1")
    limit_of = (lambda r: vocab) if name in VOCAB_PARAMS else (lambda r: r)
    key = VOCAB_PARAMS[0] if tied_copy else name
    if gated and re.search(r"linear_fc1\.(weight|bias)$", name):  # [gate; up] per tp rank, whatever tp
        half, n = rows // 2, tp_size if split else 1
        return [Segment(f"{key}/{part}", i * half * cols, half, cols, (tp_rank if split else 0) * half, 0,
                        (half * n, cols), half * n) for i, part in enumerate(("gate", "up"))]
    if not split:
        return [Segment(key, 0, rows, cols, 0, 0, (rows, cols), limit_of(rows), not tied_copy)]
    if dim == 0:
        shape = (rows * tp_size, cols)
        return [Segment(key, 0, rows, cols, tp_rank * rows, 0, shape, limit_of(shape[0]), not tied_copy)]
    return [Segment(key, 0, rows, cols, 0, tp_rank * cols, (rows, cols * tp_size), rows, not tied_copy)]


def rectangles(segs: Iterable[Segment], start: int, end: int
               ) -> Iterable[tuple[Segment, tuple[int, int], int, tuple[int, int]]]:
    """The rectangles of elements ``[start, end)`` of a flattened local parameter: ``(segment,
    global offset, position of its first element relative to start, (rows, cols))``; rows past a
    segment's ``row_limit`` are left out."""
    for seg in segs:
        lo, hi = max(start, seg.base), min(end, seg.base + seg.rows * seg.cols)
        while lo < hi:
            r, c = divmod(lo - seg.base, seg.cols)
            if c or hi - lo < seg.cols:  # a partial row
                n_rows, n_cols = 1, min(seg.cols - c, hi - lo)
            else:  # whole rows
                n_rows, n_cols = (hi - lo) // seg.cols, seg.cols
            g_row = seg.row0 + r
            keep = min(n_rows, seg.row_limit - g_row)
            if keep > 0:
                yield seg, (g_row, seg.col0 + c), lo - start, (keep, n_cols)
            lo += n_rows * n_cols


def add_pieces(out: dict[str, tuple[tuple[int, int], list]], segs: list[Segment], flat: torch.Tensor, start: int,
               end: int, *, prefix: str) -> None:
    """Views of ``flat`` (elements ``[start, end)`` of a flattened local parameter) into ``out``."""
    for seg, offset, pos, (n_rows, n_cols) in rectangles(segs, start, end):
        entry = out.setdefault(f"{prefix}{seg.key}", (seg.shape, []))
        entry[1].append((offset, flat[pos:pos + n_rows * n_cols].view(n_rows, n_cols), seg.write))


def as_pieces(out: dict[str, tuple[tuple[int, int], list]]) -> dict[str, Pieces]:
    return {key: Pieces(shape, pieces) for key, (shape, pieces) in out.items()}
