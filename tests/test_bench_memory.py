"""``bench/memory.py`` on CPU: the tiny shape's configuration plans, trains one step in its own process and
lands in the table (no peak on the CPU); the table's GPU rows from made-up numbers."""

from __future__ import annotations

import importlib.util
import json
import os

from conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_memory", os.path.join(REPO, "bench", "memory.py"))
bench_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_memory)


def test_tiny_run_plans_trains_and_reports(tmp_path, capsys) -> None:
    out = tmp_path / "rows.jsonl"
    assert bench_memory.main(["--tiny", "--models", str(tmp_path / "models"), "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["config"] == "tiny" and row["steps"] == 1 and row["device_bytes"] is None
    assert row["estimate"] == max(row["estimate_phases"].values()) > 0
    printed = capsys.readouterr().out
    assert "global pool (1 rank), MiB per rank" in printed and "| tiny | 0.00 (update) | - | - |" in printed


def test_table_rows() -> None:
    gib = bench_memory.GIB
    rows = [{"config": "a", "estimate": 10 * gib, "estimate_phase": "update", "measured": 11 * gib,
             "estimate_phases": {"generate": 4 * gib, "log-probs": 5 * gib, "update": 10 * gib},
             "measured_phases": {"generate": 4.5 * gib, "log-probs": 5 * gib, "update": 11 * gib}},
            {"config": "b", "estimate": 200 * gib, "estimate_phase": "update", "refused": "out of GPU memory: ...",
             "estimate_phases": {}},
            {"config": "c", "error": "over --timeout 300 s"}]
    lines = bench_memory.table(rows, "H").splitlines()
    assert lines[3] == "| a | 10.00 (update) | 11.00 | 1.10 | 4.00 / 4.50 | 5.00 / 5.00 | 10.00 / 11.00 |"
    assert lines[4].startswith("| b | 200.00 (update) | refused by plan(): out of GPU memory")
    assert lines[5] == "| c | FAILED: over --timeout 300 s |"
