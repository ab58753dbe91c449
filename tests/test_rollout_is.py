"""Truncated importance-sampling correction of the rollout / trainer log-prob gap (``algo.rollout_is``).

Float64 references written with Python floats and loops from the formula
``w_t = min(exp(old_t - rollout_t), cap)``, loss token = ``w_t * ppo_clip_token``. Run with
``python3 -m pytest tests/test_rollout_is.py -q``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from spmd_rl.algo import losses
from spmd_rl.algo.objective import actor_objective
from spmd_rl.config import AlgoConfig


def _case():
    g = torch.Generator().manual_seed(11)
    B, T = 4, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    rollout[0, :3] = old[0, :3] - torch.tensor([2.0, 0.0, -2.0], dtype=torch.float64)  # w = e^2 (capped), 1, e^-2
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.25).double()
    mask[0, :3] = 1.0
    mask[2] = 0.0
    return lp, old, rollout, adv, mask


def _ref_weights(old, rollout, mask, cap):
    w, clipped, kl = [], [], []
    for ro, rr, rm in zip(old, rollout, mask):
        row = []
        for o, r, m in zip(ro, rr, rm):
            raw = math.exp(min(max(o - r, -20.0), 20.0))
            row.append(min(raw, cap) * m)
            if m > 0:
                clipped.append(float(raw > cap))
                kl.append(r - o)
        w.append(row)
    valid = [x for row, rm in zip(w, mask) for x, m in zip(row, rm) if m > 0]
    return w, statistics.fmean(valid), statistics.fmean(clipped), statistics.fmean(kl)


def test_truncated_is_weights_match_reference() -> None:
    _, old, rollout, _, mask = _case()
    w, met = losses.truncated_is_weights(old, rollout, mask, cap=2.0)
    ref, mean, clip, kl = _ref_weights(old.tolist(), rollout.tolist(), mask.tolist(), 2.0)
    torch.testing.assert_close(w, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert w[0, :3].tolist() == pytest.approx([2.0, 1.0, math.exp(-2.0)], rel=1e-12)
    assert met["is_weight_mean"].item() == pytest.approx(mean, abs=1e-12)
    assert met["is_clip_frac"].item() == pytest.approx(clip, abs=1e-12) and clip > 0
    assert met["rollout_kl"].item() == pytest.approx(kl, abs=1e-12)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="rollout_is_cap must be >= 1, got 0.5"):
        losses.truncated_is_weights(old, rollout, mask, cap=0.5)


def _ref_ppo_token(a, b, A, lo, hi, c):
    r = math.exp(min(max(a - b, -20.0), 20.0))
    cl = max(-A * r, -A * min(max(r, 1 - lo), 1 + hi))
    return min(cl, -A * c) if A < 0 else cl


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo"])
def test_objective_weights_each_token_and_its_gradient(policy: str) -> None:
    lp, old, rollout, adv, mask = _case()
    lp.requires_grad_(True)
    algo = AlgoConfig(rollout_is="token_truncated", rollout_is_cap=2.0, use_kl_loss=False, policy_loss=policy,
                      loss_agg_mode="token-mean", clip_low=0.2, clip_high=0.28)
    n = mask.sum().item()
    loss, met = actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=mask, ref_logprobs=None,
                                algo=algo, global_tokens=n, global_seqs=float(len(lp)), rollout_logprobs=rollout)
    w, *_ = _ref_weights(old.tolist(), rollout.tolist(), mask.tolist(), 2.0)
    if policy == "ppo_clip":
        ref = sum(w[i][t] * _ref_ppo_token(lp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, 0.28, 3.0)
                  for i in range(lp.shape[0]) for t in range(lp.shape[1]) if mask[i, t] > 0) / n
        assert loss.item() == pytest.approx(ref, rel=1e-12)
    plain, _ = actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=mask, ref_logprobs=None,
                               algo=AlgoConfig(use_kl_loss=False, policy_loss=policy, loss_agg_mode="token-mean",
                                               clip_low=0.2, clip_high=0.28),
                               global_tokens=n, global_seqs=float(len(lp)))
    assert abs(loss.item() - plain.item()) > 1e-6  # the weights changed the objective
    assert {"rollout/is_weight_mean", "rollout/is_clip_frac", "rollout/rollout_kl"} <= set(met)
    loss.backward()
    grad = lp.grad.clone()
    lp.grad = None
    plain.backward()
    wt = torch.tensor(w, dtype=torch.float64)
    if policy == "ppo_clip":  # token-level: each token's gradient is scaled by its own weight
        torch.testing.assert_close(grad, lp.grad * wt, rtol=1e-12, atol=1e-15)
    else:
        assert not torch.allclose(grad, lp.grad)


def test_objective_needs_rollout_logprobs_and_off_is_unchanged() -> None:
    lp, old, rollout, adv, mask = _case()
    on = AlgoConfig(rollout_is="token_truncated", use_kl_loss=False)
    with pytest.raises(ValueError, match="algo.rollout_is=token_truncated needs the rollout engine's log-probs"):
        actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=mask, ref_logprobs=None,
                        algo=on, global_tokens=1.0, global_seqs=1.0)
    off = AlgoConfig(use_kl_loss=False)
    a, met = actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=mask, ref_logprobs=None,
                             algo=off, global_tokens=5.0, global_seqs=4.0, rollout_logprobs=rollout)
    b, _ = actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=mask, ref_logprobs=None,
                           algo=off, global_tokens=5.0, global_seqs=4.0)
    assert a.item() == b.item() and not any(k.startswith("rollout/") for k in met)


# --------------------------------------------------------------------------- runs (CPU, 2 gloo ranks, tiny model)

MODES = {
    # one optimizer step per batch: the micro-batches' own log-probs are the old ones (the old alias)
    "token_truncated": ["--algo.rollout-is", "token_truncated", "--algo.rollout-is-cap", "2.0"],
    # IcePop band, sequence level, batch-normalised, two rejection criteria: the update's own forward
    "sequence_band_rs": ["--algo.rollout-is", "sequence", "--algo.rollout-is-threshold", "0.5_5.0",
                         "--algo.rollout-is-batch-normalize", "--algo.rollout-rs", "token_k1,seq_max_k2",
                         "--algo.rollout-rs-threshold", "0.5_2.0,1e-30"],
    # two mini-batches: the trainer's old-log-prob forward; token IS and a sequence criterion
    "token_two_updates": ["--algo.rollout-is", "token", "--algo.rollout-rs", "seq_mean_k3", "--algo.rollout-rs-threshold",
                          "1.0", "--actor.ppo-mini-batch-size", "2"],
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_run_logs_the_correction(mode: str, tmp_path) -> None:
    from test_pools import run_ok
    from test_train_e2e import read_metrics

    out = str(tmp_path / "run")
    run_ok(out, "--trainer.total-steps", "2", "--data.train-batch-size", "4", "--rollout.n", "4",
           "--actor.ppo-mini-batch-size", "4", *MODES[mode], nproc=2)
    steps = [m for m in read_metrics(out) if "critic/score/mean" in m]
    assert len(steps) == 2
    for m in steps:
        for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
                    "rollout_corr/ppl_ratio", "rollout_corr/rollout_is_eff_sample_size", "rollout/is_weight_mean",
                    "rollout/logprob_abs_diff"):
            assert math.isfinite(m[key]), (key, m)
        assert abs(m["rollout_corr/kl"]) < 1e-3 and m["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
    if mode == "sequence_band_rs":
        assert all(m["rollout_corr/rollout_is_batch_norm_factor"] > 0 for m in steps)
        assert all("rollout_corr/rollout_is_seq_clipped_fraction" in m for m in steps)
        assert all(m["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] > 0 for m in steps), steps
    if mode == "token_two_updates":
        assert all(m["rollout_corr/rollout_rs_masked_fraction"] == 0.0 for m in steps)
