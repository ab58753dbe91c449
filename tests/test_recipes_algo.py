"""Recipe pieces (issue 24): GAE, the clipped value loss, CISPO and DAPO's overlong penalty.

Every reference below is a plain-Python loop over floats written from the formula (verl's
definition where it has one), never a call of the function under test. Masks are random with
holes, a row whose only valid token is somewhere in the middle, and a fully masked row. Run with
``OMP_NUM_THREADS=1 python3 -m pytest -q tests/test_recipes_algo.py``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from spmd_rl.algo import advantages, losses
from spmd_rl.algo.objective import actor_objective, compute_advantages
from spmd_rl.config import AlgoConfig, load_config
from spmd_rl.reward import overlong_penalty

TOL = dict(rtol=1e-10, atol=1e-12)


def _mask(g: torch.Generator, B: int, T: int) -> torch.Tensor:
    """Random 0/1 mask: holes everywhere, row 1 = one valid token only, row 2 = trailing padding
    after a few holes, row 3 = nothing valid."""
    m = (torch.rand(B, T, generator=g) > 0.35).double()
    m[0, :] = 1.0
    m[0, 3] = 0.0  # a single hole in an otherwise full row
    m[1] = 0.0
    m[1, T // 2] = 1.0
    m[2, T - 3:] = 0.0
    m[3] = 0.0
    return m


def _ref_agg(L: list[list[float]], M: list[list[float]], mode: str, gt=None, gs=None) -> float:
    """spmd_rl's aggregation (losses.aggregate's docstring): seq modes count every row."""
    B, T = len(L), len(L[0])
    sums = [sum(L[b][t] for t in range(T) if M[b][t]) for b in range(B)]
    counts = [sum(1 for t in range(T) if M[b][t]) for b in range(B)]
    if mode == "token-mean":
        return sum(sums) / (gt if gt is not None else max(sum(counts), 1))
    if mode == "seq-mean-token-sum":
        per = sums
    elif mode == "seq-mean-token-mean":
        per = [s / c if c else 0.0 for s, c in zip(sums, counts)]
    else:
        per = [s / T for s in sums]
    return sum(per) / (gs if gs is not None else B)


def _ref_agg_coeffs(M: list[list[float]], mode: str) -> list[list[float]]:
    """d aggregate / d loss_mat[b][t]: the normaliser each valid token's loss is divided by."""
    B, T = len(M), len(M[0])
    n_tok = sum(1 for row in M for x in row if x)
    out = []
    for b in range(B):
        n_b = sum(1 for x in M[b] if x)
        if mode == "token-mean":
            c = 1.0 / n_tok
        elif mode == "seq-mean-token-sum":
            c = 1.0 / B
        elif mode == "seq-mean-token-mean":
            c = 1.0 / (n_b * B) if n_b else 0.0
        else:
            c = 1.0 / (T * B)
        out.append([c if M[b][t] else 0.0 for t in range(T)])
    return out


# ----------------------------------------------------------------------------- GAE


def _ref_gae(R, V, M, gamma, lam):
    """verl's compute_gae_advantage_return with masked tokens skipped, then masked_whiten; the
    outputs are compared on valid tokens and must be 0 elsewhere."""
    B, T = len(R), len(R[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(T)):
            if not M[b][t]:
                continue
            delta = R[b][t] + gamma * next_v - V[b][t]
            a = delta + gamma * lam * next_a
            adv[b][t], ret[b][t] = a, a + V[b][t]
            next_v, next_a = V[b][t], a
    valid = [adv[b][t] for b in range(B) for t in range(T) if M[b][t]]
    mean = statistics.fmean(valid)
    var = statistics.variance(valid)  # unbiased, as verl's masked_var
    white = [[(adv[b][t] - mean) / math.sqrt(var + 1e-8) if M[b][t] else 0.0 for t in range(T)]
             for b in range(B)]
    return white, ret


def _gae_case(seed: int, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T, generator=g, dtype=torch.float64)
    return R, V, _mask(g, B, T)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3), (1.0, 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_reference(gamma: float, lam: float, seed: int) -> None:
    R, V, M = _gae_case(seed)
    adv, ret = advantages.gae(R, V, M, gamma, lam)
    ref_adv, ref_ret = _ref_gae(R.tolist(), V.tolist(), M.tolist(), gamma, lam)
    assert adv.dtype == torch.float64 and not adv.requires_grad
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), **TOL)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), **TOL)
    # Whitened over the valid tokens: mean 0, unbiased variance ~1.
    valid = adv[M.bool()]
    assert abs(valid.mean().item()) < 1e-12 and valid.var().item() == pytest.approx(1.0, rel=1e-6)
    # Bool masks give the same result.
    adv_b, ret_b = advantages.gae(R, V, M.bool(), gamma, lam)
    torch.testing.assert_close(adv_b, adv, rtol=0, atol=0)
    torch.testing.assert_close(ret_b, ret, rtol=0, atol=0)


