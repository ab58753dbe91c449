"""Print every rank's pools, mesh coordinates and groups for a config, with no processes started.

    python -m spmd_rl.layout --config configs/gsm8k.yaml --world-size 16 --nproc-per-node 8
    python -m spmd_rl.layout --model.path /models/Qwen2.5-7B-Instruct --actor.engine megatron --actor.megatron.tp 2 --world-size 8 --json
    python -m spmd_rl.layout --pools.rollout-ranks 2 --pools.colocate 2 --world-size 4 --nproc-per-node 4
    python -m spmd_rl.layout --model.path tiny-random --world-size 2 --memory --device-gib 80

Takes every flag of ``spmd_rl.train`` (same config loading) plus its own. It runs the same
validation as the trainer (:func:`spmd_rl.plan.plan`), so an invalid layout exits non-zero
with the trainer's message; it reads the model's heads and layers from ``--model.path`` when this
machine has it (:func:`spmd_rl.models.shape.read_model_shape`) and checks tp / pp / sp against them. The text output is tables (ranks, then groups); ``--json`` prints one
object ``{"world_size", "pools", "ranks": [...], "groups": {"<mesh>.<axis>": [[global ranks], ...]}}``;
each rank has its ``"pools"`` (name -> rank in that pool) and its ``"gpu"`` (device index on its node,
from ``--nproc-per-node`` and ``--pools.colocate``). The rollout's groups (``rollout.tp`` / ``.pp`` /
``.dp``) are made of the rollout pool's ranks when it has one. ``--memory`` adds each pool's per-rank
memory estimate (:mod:`spmd_rl.memory`, from the model's shape: a table of its parts per phase of a step);
with ``--device-gib G`` the estimate is checked against a GPU of G GiB as the trainer checks it (exit 2
with its message when over, unless ``--plan.no-memory-check``). The JSON has it as ``"memory"`` (null
without the shape).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Annotated, Any

import tyro

from spmd_rl.config import load_config
from spmd_rl.models.shape import read_model_shape
from spmd_rl.plan import Plan, plan
from spmd_rl.engine import engine_spec


@dataclass(kw_only=True)
class LayoutFlags:
    """Flags of the layout printer (besides all training flags)."""

    world_size: Annotated[int | None, tyro.conf.arg(help="Number of processes of the run (required).")] = None
    nproc_per_node: Annotated[
        int | None, tyro.conf.arg(help="Processes (GPUs) per node, to show node and local rank of each rank.")
    ] = None
    json: Annotated[bool, tyro.conf.arg(help="Print one JSON object instead of tables.")] = False
    memory: Annotated[bool, tyro.conf.arg(help=(
        "Also print each pool's per-rank GPU memory estimate (needs the model's shape: --model.path a local "
        "folder, .gguf file or built-in name)."))] = False
    device_gib: Annotated[float | None, tyro.conf.arg(help=(
        "GPU memory per device in GiB (e.g. 139.8 for an H200, 79.1 for an 80 GB H100) to check the estimate "
        "against, as spmd_rl.train does on the GPU; unset: the estimate is printed, not checked."))] = None


def describe(p: Plan) -> dict[str, Any]:
    """The JSON-able description of a plan: per-rank coordinates and every group, in global ranks."""
    layouts = p.layouts()
    ranks = []
    for r in range(p.world_size):
        entry: dict[str, Any] = {
            "rank": r, "node": p.node(r), "local_rank": p.local_rank(r), "gpu": p.gpu(r),
            "pools": {s.name: s.local_rank(r) for s in p.pools if s.contains(r)},
        }
        for name in ("fsdp", "ulysses", "megatron", "rollout"):
            entry[name] = None
        for name, (pool, lay) in layouts.items():
            coords = lay.coords(pool.local_rank(r)) if pool.contains(r) else None
            if "." in name:  # reward.fsdp -> entry["reward"]["fsdp"]
                head, tail = name.split(".", 1)
                if coords is not None:
                    entry.setdefault(head, {})[tail] = coords
                else:
                    entry.setdefault(head, None)
            else:
                entry[name] = coords
        ranks.append(entry)
    groups: dict[str, list[list[int]]] = {}
    for name, (pool, lay) in layouts.items():
        for axis, axis_groups in lay.groups().items():
            groups[f"{name}.{axis}"] = [[pool.start + x for x in g] for g in axis_groups]
    return {
        "world_size": p.world_size,
        "nproc_per_node": p.nproc_per_node,
        "engine": p.engine,
        "engine_models": engine_spec(p.engine).models(),
        "model": None if p.model is None else dataclasses.asdict(p.model),
        "colocate": p.colocate,
        "pools": [{"name": s.name, "start": s.start, "size": s.size} for s in p.pools],
        "memory_fractions": dict(p.memory_fractions),
        "actor_dp_size": p.dp_size,
        "rollout_dp_size": p.rollout_dp_size,
        "unavailable": dict(p.unavailable),
        "warnings": list(p.warnings),
        "memory": None if p.memory is None else p.memory.to_dict(),
        "ranks": ranks,
        "groups": groups,
    }


def _table(spans: list[tuple[str, list[str]]], rows: list[list[str]]) -> list[str]:
    """Right-aligned columns under a two-level header: (group title, column names) spans."""
    names = [c for _, cols in spans for c in cols]
    widths = [max(len(n), *(len(row[i]) for row in rows)) for i, n in enumerate(names)]
    top, i = [], 0
    for title, cols in spans:
        w = sum(widths[i:i + len(cols)]) + 2 * (len(cols) - 1)
        if len(title) > w:  # widen the span's last column so its title fits
            widths[i + len(cols) - 1] += len(title) - w
            w = len(title)
        top.append(title.ljust(w))
        i += len(cols)
    lines = ["  ".join(top).rstrip(), "  ".join(n.rjust(w) for n, w in zip(names, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return lines


def render(p: Plan) -> str:
    """Human-readable tables of a plan."""
    d = describe(p)
    out = []
    nodes = f" = {p.num_nodes} nodes x {p.nproc_per_node} processes" if p.nproc_per_node else ""
    out.append(f"world size {p.world_size}{nodes}; actor engine {p.engine}; "
               f"actor data-parallel size {p.dp_size}; rollout data-parallel size {p.rollout_dp_size}")
    out.append(f"actor engine {p.engine} trains: {engine_spec(p.engine).models()}")
    out.append(f"model {p.model.describe()}" if p.model is not None else
               "model: not a local folder, .gguf file or built-in name here: its heads and layers are not checked")
    out.append("pools: " + "; ".join(f"{s.name} = global ranks {s.start}..{s.end - 1} ({s.size})" for s in p.pools))
    for name, why in p.unavailable.items():
        out.append(f"{name}: n/a ({why})")
    for warning in p.warnings:
        out.append(f"warning: {warning}")
    out.append("")
    # the tables show the engine in use; --json has every valid layout
    other = sorted(k for k in p.layouts_by_name if k not in p.actor_meshes)
    layouts = {k: v for k, v in p.layouts().items() if k not in other}
    if len(layouts) < len(p.layouts()):
        out.append(f"({'/'.join(other)} left out: the actor engine is {p.engine}; --json lists every layout)")
    if p.colocate > 1:
        out.append(f"{p.colocate} processes per GPU; GPU memory share per process: "
                   + ", ".join(f"{k} {v:.2f}" for k, v in p.memory_fractions.items()))
    spans: list[tuple[str, list[str]]] = [("", ["rank", "node", "local", "gpu"]), ("pools", [s.name for s in p.pools])]
    for name, (_, lay) in layouts.items():
        spans.append((name, list(lay.coords(0))))
    rows = []
    for e in d["ranks"]:
        row = [str(e["rank"]), "-" if e["node"] is None else str(e["node"]),
               "-" if e["local_rank"] is None else str(e["local_rank"]), "-" if e["gpu"] is None else str(e["gpu"])]
        row += [str(e["pools"].get(s.name, "-")) for s in p.pools]
        for name, (pool, lay) in layouts.items():
            axes = list(lay.coords(0))
            coords = lay.coords(pool.local_rank(e["rank"])) if pool.contains(e["rank"]) else None
            row += ["-" if coords is None else str(coords[a]) for a in axes]
        rows.append(row)
    out += _table(spans, rows)
    out.append("")
    out.append("groups (global ranks):")
    shown = {key: g for key, g in d["groups"].items() if key.rsplit(".", 1)[0] in layouts}
    width = max(len(k) for k in shown)
    for key, groups in shown.items():
        out.append(f"  {key.ljust(width)}  " + " ".join("[" + " ".join(map(str, g)) + "]" for g in groups))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, flags = load_config(argv, prog="spmd_rl.layout", extra=LayoutFlags, description=__doc__)
        if flags.world_size is None:
            raise ValueError("--world-size is required (the number of processes of the run)")
        shape = read_model_shape(cfg.model.path, cache_dir=cfg.model.cache_dir)
        device = None if flags.device_gib is None else int(flags.device_gib * 2**30)
        p = plan(cfg, flags.world_size, flags.nproc_per_node, model_shape=shape, device_bytes=device)
    except (ValueError, FileNotFoundError) as e:
        print(f"spmd_rl.layout: error: {e}", file=sys.stderr)
        return 2
    if flags.json:
        print(json.dumps(describe(p)))
    elif flags.memory:
        print(render(p) + "\n\n" + (p.memory.render() if p.memory is not None else
                                    "memory: no estimate without the model's shape (hidden size, vocabulary)"))
    else:
        print(render(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
