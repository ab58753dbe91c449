"""pass@k validation: the unbiased estimator against brute-force enumeration, the metrics' keys and
means, and ``spmd_rl.evaluate`` with ``--trainer.val-n`` (the trainer's validation with val_n > 1
runs in tests/test_dapo.py's runs). Run with ``OMP_NUM_THREADS=1 python3 -m pytest -q tests/test_passk.py``."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from spmd_rl.config import load_config
from spmd_rl.passk import ks_for, pass_at_k, sample_metrics
from test_evaluate import EVAL, _check, evaluate, samples


def _brute(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n answers (the first c correct) holding at least one correct."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_brute(n, c, k)), abs=1e-15), (n, c, k)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - (100 * 99 * 98) / (200 * 199 * 198))  # big n: exact integers
    for bad in ((4, 5, 1), (4, 2, 0), (4, 2, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k needs 0 <= c <= n and 1 <= k <= n"):
            pass_at_k(*bad)


def test_ks_and_sample_metrics():
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6] and ks_for(8) == [1, 2, 4, 8]
    answers = [(0, True), (1, False), (0, False), (2, True), (1, False), (0, False), (2, True), (1, False), (2, True)]
    got = sample_metrics(answers, prefix="val/")  # any order
    assert set(got) == {"val/pass@1", "val/pass@2", "val/pass@3", "val/mean@1", "val/mean@2", "val/mean@3"}
    assert got["val/pass@1"] == pytest.approx((1 / 3 + 0 + 1) / 3) == got["val/mean@3"]
    assert got["val/mean@1"] == got["val/mean@2"] == got["val/mean@3"]
    assert got["val/pass@2"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert got["val/pass@3"] == pytest.approx(2 / 3)
    assert sample_metrics([]) == {}


def test_val_n_needs_a_temperature():
    with pytest.raises(ValueError, match=r"trainer.val_n=4 samples per prompt at trainer.val_temperature=0 "
                                         r"\(greedy\) are 4 copies of one answer: set --trainer.val-temperature"):
        load_config(["--trainer.val-n", "4"])
    with pytest.raises(ValueError, match=r"trainer.val_n must be >= 1, got 0"):
        load_config(["--trainer.val-n", "0"])


def test_evaluate_samples_val_n_answers_per_prompt(tmp_path):
    out, rows_file = tmp_path / "s.json", tmp_path / "rows.jsonl"
    proc = evaluate(*EVAL, "--data.val-size", "5", "--trainer.val-n", "4", "--trainer.val-temperature", "1.0",
                    "--reward.fn", "support.rewards:any_digit", "--out", str(out), "--samples-out", str(rows_file))
    _check(proc)
    summary, rows = json.loads(out.read_text()), samples(rows_file)
    assert summary["prompts"] == 5 and summary["samples_per_prompt"] == 4 and len(rows) == 20
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(5) for j in range(4)]
    assert len({r["completion"] for r in rows if r["index"] == 0}) > 1  # sampled, not 4 greedy copies
    by_prompt = {i: [r["correct"] for r in rows if r["index"] == i] for i in range(5)}
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(v), k) for v in by_prompt.values()) / 5
        assert summary[f"pass@{k}"] == pytest.approx(want)
    assert summary["mean@4"] == pytest.approx(summary["accuracy"]) == pytest.approx(sum(r["correct"] for r in rows) / 20)
    assert 0 < summary["pass@1"] < summary["pass@4"], summary  # neither all right nor all wrong
    assert "pass@4" in proc.stdout


def test_a_config_yaml_with_the_old_val_temperature_key_still_loads(tmp_path):
    """rollout.val_temperature moved to trainer.val_temperature: a run folder's older config.yaml loads."""
    old = tmp_path / "config.yaml"
    old.write_text("rollout:\n  n: 4\n  val_temperature: 0.5\ntrainer:\n  val_n: 2\n")
    cfg = load_config(["--config", str(old)])
    assert (cfg.trainer.val_temperature, cfg.trainer.val_n, cfg.rollout.n) == (0.5, 2, 4)
    old.write_text("rollout:\n  val_temperature: 0.5\ntrainer:\n  val_temperature: 0.7\n")
    assert load_config(["--config", str(old)]).trainer.val_temperature == 0.7