def test_gae_skips_holes_like_the_compacted_sequence() -> None:
    """A row with holes has the returns of the same row with the masked tokens removed; whatever
    sits at masked positions (even NaN) never leaks in."""
    R, V, M = _gae_case(3)
    R2, V2 = R.clone(), V.clone()
    R2[~M.bool()] = float("nan")
    V2[~M.bool()] = float("inf")
    _, ret = advantages.gae(R2, V2, M, 0.9, 0.8)
    assert torch.isfinite(ret).all()
    for b in range(R.shape[0]):
        idx = M[b].nonzero().flatten()
        if len(idx) == 0:
            assert (ret[b] == 0).all()
            continue
        _, ret_c = advantages.gae(R[b:b + 1, idx], V[b:b + 1, idx], torch.ones(1, len(idx)), 0.9, 0.8)
        torch.testing.assert_close(ret[b, idx], ret_c[0], **TOL)
        assert (ret[b][~M[b].bool()] == 0).all()


def test_gae_float32_and_degenerate_masks() -> None:
    R, V, M = _gae_case(4)
    adv32, ret32 = advantages.gae(R.float(), V.float(), M.float(), 0.99, 0.95)
    adv64, ret64 = advantages.gae(R, V, M, 0.99, 0.95)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32, adv64.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ret32, ret64.float(), rtol=1e-4, atol=1e-5)
    # bf16 inputs are computed in float32.
    assert advantages.gae(R.bfloat16(), V.bfloat16(), M, 1.0, 1.0)[0].dtype == torch.float32
    # One valid token in the whole batch: its return is r - v (+0), its whitened advantage 0.
    one = torch.zeros_like(M)
    one[2, 4] = 1.0
    adv, ret = advantages.gae(R, V, one, 1.0, 1.0)
    assert (adv == 0).all()
    assert ret[2, 4].item() == pytest.approx(R[2, 4].item(), rel=1e-12)  # A = r - v, returns = A + v
    assert ret.count_nonzero().item() == 1
    adv, ret = advantages.gae(R, V, torch.zeros_like(M), 1.0, 1.0)
    assert (adv == 0).all() and (ret == 0).all()


