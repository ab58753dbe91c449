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

:class:`MegatronCheckpointing` holds the engine's checkpoint methods (``state_dict``,
``load_state_dict``, ``export_weights``) built on these pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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

from spmd_rl.engine.base import lr_lambda

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


# --------------------------------------------------------------------------- the engine's checkpoints


class MegatronCheckpointing:
    """The checkpoint methods of :class:`~spmd_rl.engine.megatron.engine.MegatronEngine` (a mixin:
    they read its model chunks, distributed optimizer, layout, update count and host copies)."""

    def _layout_free(self) -> dict[str, object]:
        """Every weight and AdamW tensor of this rank as :class:`Pieces` of the global tensors
        (views: a DCP load fills them in place); see the module docstring."""
        from megatron.core import parallel_state as ps

        spec, pp = self.spec, self.layout.pp
        ep_rank, etp = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        etp_rank = ps.get_expert_tensor_parallel_rank()
        model: dict[str, tuple] = {}
        segs_of: dict[torch.nn.Parameter, list[Segment]] = {}
        for chunk in self._chunks():
            local_experts = spec.experts // self.layout.ep if spec.experts else 0
            for name, p in chunk.named_parameters():
                full = global_name(name, chunk, expert_offset=ep_rank * local_experts)
                expert = ".local_experts." in full
                tied_copy = spec.tied and pp > 1 and full == VOCAB_PARAMS[1]
                segs = segments(full, p, tp_rank=etp_rank if expert else self.tp_rank,
                                tp_size=etp if expert else self.layout.tp, vocab=spec.vocab, gated=True,
                                tied_copy=tied_copy)
                segs_of[p] = segs
                data = self._parked_params.view(p.detach())
                add_pieces(model, segs, data.reshape(-1), 0, p.numel(), prefix="")
        state: dict[str, object] = {"weights": as_pieces(model)}  # not "model": the export reads that as HF names
        if self.optimizer is not None:
            optim: dict[str, tuple] = {}
            for opt, model_param, main in self._main_params():
                start, end = param_range(opt, model_param)
                tensors = {"param": main, **opt.optimizer.state[main]}
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    flat = self._parked_optimizer.view(self._parked_params.view(tensors[key].detach()))
                    add_pieces(optim, segs_of[model_param], flat.reshape(-1), start, end, prefix=f"{key}/")
            state["optim"] = as_pieces(optim)
        return state

    def _adam_steps(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        return [opt.optimizer.state[main]["step"] for opt, _, main in self._main_params()]

    def _ensure_optimizer_state(self) -> None:
        """Create AdamW state (a zero-lr step: weights unchanged) so a load has tensors to fill."""
        assert self.optimizer is not None
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        if all(opt.optimizer.state for opt in optimizers):
            return
        parked = (bool(self._parked_params.parked), bool(self._parked_optimizer.parked))
        self.onload(optimizer=True)
        for opt in optimizers:
            for group in opt.optimizer.param_groups:
                saved = group["lr"]
                group["lr"] = 0.0
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
                opt.optimizer.step()
                for p in group["params"]:
                    p.grad = None
                group["lr"] = saved
        self._park(params=parked[0], optimizer=parked[1])

    def state_dict(self) -> dict[str, object]:
        """What a resume needs, on any layout: ``weights`` and ``optim`` (the fp32 main weights and
        AdamW moments) as global tensors of which this rank holds its rectangles (see :mod:`.reshard`),
        AdamW's step count and the update count. Offloaded tensors stay offloaded: their entries
        are views of the host copies."""
        if self.optimizer is not None:
            self._ensure_optimizer_state()
        state = self._layout_free()
        if self.optimizer is not None:
            steps = self._adam_steps()
            state["adam_step"] = torch.tensor([float(steps[0]) if steps else 0.0], dtype=torch.float64)
            state["scheduler"] = {"updates": self.updates}
        return state

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full HF-named weights for ``spmd_rl.export`` (see :meth:`_hf_copy`); the
        reference saves nothing."""
        return self._hf_copy() if self.optimizer is not None else {}

    def _hf_copy(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights for ``python -m spmd_rl.export`` (which reads checkpoints in one
        process, with no megatron layout): streamed over every rank (collective), kept on the CPU of
        global rank 0 only, so the checkpoint holds them once. The model's own dtype: fp32 on CPU,
        the bf16 compute weights on GPU."""
        keep = dist.get_rank() == 0
        out = {}
        for name, tensor in self.named_full_tensors():
            if keep:
                out[name] = tensor.detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state: dict[str, object]) -> None:
        """After DCP filled :meth:`state_dict`'s views in place (weights, main weights, moments, on the
        device or in their host copies): AdamW's step count, the update count and this run's LR."""
        if self.optimizer is not None:
            step = float(state["adam_step"][0])  # type: ignore[index]
            for t in self._adam_steps():
                t.fill_(step)
            self.updates = int(state["scheduler"]["updates"])  # type: ignore[index]
            for group in self.optimizer.param_groups:
                group["lr"] = self.actor.lr * lr_lambda(  # type: ignore[union-attr]
                    self.updates, warmup=self.actor.warmup_steps, total=self.total_updates,  # type: ignore[union-attr]
                    schedule=self.actor.lr_schedule, min_ratio=self.actor.min_lr_ratio)  # type: ignore[union-attr]


def param_range(opt, model_param: torch.nn.Parameter) -> tuple[int, int]:
    """The range ``[start, end)`` of the flattened ``model_param`` that this data-parallel rank's
    distributed optimizer owns, from its public range tables (``model_param_gbuf_map``: the
    parameter's buffer, dtype and bucket; ``gbuf_ranges``: each bucket's ``param_map``)."""
    gbuf, dtype, bucket = opt.model_param_gbuf_map[model_param]
    span = opt.gbuf_ranges[gbuf][dtype][bucket]["param_map"][model_param]["param"]
    return span.start, span.end
