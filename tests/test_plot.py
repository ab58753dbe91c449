"""``python -m spmd_rl.plot``: PNG curves from a synthetic metrics.jsonl, and its error cases.

Run: ``python -m pytest tests/test_plot.py -q``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from spmd_rl import plot
from support import deps

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int = 30, *, with_val: bool = True, kl: bool = True) -> Path:
    """A metrics.jsonl shaped like the trainer's: training lines, plus val/* lines every 10 steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    if with_val:
        lines.append({"step": 0, "val/accuracy": 0.1, "val/score": 0.1})
    for s in range(1, steps + 1):
        score = 0.2 + 0.6 * (1 - math.exp(-s / 10))
        record = {
            "step": s,
            "critic/score/mean": score, "critic/score/min": 0.0, "critic/score/max": min(1.0, score + 0.3),
            "response_length/mean": 40 + s, "response_length/min": 5, "response_length/max": 64,
            "actor/entropy": 2.0 - 0.02 * s, "actor/pg_loss": 0.01 * math.sin(s),
            "timing_s/step": 1.5,
        }
        if kl:
            record["actor/kl_loss"] = 1e-4 * s
        lines.append(record)
        if with_val and s % 10 == 0:
            lines.append({"step": s, "val/accuracy": score, "val/score": score})
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 5_000, f"{path} is only {len(data)} bytes"


@deps.matplotlib
def test_plot_writes_every_curve(tmp_path: Path) -> None:
    write_run(tmp_path / "run")
    paths = plot.plot_run(tmp_path / "run")
    names = [p.name for p in paths]
    assert names == ["curves.png", "reward.png", "response_length.png", "kl.png", "entropy.png"]
    assert all(p.parent == tmp_path / "run" / "plots" for p in paths)
    for p in paths:
        assert_png(p)


@deps.matplotlib
def test_cli_prints_paths_and_honours_out(tmp_path: Path) -> None:
    write_run(tmp_path / "run", with_val=False, kl=False)
    # a run still writing: the last line is cut short and must be skipped
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 31, "critic/sc')
    out = tmp_path / "pngs"
    proc = subprocess.run([sys.executable, "-m", "spmd_rl.plot", str(tmp_path / "run"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    printed = [Path(line) for line in proc.stdout.split()]
    # no KL logged (use_kl_loss off): no kl.png, the combined figure says so in its panel
    assert [p.name for p in printed] == ["curves.png", "reward.png", "response_length.png", "entropy.png"]
    for p in printed:
        assert p.parent == out
        assert_png(p)


def test_missing_and_empty_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no metrics file at .*metrics.jsonl"):
        plot.plot_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics records"):
        plot.plot_run(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
        plot.plot_run(tmp_path / "bad")
    assert plot.main([str(tmp_path / "nothing")]) == 2
    assert not (tmp_path / "nothing" / "plots").exists()


def test_missing_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'spmd_rl\[plot\]'"):
        plot.plot_run(tmp_path / "run")
    assert plot.main([str(tmp_path / "run")]) == 2
    assert "spmd_rl[plot]" in capsys.readouterr().err
