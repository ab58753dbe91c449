"""DAPO: dynamic sampling (``algo.filter_groups``), the overlong shaping flags, the ``configs/dapo.yaml``
preset and its plan rules.

The filter's logic is checked on hand-made rounds, in one process and on two gloo ranks that must
take the same decisions; one two-rank run of the preset on the tiny model checks that the rounds
happen, that every rank trains on whole informative groups of the right shape, and that the reward
rises. Run with ``OMP_NUM_THREADS=1 python3 -m pytest -q tests/test_dapo.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import REPO
from spmd_rl.algo.filtering import DynamicSampling, informative, select
from spmd_rl.config import load_config
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.plan import plan
from spmd_rl.distributed.testing import run_distributed
from spmd_rl.metrics import MetricAccumulator

N = 2  # responses per prompt in the hand-made rounds


def _round(scores: list[list[float]], *, tag: int, groups: range | None = None, width: int = 3) -> RolloutBatch:
    """One round's rows of the groups ``groups`` (default: all), ``scores[g]`` for group g's n rows; each
    row's response ids hold (tag, group, row) so that the rows can be traced through the filter."""
    groups = range(len(scores)) if groups is None else groups
    rows = [(g, j) for g in groups for j in range(len(scores[g]))]
    ids = torch.tensor([[tag, g, j][:width] + [0] * (width - 3) for g, j in rows], dtype=torch.long)
    return RolloutBatch(
        prompts=[[100 + g] for g, _ in rows],
        tensors={"response_ids": ids, "response_mask": torch.ones(len(rows), width),
                 "group_index": torch.tensor([g for g, _ in rows]), "scores": torch.tensor([scores[g][j] for g, j in rows])},
        extras={"sample": [tag * 100 + g for g, _ in rows]},
    )


def _collect(sampling: DynamicSampling, first, acc, more):
    """One step's rounds as the DAPO batch source runs them: ``more(r)`` is round r."""
    chosen = sampling.begin()
    batch = first
    while not chosen.add(batch):
        batch = more(chosen.rounds)
    return chosen.finish(acc)


def test_informative_and_select():
    assert informative([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], [0, 0, 1, 1, 2, 2]) == {0: False, 1: True, 2: False}
    flags = [{0: False, 1: True, 2: True}, {0: True, 1: False, 2: True}]
    assert select(flags, 3) == [(0, 1), (0, 2), (1, 0)]
    assert select(flags, 9) == [(0, 1), (0, 2), (1, 0), (1, 2)]


