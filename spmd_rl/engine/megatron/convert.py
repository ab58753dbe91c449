"""Weights between Hugging Face names and megatron-core's sharded parameters, both ways.

    load_hf_weights(chunks, spec, hf_state)          # full HF tensors -> this rank's shards
    for name, tensor in export_hf_weights(chunks, spec, hf_shapes): ...   # collective, per tensor

Layouts (megatron-core's local spec, per model chunk):

* ``linear_qkv`` fuses q, k, v per query group: for each of the ``kv_heads`` groups, its
  ``heads / kv_heads`` query heads, then its key head, then its value head (rows of ``head_dim``);
  tp ranks hold contiguous runs of whole groups. Biases (Qwen2) follow the same row order. Qwen3's
  ``q_norm`` / ``k_norm`` (one ``head_dim`` weight each, shared by all heads) are megatron's
  ``q_layernorm`` / ``k_layernorm``, replicated over tp.
* ``linear_fc1`` fuses gate and up per tp rank: rank r holds ``[gate_r; up_r]``, the r-th row
  slices of each (column parallel). ``linear_proj`` / ``linear_fc2`` are row parallel (split on dim 1).
* embeddings and the output layer are split on the vocabulary, padded to a multiple of tp with zero
  rows; with tied embeddings the last stage holds its own copy (megatron keeps the two equal by
  all-reducing their gradients over the embedding group).
* MoE (Mixtral, Qwen3-MoE; the same HF names): the router (``mlp.gate``) is replicated; expert e
  lives on ep rank ``e // (experts / ep)`` as local expert ``e % (experts / ep)``, split over etp
  like a dense MLP. HF (transformers 5) keeps the experts fused: ``experts.gate_up_proj [E, 2I, H]``
  (gate rows first) and ``experts.down_proj [E, H, I]``.

Layer ``L`` lives in model chunk ``c = L // (layers / (pp * vpp))``, on pipeline stage ``c % pp``
as virtual stage ``c // pp`` (megatron-core's interleaved assignment). Export gathers a tensor over
tp (and ep) on its stage, splits it into HF tensors and broadcasts those over the pipeline group, so
every rank yields every full tensor, one unit at a time.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from spmd_rl.engine.megatron.model import ModelSpec

HF_LAYER = "model.layers.{}."


# --------------------------------------------------------------------------- fused layouts


def fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q, k, v (weights ``[rows, H]`` or biases ``[rows]``) -> megatron's per-group ``linear_qkv``."""
    g, d = spec.kv_heads, spec.head_dim
    per = spec.heads // g
    tail = q.shape[1:]
    return torch.cat([q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)],
                     dim=1).reshape(-1, *tail)


def split_qkv(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.kv_heads, spec.head_dim
    per = spec.heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, parts: int) -> torch.Tensor:
    """Full ``linear_fc1`` for ``parts`` tp ranks: ``[gate_0; up_0; gate_1; up_1; ...]``."""
    return torch.cat([t for r in range(parts) for t in (gate.chunk(parts)[r], up.chunk(parts)[r])])


