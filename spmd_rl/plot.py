"""Training curves from a run's ``metrics.jsonl`` as PNG files (matplotlib, Agg backend).

    python -m spmd_rl.plot runs/quickstart                # writes into runs/quickstart/plots/
    python -m spmd_rl.plot runs/quickstart --out /tmp/p   # or anywhere else

Writes ``curves.png`` (all panels in one figure) and one file per metric that the run logged:
``reward.png`` (critic/score/mean with its min/max band; val/accuracy on a right-hand axis when
validation ran), ``response_length.png`` (mean with min/max band), ``kl.png`` (actor/kl_loss) and
``entropy.png`` (actor/entropy). Prints the paths written. Needs matplotlib:
``pip install 'spmd_rl[plot]'``.

The JSONL holds one object per line with ``step`` and metric keys; training and validation
records are separate lines (validation keys start with ``val/``), so each curve takes the steps of
the lines that carry its key.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MATPLOTLIB_HINT = "matplotlib is not installed: pip install 'spmd_rl[plot]'"


@dataclass(frozen=True)
class Panel:
    """One figure: a main curve, an optional min/max band, an optional right-axis curve."""

    file: str
    title: str
    ylabel: str
    key: str
    band: tuple[str, str] | None = None
    right_key: str | None = None
    right_label: str = ""


PANELS = (
    Panel("reward.png", "reward", "score", "critic/score/mean",
          band=("critic/score/min", "critic/score/max"), right_key="val/accuracy", right_label="val accuracy"),
    Panel("response_length.png", "response length", "tokens", "response_length/mean",
          band=("response_length/min", "response_length/max")),
    Panel("kl.png", "KL to reference", "actor/kl_loss", "actor/kl_loss"),
    Panel("entropy.png", "entropy", "actor/entropy", "actor/entropy"),
)


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a half-written last line (a run still writing) is skipped."""
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}: give the run folder (trainer.output_dir) "
                                "of a run with logging.jsonl on")
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                break  # the writer is mid-line
            raise ValueError(f"{path}:{number} is not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{number} is not a metrics record (a JSON object with a 'step' key)")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no metrics records yet (empty file)")
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of the records that carry ``key`` with a finite number, by step."""
    points = sorted(
        (float(r["step"]), float(r[key])) for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
    )
    return [s for s, _ in points], [v for _, v in points]


def _draw(ax: Any, panel: Panel, records: list[dict[str, Any]]) -> bool:
    """Draw ``panel`` on ``ax``; False (and a note on the axes) when the run never logged its key."""
    steps, values = series(records, panel.key)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    drawn = bool(steps)
    if steps:
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, color="C0", label=panel.key)
    if steps and panel.band is not None:
        lo_steps, lo = series(records, panel.band[0])
        hi_steps, hi = series(records, panel.band[1])
        if lo_steps and lo_steps == hi_steps:
            ax.fill_between(lo_steps, lo, hi, color="C0", alpha=0.2, label="min / max")
    if panel.right_key is not None:
        r_steps, r_values = series(records, panel.right_key)
        if r_steps:
            right = ax.twinx()
            right.plot(r_steps, r_values, marker="o", color="C1", label=panel.right_key)
            right.set_ylabel(panel.right_label, color="C1")
            right.set_ylim(-0.05, 1.05)
            handles, labels = ax.get_legend_handles_labels()
            r_handles, r_labels = right.get_legend_handles_labels()
            ax.legend(handles + r_handles, labels + r_labels, loc="best", fontsize="small")
            drawn = True
        elif steps:
            ax.legend(loc="best", fontsize="small")
    elif steps and panel.band is not None:
        ax.legend(loc="best", fontsize="small")
    if not drawn:
        ax.text(0.5, 0.5, f"{panel.key} not logged", ha="center", va="center", transform=ax.transAxes)
    return drawn


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs for the run in ``run_dir``; return their paths (curves.png first)."""
    records = load_metrics(Path(run_dir) / "metrics.jsonl")
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MATPLOTLIB_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, panel in zip(axes.flat, PANELS):
        _draw(ax, panel, records)
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(records)} records, last step {max(r['step'] for r in records)}")
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if _draw(ax, panel, records):
            fig.tight_layout()
            path = out / panel.file
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_rl.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run folder holding metrics.jsonl (trainer.output_dir)")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