def test_one_rank_takes_the_first_informative_groups_in_round_order():
    rounds = [
        [[1, 1], [0, 1], [0, 0], [1, 0]],  # informative: 1, 3
        [[0, 0], [1, 1], [1, 1], [1, 1]],  # none
        [[0.5, 0], [2, 1], [1, 1], [3, 3]],  # 0, 1: only 0 is needed
    ]
    dyn = DynamicSampling(train_batch_size=3, n=N, max_rounds=5, group=None, actor_dp=0, actor_dp_size=1,
                          pad_token_id=0)
    asked = []

    def more(r):
        asked.append(r)
        return _round(rounds[r], tag=r, width=3 + r)  # later rounds are wider: padded on the way

    acc = MetricAccumulator()
    out = _collect(dyn, _round(rounds[0], tag=0), acc, more)
    assert asked == [1, 2]
    assert len(out) == 3 * N and out.response_len == 5
    assert out["response_ids"][:, :3].tolist() == [[0, 1, 0], [0, 1, 1], [0, 3, 0], [0, 3, 1], [2, 0, 0], [2, 0, 1]]
    assert out["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert out.extras["sample"] == [1, 1, 3, 3, 200, 200]
    assert out["scores"].tolist() == [0, 1, 1, 0, 0.5, 0]
    m = acc.reduce()
    assert m["batch/sample_rounds"] == 3 and m["batch/filtered_groups"] == 2 + 4 + 2


def test_rounds_run_out_like_verl_and_zero_means_no_limit():
    dull = [[1, 1], [0, 0]]
    dyn = DynamicSampling(train_batch_size=2, n=N, max_rounds=3, group=None, actor_dp=0, actor_dp_size=1,
                          pad_token_id=0)
    with pytest.raises(ValueError, match=r"0 of data.train_batch_size=2 groups .* after algo.max_sample_rounds=3 "
                                         r"rounds \(6 groups had all rollout.n=2 scores equal\)"):
        _collect(dyn, _round(dull, tag=0), MetricAccumulator(), lambda r: _round(dull, tag=r))
    unlimited = DynamicSampling(train_batch_size=2, n=N, max_rounds=0, group=None, actor_dp=0, actor_dp_size=1,
                                pad_token_id=0)
    good = [[1, 0], [0, 1]]
    out = _collect(unlimited, _round(dull, tag=0), acc := MetricAccumulator(),
                   lambda r: _round(good if r == 12 else dull, tag=r))
    assert out.extras["sample"] == [1200, 1200, 1201, 1201] and acc.reduce()["batch/sample_rounds"] == 13


def _two_ranks_body(rank: int, world: int) -> dict:
    """Each rank holds its actor dp rank's contiguous half of every round (``dp2``), or both ranks are
    one dp rank holding the same rows (``sp2``, as Ulysses ranks do); the ranks must take the same
    decisions and re-lay the selected groups evenly."""
    rounds = [
        [[1, 0], [1, 1], [1, 1], [1, 1]],  # dp 0 holds groups 0-1, dp 1 groups 2-3: informative 0
        [[1, 1], [1, 1], [0, 1], [1, 0]],  # informative 2, 3 (all on dp 1)
        [[0, 1], [1, 1], [1, 1], [1, 1]],
    ]
    out = {}
    for name, dp, dp_size in (("dp2", rank, 2), ("sp2", 0, 1)):
        half = 4 // dp_size

        def share(r, dp=dp, half=half):
            return _round(rounds[r], tag=r, groups=range(dp * half, (dp + 1) * half))

        dyn = DynamicSampling(train_batch_size=4, n=N, max_rounds=3, group=None, actor_dp=dp, actor_dp_size=dp_size,
                              pad_token_id=0)
        acc = MetricAccumulator()
        batch = _collect(dyn, share(0), acc, share)
        out[name] = (batch["response_ids"].tolist(), batch["group_index"].tolist(), acc.reduce())
    return out


def test_two_ranks_agree_and_relay_the_groups():
    first, second = run_distributed(_two_ranks_body, 2)
    selected = [[0, 0, 0], [0, 0, 1], [1, 2, 0], [1, 2, 1], [1, 3, 0], [1, 3, 1], [2, 0, 0], [2, 0, 1]]
    for name in ("dp2", "sp2"):
        (ids0, gi0, m0), (ids1, gi1, m1) = first[name], second[name]
        assert m0 == m1 and m0["batch/sample_rounds"] == 3 and m0["batch/filtered_groups"] == 3 + 2 + 3
        if name == "dp2":  # each dp rank its half, whole groups, numbered in order
            assert ids0 + ids1 == selected and gi0 + gi1 == [0, 0, 1, 1, 2, 2, 3, 3]
        else:  # the two ranks of one dp group: the same rows, counted once
            assert ids0 == ids1 == selected and gi0 == gi1 == [0, 0, 1, 1, 2, 2, 3, 3]


# ----------------------------------------------------------------------------- config and plan


def test_preset_is_dapo():
    cfg = load_config(["--config", os.path.join(REPO, "configs", "dapo.yaml")])
    a = cfg.algo
    assert (a.clip_low, a.clip_high, a.loss_agg_mode, a.use_kl_loss, a.kl_coef, a.filter_groups) == (
        0.2, 0.28, "token-mean", False, 0.0, True)
    assert cfg.reward.overlong_buffer > 0 and cfg.reward.overlong_factor == 1.0
    plan(cfg, 2)  # valid as written for the 2 processes its header launches


@pytest.mark.parametrize("flags, message", [
    (["--algo.filter-groups", "--pools.rollout-ranks", "1", "--trainer.max-staleness", "1"],
     r"algo.filter_groups decides from each round's scores .* \(trainer.max_staleness=1\) .* --trainer.max-staleness 0"),
    (["--algo.filter-groups", "--rollout.n", "1", "--algo.adv-estimator", "reinforce_pp_baseline"],
     r"a group of rollout.n=1 always is: use --rollout.n 2 or more"),
    (["--reward.overlong-buffer", "32", "--rollout.max-new-tokens", "24"],
     r"reward.overlong_buffer \(32\) must be <= rollout.max_new_tokens \(24\)"),
])
def test_plan_rules(flags, message):
    with pytest.raises(ValueError, match=message):
        plan(load_config(flags), 3)


@pytest.mark.parametrize("flags, message", [
    (["--algo.max-sample-rounds", "-1"], r"algo.max_sample_rounds must be >= 0 \(0 = no limit\), got -1"),
    (["--reward.overlong-buffer", "-1"], r"reward.overlong_buffer must be >= 0 \(0 = off\), got -1"),
    (["--reward.overlong-factor", "-0.5"], r"reward.overlong_factor must be >= 0, got -0.5"),
])
def test_section_checks(flags, message):
    with pytest.raises(ValueError, match=message):
        load_config(flags)


# ----------------------------------------------------------------------------- the preset, two ranks


TINY_DAPO = [
    "--config", os.path.join(REPO, "configs", "dapo.yaml"), "--model.path", "tiny-random",
    "--data.train-batch-size", "8", "--actor.ppo-mini-batch-size", "8", "--data.val-size", "8",
    "--rollout.max-new-tokens", "8", "--reward.overlong-buffer", "2",
    "--actor.lr", "3e-3", "--actor.micro-batch-size", "16", "--reward.fn", "support.rewards:digit_fraction_on_odd_prompts",
    "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "0", "--trainer.stall-timeout-s", "0",
    "--checkpoint.no-save-final",
]


def _train_body(rank: int, world: int, out_dir: str, flags: list[str]) -> dict:
    """``spmd_rl.train`` in this process, recording the batch each update trains on."""
    from spmd_rl import train
    from spmd_rl.trainer import Trainer

    seen: list[dict] = []
    update = Trainer.update

    def recording(self, batch, acc):
        seen.append({"group_index": batch["group_index"].tolist(), "scores": batch["scores"].tolist(),
                     "sample": list(batch.extras["sample"])})
        return update(self, batch, acc)

    Trainer.update = recording
    code = train.main([*TINY_DAPO, *flags, "--trainer.output-dir", out_dir])
    metrics = []
    if rank == 0:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
    return {"code": code, "batches": seen, "metrics": metrics}


def _check_batches(trainers: list[dict], steps: int, *, tb: int = 8, n: int = 8) -> list[dict]:
    """Every step: each actor rank trains on tb * n / ranks rows of whole groups whose scores differ,
    and the ranks' groups are 0..tb-1 once each. Returns rank 0's training metrics."""
    assert [r["code"] for r in trainers] == [0] * len(trainers)
    for step in range(steps):
        groups = []
        for r in trainers:
            b = r["batches"][step]
            assert len(b["group_index"]) == tb * n // len(trainers)  # as an unfiltered step has
            for k in range(0, len(b["group_index"]), n):
                rows = range(k, k + n)
                assert len({b["group_index"][i] for i in rows}) == 1 and len({b["sample"][i] for i in rows}) == 1
                assert len({b["scores"][i] for i in rows}) > 1, "a group whose scores are all equal was trained on"
                groups.append(b["group_index"][k])
        assert sorted(groups) == list(range(tb))
    metrics = [m for m in trainers[0]["metrics"] if "critic/score/mean" in m]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    rounds = [m["batch/sample_rounds"] for m in metrics]
    assert max(rounds) > 1, rounds  # the constant half of the prompts made steps draw more
    assert all(m["batch/filtered_groups"] >= (r > 1) for m, r in zip(metrics, rounds))
    return metrics


def _check_validation(metrics: list[dict], val_n: int) -> None:
    vals = [m for m in metrics if "val/accuracy" in m]
    assert vals
    for v in vals:
        ks = [k for k in (1, 2, 4, 8) if k <= val_n]
        passes = [v[f"val/pass@{k}"] for k in ks]
        assert passes == sorted(passes) and v[f"val/mean@{val_n}"] == pytest.approx(v["val/accuracy"])
        assert v["val/pass@1"] == pytest.approx(v["val/accuracy"])


def test_dapo_preset_learns_on_two_ranks_with_whole_informative_groups(tmp_path):
    """Colocated rollout, 2 ranks: the preset's shaping and filter; validation with 4 samples per prompt."""
    steps = 16
    ranks = run_distributed(_train_body, 2, str(tmp_path / "run"), [
        "--trainer.total-steps", str(steps), "--trainer.val-every", "8", "--trainer.val-n", "4",
        "--trainer.val-temperature", "1.0"])
    metrics = _check_batches(ranks, steps)
    assert all("reward/overlong_penalty/mean" in m for m in metrics)
    first = sum(m["critic/score/mean"] for m in metrics[:4]) / 4
    last = sum(m["critic/score/mean"] for m in metrics[-4:]) / 4
    assert last > first + 0.1, f"reward did not rise: first 4 steps {first:.3f}, last 4 steps {last:.3f}"
    _check_validation(ranks[0]["metrics"], 4)


def test_dapo_with_a_rollout_pool(tmp_path):
    """The rollout on a pool of its own (trainer.max_staleness 0): 1 actor rank and 1 rollout rank."""
    steps = 3
    ranks = run_distributed(_train_body, 2, str(tmp_path / "run"), [
        "--trainer.total-steps", str(steps), "--pools.rollout-ranks", "1", "--trainer.val-every", "3",
        "--trainer.val-n", "2", "--trainer.val-temperature", "1.0"])
    _check_batches(ranks[:1], steps)
    assert ranks[1]["batches"] == []  # the rollout rank serves, never trains
    _check_validation(ranks[0]["metrics"], 2)
