"""``bench/learn_vs_trl.py``: the clock of our sides, and a CPU smoke run of all three sides with a
tiny model (TRL's side needs ``pip install trl``, not a dependency of this project)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO
from spmd_rl.distributed.testing import cpu_env
from support.deps import needs

sys.path.insert(0, os.path.join(REPO, "bench"))

import learn_vs_trl


def test_ours_clock_adds_back_generation_hidden_by_validation():
    """Training seconds sum the steps; with S=1 the S + 1 rounds in flight at each validation
    (not the first or last) are charged their generation seconds."""
    rows = [{"step": 0, "val/accuracy": 0.1}]
    for step in range(1, 5):
        rows.append({"step": step, "timing_s/step": 1.0, "async/rollout_busy_s": 0.5})
        if step % 2 == 0:
            rows.append({"step": step, "val/accuracy": 0.1 * step})
    sync = learn_vs_trl.ours_curve(rows, staleness=0)
    assert [(p["step"], p["train_s"]) for p in sync] == [(0, 0.0), (2, 2.0), (4, 4.0)]
    stale = learn_vs_trl.ours_curve(rows, staleness=1)
    assert [(p["step"], p["train_s"]) for p in stale] == [(0, 0.0), (2, 2.0), (4, 5.0)]  # rounds 3, 4 charged
    assert learn_vs_trl.reached(stale, 0.3) == {"seconds_to_target": 5.0, "step_at_target": 4, "best": 0.4,
                                                "best_train_s": 5.0}
    assert learn_vs_trl.reached(stale, 0.8)["seconds_to_target"] is None


def test_report_reads_the_last_run_of_each_side(tmp_path, capsys):
    """``--report`` prints one table from the JSON lines of several runs; a side's last run counts."""
    meta = {"model": "tiny-random", "device": "cpu", "steps": 2, "prompts": 2, "n": 4, "max_new_tokens": 8,
            "val_size": 8}
    lines = []
    for side, accuracies in (("trl", [0.1, 0.2]), ("s0", [0.1, 0.9]), ("trl", [0.1, 0.85])):
        lines += [{"side": side, "step": 2 * i, "train_s": 10.0 * i, "accuracy": a, **meta}
                  for i, a in enumerate(accuracies)]
        lines.append({"side": side, "summary": True, **meta})
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    curves, got = learn_vs_trl.read_report(str(path))
    assert list(curves) == ["s0", "trl"] and curves["trl"][1]["accuracy"] == 0.85 and got["val_size"] == 8
    learn_vs_trl.main(["--report", str(path)])
    table = capsys.readouterr().out
    assert "  to 0.8 |" in table and "ours S=0 reaches 0.8 in 1.00x less time than TRL" in table


@needs("trl", "datasets", "accelerate", install="pip install trl (TRL 1.16: accelerate, datasets)")
def test_cpu_smoke_all_sides(tmp_path):
    """Ours at S=0 and S=1 (a rollout pool) and TRL's GRPOTrainer each train 2 steps of a tiny model on the
    CPU with validation every step: one table, JSON lines with increasing training seconds per side."""
    out = tmp_path / "curves.jsonl"
    env = cpu_env(PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "bench/learn_vs_trl.py", "--device", "cpu", "--model", "tiny", "--steps", "2",
         "--val-every", "1", "--prompts", "2", "--n", "4", "--max-new-tokens", "8", "--val-size", "8",
         "--out", str(out)], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout, proc.stdout[-3000:]
    assert "  to 0.8 |" in proc.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for side in ("s0", "s1", "trl"):
        points = [r for r in lines if r["side"] == side and not r.get("summary")]
        assert [p["step"] for p in points] == [0, 1, 2], (side, points)
        seconds = [p["train_s"] for p in points]
        assert seconds[0] == 0.0 and seconds[0] < seconds[1] < seconds[2], (side, seconds)
        assert all(0.0 <= p["accuracy"] <= 1.0 for p in points)
        assert sum(1 for r in lines if r["side"] == side and r.get("summary")) == 1
    trl = next(r for r in lines if r["side"] == "trl" and r.get("summary"))
    assert trl["trl/gen_s_per_step"] > 0 and trl["trl/completions/mean_length"] <= 8
