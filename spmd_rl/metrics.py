"""Step metrics: accumulate locally, reduce over a group in one collective, log from rank 0.

    acc = MetricAccumulator()
    acc.add("actor/pg_clipfrac", value, weight=num_tokens)   # weighted mean over ranks
    acc.add_max("critic/score/max", score_max)
    metrics = acc.reduce(group)              # every rank of the group calls this
    sink.log(metrics, step)                  # a no-op on ranks other than 0

Sinks: console (the status line of :mod:`spmd_rl.console`: the start-up's phases, then a bar with
step, reward, tokens/s and an ETA from the steps' own times, plus one summary line per step),
JSONL (``<output_dir>/metrics.jsonl``) and wandb (offline unless WANDB_API_KEY is set). Only rank 0
builds real sinks; the others get :class:`NullSink`, so the training loop has no rank checks.

MFU: :func:`grpo_step_flops` gives the model FLOPs of each phase of a step (from a
:class:`spmd_rl.models.FlopsModel` and the step's real lengths), :func:`phase_mfu` turns them into
``perf/mfu/{gen,old_logprob,ref,update}`` and ``perf/mfu`` against :func:`peak_flops` (dense bf16
peak of known GPUs; no MFU on CPU).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from spmd_rl.checkpoint_files import lock_output_dir, unlock_output_dir
from spmd_rl.config import LoggingConfig

log = logging.getLogger("spmd_rl")


class MetricAccumulator:
    """Weighted means, maxima and minima that reduce over ranks with three all-reduces."""

    def __init__(self) -> None:
        self._mean: dict[str, list[float]] = {}
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._sum: dict[str, float] = {}

    def add(self, key: str, value: float | torch.Tensor, weight: float = 1.0) -> None:
        v = float(value)
        acc = self._mean.setdefault(key, [0.0, 0.0])
        acc[0] += v * weight
        acc[1] += weight

    def add_sum(self, key: str, value: float) -> None:
        self._sum[key] = self._sum.get(key, 0.0) + float(value)

    def add_max(self, key: str, value: float) -> None:
        self._max[key] = max(self._max.get(key, -math.inf), float(value))

    def add_min(self, key: str, value: float) -> None:
        self._min[key] = min(self._min.get(key, math.inf), float(value))

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Collective over ``group``. A key missing on some ranks counts as empty there (the megatron
        engine's loss metrics exist only on the last pipeline stage): the key sets are merged first."""
        out: dict[str, float] = {}
        distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        if distributed:
            every: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, (list(self._mean), list(self._sum), list(self._max), list(self._min)), group=group)
            for means, sums, maxes_, mins_ in every:
                for k in means:
                    self._mean.setdefault(k, [0.0, 0.0])
                for k in sums:
                    self._sum.setdefault(k, 0.0)
                for k in maxes_:
                    self._max.setdefault(k, -math.inf)
                for k in mins_:
                    self._min.setdefault(k, math.inf)
        mean_keys = sorted(self._mean)
        sum_keys = sorted(self._sum)
        packed = torch.tensor(
            [x for k in mean_keys for x in self._mean[k]] + [self._sum[k] for k in sum_keys], dtype=torch.float64
        )
        maxes = torch.tensor([self._max[k] for k in sorted(self._max)], dtype=torch.float64)
        mins = torch.tensor([self._min[k] for k in sorted(self._min)], dtype=torch.float64)
        if distributed:
            dist.all_reduce(packed, group=group)
            if len(maxes):
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            if len(mins):
                dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
        for i, k in enumerate(mean_keys):
            total, weight = packed[2 * i].item(), packed[2 * i + 1].item()
            out[k] = total / weight if weight > 0 else 0.0
        for i, k in enumerate(sum_keys):
            out[k] = packed[2 * len(mean_keys) + i].item()
        out.update({k: maxes[i].item() for i, k in enumerate(sorted(self._max))})
        out.update({k: mins[i].item() for i, k in enumerate(sorted(self._min))})
        return out


