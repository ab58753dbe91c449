"""Short training runs on one CUDA GPU (skipped elsewhere): what only the GPU path exercises end to end —
bf16 compute copies, flash varlen attention, pinned-memory staging, the captured decode step — under
the trainer, with the rollout-correction diagnostics (every tensor of the batch on the device) and MoE
router replay.

Run with ``python3 -m pytest tests/test_gpu_train.py -q`` on a machine with a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.devices import cuda
from test_train_e2e import TINY

REPO = str(Path(__file__).resolve().parents[1])
HERE = str(Path(__file__).resolve().parent)


def gpu_run(out: Path, *flags: str) -> list[dict]:
    """``python -m spmd_rl.train`` as one process on the first GPU; the metrics it logged."""
    path = [REPO, HERE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.run([sys.executable, "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", str(out), *flags],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@cuda
def test_rollout_correction_and_rejection_on_one_gpu(tmp_path: Path) -> None:
    metrics = gpu_run(tmp_path / "run", "--trainer.total-steps", "2", "--algo.rollout-is", "token",
                      "--algo.rollout-rs", "seq_mean_k1", "--algo.rollout-rs-threshold", "0.5_2.0")
    steps = [m for m in metrics if "rollout_corr/kl" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(abs(m["rollout_corr/kl"]) < 0.1 for m in steps)  # bf16 rollout vs bf16-compute trainer: small


@cuda
def test_router_replay_on_one_gpu(tmp_path: Path) -> None:
    from test_router_replay import moe_folder

    folder = moe_folder(tmp_path, tokenizer=True, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, moe_intermediate_size=32)
    metrics = gpu_run(tmp_path / "run", "--model.path", folder, "--actor.router-replay", "--trainer.total-steps", "2",
                      "--actor.use-packing", "--algo.rollout-is", "token")
    steps = [m for m in metrics if "rollout_corr/kl" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["perf/router_replay_mb"] > 0 for m in steps)
