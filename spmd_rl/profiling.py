"""Where a step's time goes: ``torch.profiler`` over chosen steps, read per trainer stage.

    torchrun ... -m spmd_rl.train --trainer.profile-steps 5 20      # steps 5 and 20 under the profiler

The trainer's stage timer names every stage as a ``stage/<name>`` range. For a profiled step each
rank writes a Chrome trace (``<output_dir>/profile/step5_rank0.json.gz``, open it in Perfetto) and
rank 0 logs one line per stage: its wall time, the device time of the kernels that started inside
it, and so how busy the device was. A stage whose GPU idles is bound by the host (Python, kernel
launches, synchronisations), which no faster kernel fixes; then the stage's longest kernels.
The profiler slows the host side, so the wall times of a profiled step are an upper bound. Kernel
time is summed over all streams and counted in the stage where the kernel started: kernels that
overlap (compute next to NCCL) can add up to more than the wall time, and a collective that waits
for a slower rank counts as busy. Read the busy share of multi-GPU runs with the trace at hand.

:func:`idle_gaps` / :func:`format_idle_gaps` find where the device idled inside a profiled window
and group the gaps by what the host was doing (the shortest torch range spanning most of the gap,
plus the CUDA runtime call when the host waited in one, e.g. ``aten::item / cudaStreamSynchronize``)
and by the kernel that ended them; ``bench/update.py --profile`` prints that table.
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.autograd import DeviceType

STAGE_PREFIX = "stage/"


@dataclass
class StageTime:
    """One stage of a profiled step: wall and kernel time in ms, and its kernels by total time."""

    name: str
    wall_ms: float
    kernel_ms: float
    kernels: int
    top: list[tuple[str, float, int]] = field(default_factory=list)  # (kernel, ms, launches)

    @property
    def busy(self) -> float:
        return self.kernel_ms / self.wall_ms if self.wall_ms > 0 else 0.0


def stage_times(prof: torch.profiler.profile, *, top: int = 8) -> list[StageTime]:
    """The LAST range of each ``stage/<name>`` in ``prof`` (the trainer's stages), in start order, with
    the device kernels that started inside it. Ranges' own GPU mirrors (user annotations) are not kernels."""
    events = prof.events()
    ranges: dict[str, tuple[float, float]] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(STAGE_PREFIX):
            ranges[e.name[len(STAGE_PREFIX):]] = (e.time_range.start, e.time_range.end)
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
               and not e.name.startswith(STAGE_PREFIX) and "#" not in e.name]
    out = []
    for name, (lo, hi) in sorted(ranges.items(), key=lambda kv: kv[1][0]):
        inside = [(b - a, k) for a, b, k in kernels if lo <= a < hi]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for us, k in inside:
            by_name[k][0] += us
            by_name[k][1] += 1
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        out.append(StageTime(name, (hi - lo) / 1e3, sum(us for us, _ in inside) / 1e3, len(inside),
                             [(k, us / 1e3, int(n)) for k, (us, n) in ranked]))
    return out


def format_stage_times(stages: list[StageTime], *, top_of: tuple[str, ...] = ("update", "ref", "old_logprob")) -> str:
    lines = [f"  {'stage':12s} {'wall ms':>9s} {'kernel ms':>10s} {'kernels':>8s} {'GPU busy':>9s}"]
    for s in stages:
        lines.append(f"  {s.name:12s} {s.wall_ms:9.1f} {s.kernel_ms:10.1f} {s.kernels:8d} {100 * s.busy:8.1f}%")
        if s.name in top_of:
            lines += [f"      {ms:8.1f} ms  x{n:<6d} {k[:100]}" for k, ms, n in s.top]
    return "\n".join(lines)


@dataclass
class IdleGaps:
    """Where the device idled inside a profiled window: the total, and the gaps grouped by what the host
    was doing (the shortest CPU range spanning most of the gap) and by the kernel that ended them."""

    window_ms: float
    idle_ms: float
    gaps: int
    by_cause: list[tuple[str, str, float, int]] = field(default_factory=list)  # (host range, next kernel, ms, n)


def idle_gaps(prof: torch.profiler.profile, *, min_us: float = 20.0, top: int = 10) -> IdleGaps:
    """The device's idle time between its first and last kernel in ``prof`` (gaps shorter than ``min_us``
    are launch latency and ignored), grouped by cause (see :class:`IdleGaps`)."""
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
                     and not e.name.startswith(STAGE_PREFIX) and "#" not in e.name)
    if not kernels:
        return IdleGaps(0.0, 0.0, 0)
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == DeviceType.CPU and not e.name.startswith(("ProfilerStep", STAGE_PREFIX))]
    gaps, busy_until = [], kernels[0][1]
    for start, end, name in kernels[1:]:
        if start - busy_until >= min_us:
            gaps.append((busy_until, start, name))
        busy_until = max(busy_until, end)
    grouped: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for lo, hi, next_kernel in gaps:
        spans = [(b - a, n) for a, b, n in host if min(b, hi) - max(a, lo) >= 0.5 * (hi - lo)]
        ops = [sp for sp in spans if not sp[1].startswith("cuda")]  # runtime calls: named after their op
        cause = min(ops)[1] if ops else "(no torch range: Python)"
        runtime = [sp for sp in spans if sp[1].startswith("cuda")]
        if runtime:  # e.g. "aten::item / cudaStreamSynchronize": the host waited for the device there
            cause += " / " + min(runtime)[1]
        g = grouped[(cause, next_kernel)]
        g[0] += hi - lo
        g[1] += 1
    ranked = sorted(grouped.items(), key=lambda kv: -kv[1][0])[:top]
    return IdleGaps((busy_until - kernels[0][0]) / 1e3, sum(hi - lo for lo, hi, _ in gaps) / 1e3, len(gaps),
                    [(c, k, us / 1e3, int(n)) for (c, k), (us, n) in ranked])


def format_idle_gaps(g: IdleGaps) -> str:
    lines = [f"  device idle {g.idle_ms:.1f} ms of {g.window_ms:.1f} ms in {g.gaps} gaps; the largest causes "
             "(host range spanning the gap -> kernel that ended it):"]
    lines += [f"    {ms:8.1f} ms  x{n:<5d} {cause[:60]} -> {kernel[:60]}" for cause, kernel, ms, n in g.by_cause]
    return "\n".join(lines)


@contextmanager
def profiled(device: torch.device, trace_path: str | None) -> Iterator[torch.profiler.profile]:
    """``torch.profiler`` over the block (CPU, plus CUDA on a CUDA device); the Chrome trace goes to
    ``trace_path`` (``.gz`` compresses) when given."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield prof
    if trace_path is not None:
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)


__all__ = ["STAGE_PREFIX", "IdleGaps", "StageTime", "format_idle_gaps", "format_stage_times", "idle_gaps", "profiled",
           "stage_times"]
