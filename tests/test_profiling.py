"""The profile readers on hand-made event lists: stage wall / kernel time, and where the device idled."""

from __future__ import annotations

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from spmd_rl.profiling import format_idle_gaps, format_stage_times, idle_gaps, stage_times


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def _ev(i, name, start, end, device=False):
    return FunctionEvent(i, name, thread=0, start_us=start, end_us=end,
                         device_type=DeviceType.CUDA if device else DeviceType.CPU)


def _trace():
    # host: a stage over everything; a step range; an item() sync; a Python gap with no torch range
    host = [_ev(1, "stage/update", 0, 1000), _ev(2, "aten::mm", 0, 10), _ev(3, "Optimizer.step", 600, 700),
            _ev(4, "aten::item", 300, 420), _ev(5, "cudaStreamSynchronize", 301, 399)]
    # kernels: busy 0-300, idle 300-400 (host in aten::item), busy 400-500, idle 500-800 (no range spans
    # most of it but the stage), a 10 us launch gap ignored, busy to 900
    device = [_ev(10, "gemm_a", 0, 300, True), _ev(11, "gemm_b", 400, 500, True), _ev(12, "adamw", 800, 850, True),
              _ev(13, "norm", 860, 900, True)]
    return _Prof(host + device)


def test_idle_gaps_total_and_causes():
    g = idle_gaps(_trace(), min_us=20.0)
    assert (g.window_ms, g.idle_ms, g.gaps) == (0.9, 0.4, 2)
    # largest first; the stage range is not a cause, and Optimizer.step spans only a third of its gap
    assert [(c, k, round(ms, 6), n) for c, k, ms, n in g.by_cause] == [
        ("(no torch range: Python)", "adamw", 0.3, 1), ("aten::item / cudaStreamSynchronize", "gemm_b", 0.1, 1)]
    text = format_idle_gaps(g)
    assert "device idle 0.4 ms of 0.9 ms in 2 gaps" in text and "aten::item / cudaStreamSynchronize -> gemm_b" in text


def test_idle_gaps_without_kernels_is_empty():
    g = idle_gaps(_Prof([_ev(1, "aten::mm", 0, 10)]))
    assert (g.idle_ms, g.gaps, g.by_cause) == (0.0, 0, [])


def test_stage_times_count_kernels_started_inside():
    (update,) = stage_times(_trace())
    assert update.name == "update" and update.wall_ms == 1.0 and update.kernels == 4
    assert abs(update.kernel_ms - 0.49) < 1e-9 and abs(update.busy - 0.49) < 1e-9
    assert update.top[0] == ("gemm_a", 0.3, 1)
    assert "update" in format_stage_times([update])
