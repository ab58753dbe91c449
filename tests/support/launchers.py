"""Shared bits of the launcher tests (Slurm, multi-node): a short tiny-model run and its checks.

    flags = short_run(out_dir)                   # training flags for a 3-step tiny-random GRPO run
    rows = rank_table(log_text)                  # rows of the rank table rank 0 printed
    steps = metric_steps(out_dir)                # [1, 2, 3]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

STEPS = 3


def short_run(out_dir: str) -> list[str]:
    """Flags of a 3-step GRPO run on the built-in tiny random model, small enough for 2 CPU cores."""
    return [
        "--model.path", "tiny-random",
        "--data.task", "arithmetic", "--data.train-batch-size", "8", "--data.val-size", "16",
        "--rollout.n", "4", "--rollout.max-new-tokens", "8",
        "--actor.ppo-mini-batch-size", "8", "--actor.micro-batch-size", "16",
        "--reward.fn", "support.rewards:digit_fraction",
        "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "0",
        "--trainer.total-steps", str(STEPS), "--trainer.output-dir", out_dir,
    ]


def metric_steps(out_dir: str) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def rank_table(log: str) -> list[dict[str, str]]:
    """Parse the table that follows the ``rank table`` log line (format_rank_table's layout)."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if line.rstrip().endswith("rank table")), None)
    assert start is not None, f"no rank table in the log:\n{log[-3000:]}"
    header = lines[start + 1].split()[:5]
    assert header == ["rank", "node", "host", "local_rank", "device"], lines[start + 1]
    rows = []
    for line in lines[start + 3:]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append(dict(zip(header, cells[:5])))
    return rows


def communicate_or_kill(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Wait for processes started with ``start_new_session=True`` (text pipes); on timeout kill
    every process group and fail with what each one printed."""
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1.0)))
        except subprocess.TimeoutExpired:
            break
    if len(outputs) == len(procs):
        return outputs
    for sig in (signal.SIGTERM, signal.SIGKILL):  # torchrun stops its workers on SIGTERM
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    outputs += [p.communicate() for p in procs[len(outputs):]]
    tails = "\n".join(f"--- process {i} stderr\n{err[-3000:]}" for i, (_, err) in enumerate(outputs))
    raise AssertionError(f"still running after {timeout:.0f} s, killed\n{tails}")