def test_gae_validation() -> None:
    R, V, M = _gae_case(0)
    with pytest.raises(ValueError, match=r"values shape \(6, 8\) != token_rewards shape \(6, 9\)"):
        advantages.gae(R, V[:, :8], M, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"token_rewards must be \[B, T\]"):
        advantages.gae(R[0], V[0], M[0], 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma and lam must be in"):
        advantages.gae(R, V, M, 1.5, 1.0)


# ----------------------------------------------------------------------------- value loss


def _value_case(seed: int, B: int = 6, T: int = 8):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    vpreds = values + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    returns = values + torch.randn(B, T, generator=g, dtype=torch.float64)
    return vpreds, returns, values, _mask(g, B, T)


def _ref_value(VP, RET, V, M, clip):
    loss, clipped, grad = [], [], []
    for b in range(len(VP)):
        lrow, grow = [], []
        for t in range(len(VP[b])):
            vp, r, v = VP[b][t], RET[b][t], V[b][t]
            vc = min(max(vp, v - clip), v + clip)
            e1, e2 = (vp - r) ** 2, (vc - r) ** 2
            lrow.append(max(e1, e2))
            # d/dvp of max(e1, e2): through e1 when it is the larger; e2 is flat in vp when clipped.
            grow.append(2 * (vp - r) if e1 >= e2 else 0.0)
            if M[b][t]:
                clipped.append(float(e2 > e1))
        loss.append(lrow)
        grad.append(grow)
    return loss, statistics.fmean(clipped), grad


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_value_loss_matches_reference(mode: str) -> None:
    vp, ret, v, M = _value_case(7)
    vp.requires_grad_(True)
    clip = 0.2
    loss, clipfrac = losses.value_loss(vp, ret, v, M, clip=clip, agg_mode=mode)
    L, cf, G = _ref_value(vp.tolist(), ret.tolist(), v.tolist(), M.tolist(), clip)
    Ml = M.tolist()
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(0.5 * _ref_agg(L, Ml, mode), rel=1e-12)
    assert clipfrac.item() == pytest.approx(cf, abs=1e-12)
    assert 0 < cf < 1 and not clipfrac.requires_grad and clipfrac.dim() == 0
    loss.backward()
    C = _ref_agg_coeffs(Ml, mode)
    ref_grad = [[0.5 * G[b][t] * C[b][t] for t in range(len(G[b]))] for b in range(len(G))]
    torch.testing.assert_close(vp.grad, torch.tensor(ref_grad, dtype=torch.float64), **TOL)
    # Bool mask: same value.
    assert losses.value_loss(vp, ret, v, M.bool(), clip=clip, agg_mode=mode)[0].item() == loss.item()


def test_value_loss_global_counts_and_edges() -> None:
    vp, ret, v, M = _value_case(8)
    for mode in losses.AGG_MODES:
        full, _ = losses.value_loss(vp, ret, v, M, clip=0.3, agg_mode=mode)
        parts = sum(losses.value_loss(vp[a:b], ret[a:b], v[a:b], M[a:b], clip=0.3, agg_mode=mode,
                                      global_tokens=M.sum(), global_seqs=M.shape[0])[0]
                    for a, b in [(0, 1), (1, 4), (4, 6)])
        assert parts.item() == pytest.approx(full.item(), rel=1e-12)
    # A huge clip never clips: plain 0.5 * MSE, clipfrac 0; clip 0 keeps the old values.
    loss, cf = losses.value_loss(vp, ret, v, M, clip=1e9, agg_mode="token-mean")
    mse = ((vp - ret) ** 2 * M).sum() / M.sum()
    assert loss.item() == pytest.approx(0.5 * mse.item(), rel=1e-12) and cf.item() == 0.0
    loss0, _ = losses.value_loss(vp, ret, v, M, clip=0.0, agg_mode="token-mean")
    ref0 = (torch.maximum((vp - ret) ** 2, (v - ret) ** 2) * M).sum() / M.sum()
    assert loss0.item() == pytest.approx(0.5 * ref0.item(), rel=1e-12)
    # Unclipped predictions with tiny updates are not counted as clipped by rounding.
    _, cf_tiny = losses.value_loss(v + 1e-9, ret, v, M, clip=0.2, agg_mode="token-mean")
    assert cf_tiny.item() == 0.0
    with pytest.raises(ValueError, match=r"vpreds shape \(6, 8\) != mask shape \(6, 7\)"):
        losses.value_loss(vp, ret, v, M[:, :7], clip=0.2, agg_mode="token-mean")
    with pytest.raises(ValueError, match="value clip must be >= 0"):
        losses.value_loss(vp, ret, v, M, clip=-0.1, agg_mode="token-mean")
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        losses.value_loss(vp, ret, v, M, clip=0.2, agg_mode="mean")


# ----------------------------------------------------------------------------- CISPO


def _cispo_case(seed: int, B: int = 6, T: int = 8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    lp[0, :3] = old[0, :3] + torch.tensor([30.0, -30.0, 0.0], dtype=torch.float64)  # hits the ±20 log clamp
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return lp, old, adv, _mask(g, B, T)


def _ref_cispo(LP, OLD, A, M, lo, hi, W=None):
    """Per-token losses, d loss_t / d logp_t (the detached weight's -w*A, times the IS weight),
    and verl's metrics (pg_clipfrac: ratio clipped on either side; ppo_kl: mean old - new of the
    clamped log-ratio)."""
    loss, grad, clipf, kls = [], [], [], []
    for b in range(len(LP)):
        lrow, grow = [], []
        for t in range(len(LP[b])):
            d = min(max(LP[b][t] - OLD[b][t], -20.0), 20.0)
            r = math.exp(d)
            w = min(max(r, 1 - lo), 1 + hi)
            iw = 1.0 if W is None else W[b][t]
            lrow.append(-w * A[b][t] * LP[b][t] * iw)
            grow.append(-w * A[b][t] * iw)
            if M[b][t]:
                clipf.append(float(w != r))
                kls.append(-d)
        loss.append(lrow)
        grad.append(grow)
    return loss, grad, statistics.fmean(clipf), statistics.fmean(kls)


@pytest.mark.parametrize("mode", losses.AGG_MODES)
@pytest.mark.parametrize("lo,hi", [(0.2, 0.28), (0.9, 4.0)])
def test_cispo_matches_reference_and_gradient(mode: str, lo: float, hi: float) -> None:
    lp, old, adv, M = _cispo_case(11)
    lp.requires_grad_(True)
    loss, met = losses.cispo(lp, old, adv, M, clip_low=lo, clip_high=hi, agg_mode=mode)
    L, G, cf, kl = _ref_cispo(lp.tolist(), old.tolist(), adv.tolist(), M.tolist(), lo, hi)
    Ml = M.tolist()
    assert loss.item() == pytest.approx(_ref_agg(L, Ml, mode), rel=1e-12)
    assert set(met) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    assert all(not v.requires_grad and v.dim() == 0 and v.dtype == torch.float64 for v in met.values())
    assert met["pg_clipfrac"].item() == pytest.approx(cf, abs=1e-12) and 0 < cf < 1
    assert met["ppo_kl"].item() == pytest.approx(kl, abs=1e-12)
    assert met["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    # The weight is detached: d/dlogp = -w * A * mask / normaliser, clipped tokens included.
    C = _ref_agg_coeffs(Ml, mode)
    ref = [[G[b][t] * C[b][t] for t in range(len(G[b]))] for b in range(len(G))]
    torch.testing.assert_close(lp.grad, torch.tensor(ref, dtype=torch.float64), **TOL)
    assert (lp.grad[0, :2] != 0).all()  # the clipped tokens still learn (unlike PPO's clip)


def test_cispo_global_counts_token_weights_and_validation() -> None:
    lp, old, adv, M = _cispo_case(12)
    for mode in losses.AGG_MODES:
        full, _ = losses.cispo(lp, old, adv, M, clip_low=0.2, clip_high=0.28, agg_mode=mode)
        parts = sum(losses.cispo(lp[a:b], old[a:b], adv[a:b], M[a:b], clip_low=0.2, clip_high=0.28, agg_mode=mode,
                                 global_tokens=M.sum(), global_seqs=M.shape[0])[0]
                    for a, b in [(0, 2), (2, 3), (3, 6)])
        assert parts.item() == pytest.approx(full.item(), rel=1e-12)
    g = torch.Generator().manual_seed(1)
    W = torch.rand(lp.shape, generator=g, dtype=torch.float64) * 2
    lpg = lp.clone().requires_grad_(True)
    loss, _ = losses.cispo(lpg, old, adv, M, clip_low=0.2, clip_high=0.28, agg_mode="token-mean", token_weights=W)
    L, G, _, _ = _ref_cispo(lp.tolist(), old.tolist(), adv.tolist(), M.tolist(), 0.2, 0.28, W.tolist())
    assert loss.item() == pytest.approx(_ref_agg(L, M.tolist(), "token-mean"), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(lpg.grad, torch.tensor(G, dtype=torch.float64) * M / M.sum(), **TOL)
    # float32 / bool mask
    l32, m32 = losses.cispo(lp.float(), old.float(), adv.float(), M.bool(), clip_low=0.2, clip_high=0.28,
                            agg_mode="token-mean")
    assert l32.dtype == torch.float32 and m32["pg_clipfrac_lower"].dtype == torch.float32
    l64, _ = losses.cispo(lp, old, adv, M, clip_low=0.2, clip_high=0.28, agg_mode="token-mean")
    assert l32.item() == pytest.approx(l64.item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\] \(the ratio's lower bound 1 - clip_low >= 0\), got 1.5"):
        losses.cispo(lp, old, adv, M, clip_low=1.5, clip_high=0.2, agg_mode="token-mean")
    with pytest.raises(ValueError, match=r"advantages shape \(6, 5\)"):
        losses.cispo(lp, old, adv[:, :5], M, clip_low=0.2, clip_high=0.2, agg_mode="token-mean")


# ----------------------------------------------------------------------------- objective / config


def test_grpo_objective_with_cispo() -> None:
    lp, old, _, M = _cispo_case(13)
    M[3, 0] = 1.0  # every row has a token, so every group member has a response
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    ref_lp = old + 0.05
    for mode in ("token-mean", "seq-mean-token-mean"):
        algo = AlgoConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28, loss_agg_mode=mode, kl_coef=0.01)
        adv = compute_advantages(scores, gid, M, algo=algo)
        lpg = lp.clone().requires_grad_(True)
        n_tok, n_seq = M.sum().item(), float(M.shape[0])
        loss, met = actor_objective(lpg, None, old_logprobs=old, advantages=adv, response_mask=M,
                                    ref_logprobs=ref_lp, algo=algo, global_tokens=n_tok, global_seqs=n_seq)
        pg, pg_met = losses.cispo(lp, old, adv, M, clip_low=0.2, clip_high=0.28, agg_mode=mode,
                                  global_tokens=n_tok, global_seqs=n_seq)
        kl = losses.aggregate(losses.kl_penalty(lp, ref_lp, "k3"), M, mode, global_tokens=n_tok, global_seqs=n_seq)
        assert loss.item() == pytest.approx(pg.item() + 0.01 * kl.item(), rel=1e-12)
        assert met["actor/pg_loss"].item() == pytest.approx(pg.item(), rel=1e-12)
        for k, v in pg_met.items():
            assert met[f"actor/{k}"].item() == v.item()
        loss.backward()
        assert torch.isfinite(lpg.grad).all() and lpg.grad.abs().sum() > 0
        # CISPO differs from PPO clip on the same batch (the ±20 tokens are clipped differently).
        ppo = AlgoConfig(policy_loss="ppo_clip", clip_low=0.2, clip_high=0.28, loss_agg_mode=mode, kl_coef=0.01)
        other, _ = actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=M, ref_logprobs=ref_lp,
                                   algo=ppo, global_tokens=n_tok, global_seqs=n_seq)
        assert other.item() != loss.item()


def test_cispo_objective_with_rollout_is() -> None:
    lp, old, adv, M = _cispo_case(14)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    algo = AlgoConfig(policy_loss="cispo", use_kl_loss=False, rollout_is="token_truncated", rollout_is_cap=2.0)
    n = M.sum().item()
    loss, met = actor_objective(lp, None, old_logprobs=old, advantages=adv, response_mask=M, ref_logprobs=None,
                                algo=algo, global_tokens=n, global_seqs=6.0, rollout_logprobs=rollout)
    W = [[min(math.exp(o - r), 2.0) for o, r in zip(ro, rr)] for ro, rr in zip(old.tolist(), rollout.tolist())]
    L, _, _, _ = _ref_cispo(lp.tolist(), old.tolist(), adv.tolist(), M.tolist(), 0.2, 0.2, W)
    assert loss.item() == pytest.approx(_ref_agg(L, M.tolist(), "token-mean", gt=n), rel=1e-12)
    assert "rollout/is_weight_mean" in met


def test_config_accepts_cispo_flag() -> None:
    cfg = load_config(["--algo.policy-loss", "cispo", "--algo.clip-low", "0.1", "--algo.clip-high", "0.3"])
    assert cfg.algo.policy_loss == "cispo" and (cfg.algo.clip_low, cfg.algo.clip_high) == (0.1, 0.3)


# ----------------------------------------------------------------------------- overlong penalty


def _ref_overlong(n: float, max_len: int, buffer: int, factor: float) -> float:
    expected = max_len - buffer
    return min(-(n - expected) / buffer * factor, 0.0)


@pytest.mark.parametrize("max_len,buffer,factor", [(64, 16, 1.0), (100, 100, 0.5), (37, 5, 2.5)])
def test_overlong_penalty_matches_reference(max_len: int, buffer: int, factor: float) -> None:
    g = torch.Generator().manual_seed(max_len)
    lengths = torch.randint(0, max_len + 8, (40,), generator=g)  # includes lengths past max_len
    lengths[:4] = torch.tensor([0, max_len - buffer, max_len - buffer + 1, max_len])
    got = overlong_penalty(lengths, max_len=max_len, buffer=buffer, factor=factor)
    ref = [_ref_overlong(n, max_len, buffer, factor) for n in lengths.tolist()]
    assert got.dtype == torch.float32 and got.shape == lengths.shape
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float32))
    assert got[1].item() == 0.0 and not math.copysign(1.0, got[1].item()) < 0  # no -0.0
    assert got[3].item() == pytest.approx(-factor)
    assert (got <= 0).all()
    # Lists and float64 lengths work too; 2-D shapes are kept.
    assert overlong_penalty(lengths.tolist(), max_len=max_len, buffer=buffer, factor=factor).tolist() == got.tolist()
    got64 = overlong_penalty(lengths.double().view(5, 8), max_len=max_len, buffer=buffer, factor=factor)
    assert got64.dtype == torch.float64 and got64.shape == (5, 8)
    torch.testing.assert_close(got64.flatten(), torch.tensor(ref, dtype=torch.float64))


def test_overlong_penalty_validation_and_light_import() -> None:
    with pytest.raises(ValueError, match="overlong buffer must be > 0, got 0"):
        overlong_penalty([1, 2], max_len=10, buffer=0, factor=1.0)
    with pytest.raises(ValueError, match=r"max_len \(4\) must be >= the overlong buffer \(8\)"):
        overlong_penalty([1, 2], max_len=4, buffer=8, factor=1.0)
    import subprocess
    import sys
    code = "import sys, spmd_rl.reward; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