def split_gate_up(fc1: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    pieces = fc1.reshape(parts, 2, -1, fc1.shape[-1])
    return pieces[:, 0].reshape(-1, fc1.shape[-1]), pieces[:, 1].reshape(-1, fc1.shape[-1])


def pad_vocab(spec: ModelSpec, table: torch.Tensor, tp: int) -> torch.Tensor:
    extra = spec.padded_vocab(tp) - table.shape[0]
    return torch.cat([table, table.new_zeros(extra, table.shape[1])]) if extra else table


# --------------------------------------------------------------------------- units


class _Ranks:
    """This rank's megatron-core coordinates and groups (read once)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp, self.pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.etp, self.etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        self.etp_group = ps.get_expert_tensor_parallel_group()


def _layer_params(chunks: list[torch.nn.Module]) -> dict[int, tuple[int, torch.nn.Module]]:
    """Global layer index -> (chunk index, layer module) for the layers on this rank."""
    out = {}
    for c, chunk in enumerate(chunks):
        for layer in chunk.decoder.layers:
            out[layer.layer_number - 1] = (c, layer)
    return out


def _layer_units(spec: ModelSpec) -> list[tuple[str, str, tuple[str, ...]]]:
    """(megatron name inside a layer, kind, HF names inside ``model.layers.{L}.``) per layer unit."""
    units = [("input_layernorm.weight", "rep", ("input_layernorm.weight",)),
             ("self_attention.linear_qkv.weight", "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                          "self_attn.v_proj.weight"))]
    if spec.qkv_bias:
        units.append(("self_attention.linear_qkv.bias", "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                                "self_attn.v_proj.bias")))
    if spec.qk_norm:  # Qwen3: per-head norms, replicated over tp
        units += [("self_attention.q_layernorm.weight", "rep", ("self_attn.q_norm.weight",)),
                  ("self_attention.k_layernorm.weight", "rep", ("self_attn.k_norm.weight",))]
    units += [("self_attention.linear_proj.weight", "row", ("self_attn.o_proj.weight",)),
              ("pre_mlp_layernorm.weight", "rep", ("post_attention_layernorm.weight",))]
    if spec.experts:
        units += [("mlp.router.weight", "rep", ("mlp.gate.weight",)),
                  ("mlp.experts.local_experts.{}.linear_fc1.weight", "expert_fc1", ("mlp.experts.gate_up_proj",)),
                  ("mlp.experts.local_experts.{}.linear_fc2.weight", "expert_fc2", ("mlp.experts.down_proj",))]
    else:
        units += [("mlp.linear_fc1.weight", "fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
                  ("mlp.linear_fc2.weight", "row", ("mlp.down_proj.weight",))]
    return units


def _get(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    return module.get_parameter(name)


# --------------------------------------------------------------------------- HF -> megatron


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], spec: ModelSpec, hf: dict[str, torch.Tensor]) -> None:
    """Copy full HF tensors (``hf``: in-memory HF names, e.g. a model's state dict) into this rank's
    shards of every parameter of ``chunks``; raises if a parameter is left unset."""
    r = _Ranks()
    loaded: set[int] = set()

    def put(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
        param = _get(module, name)
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"megatron parameter {name} has shape {tuple(param.shape)}, converted HF value "
                             f"{tuple(value.shape)}")
        param.copy_(value.to(param.dtype))
        loaded.add(id(param))

    embed = hf["model.embed_tokens.weight"]
    head = embed if spec.tied else hf["lm_head.weight"]
    for chunk in chunks:
        if chunk.pre_process:
            put(chunk, "embedding.word_embeddings.weight", pad_vocab(spec, embed, r.tp).chunk(r.tp)[r.tp_rank])
        if chunk.post_process:
            put(chunk, "decoder.final_layernorm.weight", hf["model.norm.weight"])
            if chunk.output_layer.weight is not None:  # None: tied and on the embedding's stage (shared)
                put(chunk, "output_layer.weight", pad_vocab(spec, head, r.tp).chunk(r.tp)[r.tp_rank])
    per_expert = spec.experts // r.ep if spec.experts else 0
    for index, (_c, layer) in _layer_params(chunks).items():
        pre = HF_LAYER.format(index)
        for mname, kind, hnames in _layer_units(spec):
            values = [hf[pre + n] for n in hnames]
            if kind == "rep":
                put(layer, mname, values[0])
            elif kind == "qkv":
                put(layer, mname, fuse_qkv(spec, *values).chunk(r.tp)[r.tp_rank])
            elif kind == "row":
                put(layer, mname, values[0].chunk(r.tp, dim=1)[r.tp_rank])
            elif kind == "fc1":
                put(layer, mname, fuse_gate_up(*values, r.tp).chunk(r.tp)[r.tp_rank])
            else:
                for j in range(per_expert):
                    e = r.ep_rank * per_expert + j
                    if kind == "expert_fc1":
                        gate, up = values[0][e].chunk(2)
                        value = fuse_gate_up(gate, up, r.etp).chunk(r.etp)[r.etp_rank]
                    else:
                        value = values[0][e].chunk(r.etp, dim=1)[r.etp_rank]
                    put(layer, mname.format(j), value)
    missing = [n for chunk in chunks for n, p in chunk.named_parameters() if id(p) not in loaded]
    if missing:
        raise ValueError(f"no Hugging Face weight converted into megatron parameters {missing}")


# --------------------------------------------------------------------------- megatron -> HF


def _gather(local: torch.Tensor, group, parts: int, dim: int) -> torch.Tensor:
    if parts == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(parts)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


@torch.no_grad()
def export_hf_weights(chunks: list[torch.nn.Module], spec: ModelSpec, hf_shapes: dict[str, torch.Size],
                      *, layers_per_chunk: int, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF tensor on every rank, one conversion unit at a time (collective: iterate on
    every rank of the world). ``hf_shapes``: in-memory HF name -> shape, in the order to yield."""
    r = _Ranks()
    layers = _layer_params(chunks)
    device = next(chunks[0].parameters()).device
    param_dtype = next(chunks[0].parameters()).dtype
    pp_total = r.pp

    def stage_of_layer(index: int) -> int:
        return (index // layers_per_chunk) % pp_total

    def emit(hf_values: dict[str, torch.Tensor] | None, names: list[str], stage: int
             ) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            tensor = hf_values[name].contiguous() if hf_values is not None else \
                torch.empty(hf_shapes[name], dtype=param_dtype, device=device)
            if r.pp > 1:
                dist.broadcast(tensor, src=r.pp_ranks[stage], group=r.pp_group)
            yield name, (tensor.to(dtype) if dtype is not None else tensor)

    def vocab_table(chunk_attr: str, pname: str) -> torch.Tensor:
        chunk = next(c for c in chunks if getattr(c, chunk_attr))
        return _gather(_get(chunk, pname).detach(), r.tp_group, r.tp, 0)[:spec.vocab]

    first, last = 0, r.pp - 1
    for name in [n for n in hf_shapes if not n.startswith("model.layers.")]:
        if name == "model.embed_tokens.weight":
            stage = first
            mine = r.pp_rank == stage
            values = {name: vocab_table("pre_process", "embedding.word_embeddings.weight")} if mine else None
        elif name == "lm_head.weight":
            stage = last
            values = {name: vocab_table("post_process", "output_layer.weight")} if r.pp_rank == stage else None
        elif name == "model.norm.weight":
            stage = last
            chunk = next((c for c in chunks if c.post_process), None)
            values = {name: _get(chunk, "decoder.final_layernorm.weight").detach()} if r.pp_rank == stage else None
        else:
            raise ValueError(f"no megatron parameter holds the Hugging Face weight {name!r}")
        yield from emit(values, [name], stage)
    for index in range(spec.layers):
        pre = HF_LAYER.format(index)
        stage = stage_of_layer(index)
        mine = r.pp_rank == stage
        layer = layers[index][1] if mine else None
        for mname, kind, hnames in _layer_units(spec):
            names = [pre + n for n in hnames]
            values = None
            if mine:
                assert layer is not None
                if kind in ("expert_fc1", "expert_fc2"):
                    values = {names[0]: _experts(layer, mname, kind, spec, r)}
                else:
                    local = _get(layer, mname).detach()
                    if kind == "rep":
                        values = {names[0]: local}
                    elif kind == "qkv":
                        values = dict(zip(names, split_qkv(spec, _gather(local, r.tp_group, r.tp, 0))))
                    elif kind == "row":
                        values = {names[0]: _gather(local, r.tp_group, r.tp, 1)}
                    else:
                        values = dict(zip(names, split_gate_up(_gather(local, r.tp_group, r.tp, 0), r.tp)))
            yield from emit(values, names, stage)


def _experts(layer: torch.nn.Module, mname: str, kind: str, spec: ModelSpec, r: _Ranks) -> torch.Tensor:
    """HF's fused ``[E, ...]`` expert tensor from this rank's local experts (gathered over etp and ep)."""
    per_expert = spec.experts // r.ep
    full = []
    for j in range(per_expert):
        local = _get(layer, mname.format(j)).detach()
        if kind == "expert_fc1":
            gate, up = split_gate_up(_gather(local, r.etp_group, r.etp, 0), r.etp)
            full.append(torch.cat([gate, up]))
        else:
            full.append(_gather(local, r.etp_group, r.etp, 1))
    stacked = torch.stack(full)  # [E / ep, ...]
    return _gather(stacked, r.ep_group, r.ep, 0)