class NullSink:
    """What ranks other than 0 log to."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def info(self, text: str) -> None:
        pass

    def write_config(self, yaml_text: str, path: str | None = None, print_all: bool = False) -> None:
        pass

    def step_started(self, step: int, device: torch.device | str) -> None:
        pass

    def close(self) -> None:
        pass


class RunSink:
    """Console + JSONL + wandb on rank 0."""

    def __init__(self, *, logging_cfg: LoggingConfig, output_dir: str, total_steps: int, start_step: int,
                 config_dict: dict[str, Any], start_elapsed_s: float = 0.0) -> None:
        """``start_elapsed_s``: the wall time the run had spent when its checkpoint was saved
        (``Checkpointer.start_elapsed_s``), so that a resumed run's ``elapsed_s`` continues from it."""
        self.cfg = logging_cfg
        self.output_dir = output_dir
        self.total_steps = total_steps
        self.start_time = time.time()
        self.start_step = start_step
        self.start_elapsed_s = start_elapsed_s
        # One run per folder: the trainer's Checkpointer took this lock first (in this process: a no-op
        # here); a sink opened on its own takes it before it appends to metrics.jsonl.
        self._locked = lock_output_dir(output_dir) is not None
        # unbuffered: one write call per line, cut back to the last whole line when it fails (append_line)
        self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "ab", buffering=0) if logging_cfg.jsonl else None
        self.bar = None
        self.first_step_at: float | None = None  # when this process's first step started: the ETA's zero
        if logging_cfg.console:  # the status line spmd_rl.train started (or a new one), later the step bar
            from spmd_rl import console

            self.bar = console.start().bar
        if start_step >= total_steps:
            self.info(f"the run in {output_dir} is already complete at step {start_step} (trainer.total_steps="
                      f"{total_steps}): nothing to train; to train on from there, give --trainer.total-steps above "
                      f"{start_step}; for a new run, a new --trainer.output-dir")
        self.wandb = None
        if logging_cfg.wandb != "off":
            try:
                import wandb
            except ImportError:
                if logging_cfg.wandb == "on":
                    raise ValueError("logging.wandb=on but wandb is not installed: pip install 'spmd_rl[wandb]'")
            else:
                mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
                self.wandb = wandb.init(
                    project=logging_cfg.wandb_project,
                    name=logging_cfg.run_name or os.path.basename(os.path.abspath(output_dir)),
                    dir=output_dir, config=config_dict, mode=mode, resume="allow",
                )

    def info(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            log.info(text)

    def write_config(self, yaml_text: str, path: str | None = None, print_all: bool = False) -> None:
        """Write the resolved config to ``path`` (default ``<output_dir>/config.yaml``) and name the
        file in one line; ``print_all`` (``logging.print_config``) also prints the whole of it."""
        path = path or os.path.join(self.output_dir, "config.yaml")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(yaml_text)
        if print_all:
            self.info(f"resolved config ({path})\n" + yaml_text.rstrip("\n"))
        else:
            self.info(f"resolved config: {path} (--logging.print-config prints it here)")

    def _steps(self) -> Any:
        """The status line as the step bar (it says the start-up's phases until the first step)."""
        from spmd_rl import console

        status = console.current()
        return status.steps(self.total_steps, self.start_step) if status is not None else self.bar

    def step_started(self, step: int, device: torch.device | str) -> None:
        """Say on the bar what the first step this process runs is doing until its metrics arrive
        (they replace the note): on CUDA it compiles kernels and captures the rollout's CUDA graphs,
        which takes tens of seconds once; later steps do not change the bar here. The ETA counts from
        this first step's start: the start-up and the first validation are not steps."""
        if step != self.start_step + 1:
            return
        self.first_step_at = time.time()
        if self.bar is None:
            return
        what = "compiling and capturing graphs" if torch.device(device).type == "cuda" else "first step running"
        self._steps().set_postfix_str(f"step {step}: {what}", refresh=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        elapsed_s = self.start_elapsed_s + time.time() - self.start_time
        record = {"step": step, "elapsed_s": round(elapsed_s, 3),
                  **{k: _round(v) for k, v in sorted(metrics.items())}}
        if self.jsonl is not None:
            append_line(self.jsonl, json.dumps(record) + "\n", step=step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is not None and "timing_s/step" in metrics:
            from spmd_rl import console

            done = step - self.start_step
            elapsed = time.time() - (self.first_step_at or self.start_time)  # the steps' time only
            eta = elapsed / max(done, 1) * (self.total_steps - step)
            bar = self._steps()
            bar.set_postfix_str(
                f"reward={metrics.get('critic/score/mean', float('nan')):.3f} "
                f"tok/s={metrics.get('perf/tokens_per_s', 0):.0f} eta={_fmt_time(eta)}", refresh=False)
            bar.update(1)
            bar.write(_summary(step, metrics), file=sys.stderr)
            status = console.current()
            if status is not None:
                status.first_step_done()
        elif self.bar is not None:
            self.bar.write(_summary(step, metrics), file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            from spmd_rl import console

            console.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self._locked:
            self._locked = False
            unlock_output_dir(self.output_dir)


def _round(v: float) -> float:
    return float(f"{v:.6g}") if isinstance(v, float) and math.isfinite(v) else v


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


_SUMMARY_KEYS = [
    ("critic/score/mean", "reward"), ("val/accuracy", "val_acc"), ("response_length/mean", "len"),
    ("actor/pg_loss", "pg_loss"), ("actor/kl_loss", "kl"), ("actor/entropy", "ent"),
    ("actor/grad_norm", "gnorm"), ("perf/tokens_per_s", "tok/s"), ("timing_s/step", "step_s"),
]


def _summary(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for key, short in _SUMMARY_KEYS:
        if key in metrics:
            parts.append(f"{short}={metrics[key]:.4g}")
    return " | ".join(parts)


class BarSafeHandler(logging.StreamHandler):
    """A stream handler that writes through ``tqdm.write``: a progress bar shown on the same
    terminal is cleared before the line and drawn again after it, instead of the line being glued
    to the end of the bar (no bar: a plain write)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def append_line(f: Any, line: str, *, step: int) -> None:
    """Append ``line`` to the unbuffered binary file ``f`` in one write call; when it fails (a full
    disk) or is cut short, truncate the file back to its last whole line and raise ``OSError`` saying
    so, so that a resumed run finds no cut line."""
    data = line.encode()
    size = os.fstat(f.fileno()).st_size
    try:
        written = os.write(f.fileno(), data)
        if written != len(data):
            raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
    except OSError as e:
        try:
            os.ftruncate(f.fileno(), size)
        except OSError:
            pass
        raise OSError(e.errno, f"{f.name}: cannot append the line of step {step} ({e.strerror or e}); the file keeps "
                      "its whole lines up to the previous step. Free space and run the same command again: it "
                      "resumes from the newest checkpoint") from None


def setup_logging(rank: int, hostname: str) -> None:
    """INFO from rank 0, WARNING and above from every rank, each line tagged host:rank; lines are
    written around rank 0's progress bar (:class:`BarSafeHandler`)."""
    handler = BarSafeHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {hostname}:{rank} %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("spmd_rl")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False


# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for perf/mfu.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known GPU, else None (no MFU is reported on CPU or unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_BF16.items():
        if key in name:
            return value
    return None


def grpo_step_flops(fm: Any, prompt_lens: list[int], response_lens: list[int], *, old_logprob: bool, ref: bool,
                    ppo_epochs: int) -> dict[str, float]:
    """Model FLOPs of one GRPO step's phases for these rows (``fm``: a
    :class:`spmd_rl.models.FlopsModel`): rollout (prefill + decode), the old and reference
    log-prob forwards when they run, and the update (forward + backward = 3 forwards per epoch).
    Forwards score the ``sum(response_lens)`` positions that predict a response token."""
    forward = fm.forward([p + r for p, r in zip(prompt_lens, response_lens)], head_tokens=sum(response_lens))
    return {"gen": fm.rollout(prompt_lens, response_lens), "old_logprob": forward if old_logprob else 0.0,
            "ref": forward if ref else 0.0, "update": 3.0 * forward * ppo_epochs}


def phase_mfu(flops: dict[str, float], seconds: dict[str, float], *, peak: float, world: int) -> dict[str, float]:
    """``perf/mfu/<phase>`` = the phase's FLOPs over its seconds times ``peak * world``, for the
    phases that ran, plus ``perf/mfu`` for the whole step (all FLOPs over ``seconds["step"]``).
    The rollout's time excludes the weight hot-swap (``weight_sync``), which is timed inside it."""
    out: dict[str, float] = {}
    for phase, work in flops.items():
        s = seconds.get(phase, 0.0) - (seconds.get("weight_sync", 0.0) if phase == "gen" else 0.0)
        if work > 0 and s > 0:
            out[f"perf/mfu/{phase}"] = work / s / (peak * world)
    if seconds.get("step", 0.0) > 0:
        out["perf/mfu"] = sum(flops.values()) / seconds["step"] / (peak * world)
    return out
