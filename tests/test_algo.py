"""Tests for spmd_rl.algo (advantages and losses) against plain-Python references.

Each reference below is written with Python floats and loops from the formula
in the spec, never by calling the function under test. Run with
``python3 -m pytest tests/test_algo.py -q``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from spmd_rl.algo import advantages, losses
from support import reference

TOL = dict(rtol=1e-9, atol=1e-9)


def _rand_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores, non-contiguous group ids, mask with a fully masked row, a group of
    one (id 42) and an all-equal group (id 5)."""
    g = torch.Generator().manual_seed(seed)
    group_index = torch.tensor([7, 3, 7, 42, 3, 5, 7, 5, 3, 5, 7, 3])
    scores = torch.randn(12, generator=g, dtype=torch.float64)
    scores[group_index == 5] = 0.75
    mask = (torch.rand(12, 6, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    mask[4] = 0.0
    return scores, group_index, mask


def _groups(ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, gid in enumerate(ids):
        out.setdefault(gid, []).append(i)
    return out


def _tokens(per_seq: list[float], mask: torch.Tensor) -> torch.Tensor:
    m = mask.tolist()
    return torch.tensor([[per_seq[b] * m[b][t] for t in range(len(m[b]))] for b in range(len(m))],
                        dtype=torch.float64)


# ----------------------------------------------------------------------------- advantages


def _ref_grpo(scores: list[float], ids: list[int], norm: bool, eps: float) -> list[float]:
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        vals = [scores[i] for i in members]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals))
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(norm: bool) -> None:
    scores, gi, mask = _rand_case()
    got = advantages.grpo(scores, gi, mask, norm_by_std=norm, eps=1e-6)
    ref = _tokens(_ref_grpo(scores.tolist(), gi.tolist(), norm, 1e-6), mask)
    torch.testing.assert_close(got, ref, **TOL)
    assert got.dtype == torch.float64
    assert (got[gi == 5] == 0).all()  # all-equal group
    single = got[3][mask[3].bool()]
    expected = scores[3].item() / (1 + 1e-6) if norm else scores[3].item()
    torch.testing.assert_close(single, torch.full_like(single, expected), **TOL)
    assert (got[4] == 0).all()  # fully masked row


def test_grpo_float32_bool_mask_and_permutation_invariance() -> None:
    scores, gi, mask = _rand_case(1)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    got = advantages.grpo(scores.float(), gi, mask.bool())
    assert got.dtype == torch.float32
    got_perm = advantages.grpo(scores.float()[perm], gi[perm], mask.bool()[perm])
    torch.testing.assert_close(got_perm, got[perm])


def _ref_rloo(scores: list[float], ids: list[int]) -> list[float]:
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - (sum(others) / len(others) if others else 0.0)
    return out


def test_rloo_matches_reference() -> None:
    scores, gi, mask = _rand_case(2)
    got = advantages.rloo(scores, gi, mask)
    torch.testing.assert_close(got, _tokens(_ref_rloo(scores.tolist(), gi.tolist()), mask), **TOL)
    assert (got[gi == 5] == 0).all()
    assert math.isclose(got[3, 0].item(), scores[3].item())


def test_reinforce_pp_baseline_matches_reference() -> None:
    scores, gi, mask = _rand_case(3)
    s, ids, m = scores.tolist(), gi.tolist(), mask.tolist()
    centred = [0.0] * len(s)
    for members in _groups(ids).values():
        mean = 0.0 if len(members) == 1 else sum(s[i] for i in members) / len(members)
        for i in members:
            centred[i] = s[i] - mean
    toks = [centred[b] for b in range(len(s)) for t in range(len(m[b])) if m[b][t] > 0]
    mu, sd = statistics.fmean(toks), statistics.stdev(toks)
    ref = [[(centred[b] - mu) / (sd + 1e-6) * m[b][t] for t in range(len(m[b]))] for b in range(len(s))]
    got = advantages.reinforce_pp_baseline(scores, gi, mask, eps=1e-6)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), **TOL)
    assert (got[4] == 0).all()
    assert abs((got * mask).sum().item()) < 1e-9  # token-whitened => zero masked mean


def test_reinforce_pp_all_masked_is_zero() -> None:
    got = advantages.reinforce_pp_baseline(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.zeros(2, 3))
    assert torch.equal(got, torch.zeros(2, 3))


@pytest.mark.parametrize("fn", [advantages.grpo, advantages.rloo, advantages.reinforce_pp_baseline])
def test_advantage_bad_shapes(fn) -> None:
    s, gi, m = torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"group_index shape \(3,\) != scores shape \(4,\)"):
        fn(s, gi[:3], m)
    with pytest.raises(ValueError, match=r"B=4.*\(5, 3\)"):
        fn(s, gi, torch.ones(5, 3))
    with pytest.raises(ValueError, match="integer"):
        fn(s, gi.float(), m)


# ----------------------------------------------------------------------------- KL


def _ref_kl(lp: float, rf: float, kind: str) -> float:
    d = lp - rf
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return abs(d)
    kl = min(max(rf - lp, -20.0), 20.0)
    return min(max(math.exp(kl) - kl - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("kind,alias", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl"), ("abs", None)])
def test_kl_penalty(kind: str, alias: str | None) -> None:
    g = torch.Generator().manual_seed(4)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    rf = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    lp[0, 0], rf[0, 0] = -1.0, -31.0  # k3: kl clamp at -20, output clamp at 10
    lp[0, 1], rf[0, 1] = -30.0, -1.0  # k3: kl clamp at +20 -> huge, output clamp at 10
    ref = [[_ref_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), rf.tolist())]
    got = losses.kl_penalty(lp, rf, kind)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), **TOL)
    if kind == "k3":
        assert got[0, 0].item() == 10.0 and got[0, 1].item() == 10.0
        assert (got >= 0).all()
    if alias is not None:
        assert torch.equal(losses.kl_penalty(lp, rf, alias), got)


def test_kl_penalty_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown KL kind 'k4'.*k1.*k2.*k3.*abs"):
        losses.kl_penalty(torch.zeros(2, 2), torch.zeros(2, 2), "k4")
    with pytest.raises(ValueError, match=r"\(2, 2\) != ref_logprobs shape \(2, 3\)"):
        losses.kl_penalty(torch.zeros(2, 2), torch.zeros(2, 3), "k1")


# ----------------------------------------------------------------------------- aggregate


def _ref_agg(L: list[list[float]], M: list[list[float]], mode: str, gt=None, gs=None, nl=None) -> float:
    B, T = len(L), len(L[0])
    sums = [sum(L[b][t] * M[b][t] for t in range(T)) for b in range(B)]
    counts = [sum(M[b]) for b in range(B)]
    if mode == "token-mean":
        return sum(sums) / (gt if gt is not None else max(sum(counts), 1.0))
    if mode == "seq-mean-token-sum":
        per = sums
    elif mode == "seq-mean-token-mean":
        per = [s / c if c > 0 else 0.0 for s, c in zip(sums, counts)]
    else:
        per = [s / (nl if nl is not None else T) for s in sums]
    return sum(per) / (gs if gs is not None else B)


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_matches_reference_and_microbatch_sum(mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    L = torch.randn(8, 7, generator=g, dtype=torch.float64)
    M = (torch.rand(8, 7, generator=g) > 0.4).double()
    M[2] = 0.0  # fully masked row still counts as a sequence
    got = losses.aggregate(L, M, mode)
    assert got.dim() == 0
    assert math.isclose(got.item(), _ref_agg(L.tolist(), M.tolist(), mode), rel_tol=1e-12)
    assert math.isclose(losses.aggregate(L, M.bool(), mode).item(), got.item(), rel_tol=1e-12)
    # nl only matters for the -norm mode; pick one != T to check it's honoured.
    assert math.isclose(losses.aggregate(L, M, mode, norm_length=11).item(),
                        _ref_agg(L.tolist(), M.tolist(), mode, nl=11), rel_tol=1e-12)

    # Uneven micro-batches with global counts must sum to the full-batch value.
    n_tok, n_seq = int(M.sum().item()), M.shape[0]
    parts = [(0, 1), (1, 4), (4, 6), (6, 8)]
    total = sum(
        losses.aggregate(L[a:b], M[a:b], mode, global_tokens=n_tok, global_seqs=n_seq).item()
        for a, b in parts
    )
    assert math.isclose(total, got.item(), rel_tol=1e-12)
    # Tensor-valued global counts behave the same.
    total_t = sum(
        losses.aggregate(L[a:b], M[a:b], mode, global_tokens=torch.tensor(n_tok),
                         global_seqs=torch.tensor(n_seq)).item()
        for a, b in parts
    )
    assert math.isclose(total_t, got.item(), rel_tol=1e-12)


def test_aggregate_edge_cases() -> None:
    z = losses.aggregate(torch.ones(2, 3), torch.zeros(2, 3), "token-mean")
    assert z.item() == 0.0
    r = losses.aggregate(torch.tensor([[2.0, 4.0], [5.0, 5.0]]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
                         "seq-mean-token-mean")
    assert r.item() == pytest.approx(1.5)  # (3 + 0) / 2 rows
    with pytest.raises(ValueError, match=r"unknown aggregation mode 'tok-mean'.*token-mean.*seq-mean-token-sum-norm"):
        losses.aggregate(torch.zeros(2, 2), torch.ones(2, 2), "tok-mean")
    with pytest.raises(ValueError, match=r"\(2, 2\) != mask shape \(2, 3\)"):
        losses.aggregate(torch.zeros(2, 2), torch.ones(2, 3), "token-mean")
    with pytest.raises(ValueError, match="global count must be > 0, got 0"):
        losses.aggregate(torch.zeros(2, 2), torch.ones(2, 2), "token-mean", global_tokens=0)


# ----------------------------------------------------------------------------- PPO / GSPO


def _ppo_case() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(6)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    lr = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    # Force each region: ratio above/below the clip range with A>0 and A<0, and dual clip.
    lr[0, :4] = torch.tensor([0.5, -0.5, 0.05, 1.5], dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[0, :4] = torch.tensor([1.0, -1.0, 0.7, -2.0], dtype=torch.float64)  # 1.5: ratio e^1.5=4.48 > clip_c=3
    lp = old + lr
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    mask[0, :4] = 1.0
    mask[3] = 0.0
    return lp, old, adv, mask


def _ref_ppo_tokens(lp, old, adv, mask, lo, hi, c):
    out, clipf, kls, lower = [], [], [], []
    for rlp, rold, radv, rm in zip(lp, old, adv, mask):
        row = []
        for a, b, A, m in zip(rlp, rold, radv, rm):
            d = min(max(a - b, -20.0), 20.0)
            r = math.exp(d)
            p1, p2 = -A * r, -A * min(max(r, 1 - lo), 1 + hi)
            cl = max(p1, p2)
            fin = min(cl, -A * c) if A < 0 else cl
            row.append(fin)
            if m > 0:
                clipf.append(float(p2 > p1))
                kls.append(-d)
                lower.append(float(A < 0 and cl > -A * c))
        out.append(row)
    return out, statistics.fmean(clipf), statistics.fmean(kls), statistics.fmean(lower)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ppo_clip_matches_reference(mode: str) -> None:
    lp, old, adv, mask = _ppo_case()
    lp.requires_grad_(True)
    loss, met = losses.ppo_clip(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0, agg_mode=mode)
    fin, cf, kl, lower = _ref_ppo_tokens(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 3.0)
    assert math.isclose(loss.item(), _ref_agg(fin, mask.tolist(), mode), rel_tol=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(cf, abs=1e-12)
    assert met["ppo_kl"].item() == pytest.approx(kl, abs=1e-12)
    assert met["pg_clipfrac_lower"].item() == pytest.approx(lower, abs=1e-12)
    assert 0 < cf < 1 and lower > 0  # both clip regions and dual clip were exercised
    assert set(met) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    assert all(not v.requires_grad and v.dim() == 0 for v in met.values())
    loss.backward()
    g = lp.grad[0, :4].tolist()
    # A>0 above 1+hi, A<0 below 1-lo and the dual-clipped token have zero gradient;
    # the in-range token has d/dlogp = -A*r/N.
    assert g[0] == 0.0 and g[1] == 0.0 and g[3] == 0.0 and g[2] != 0.0
    if mode == "token-mean":
        r = math.exp(lp[0, 2].item() - old[0, 2].item())
        assert g[2] == pytest.approx(-0.7 * r / mask.sum().item(), rel=1e-9)


def test_ppo_clip_global_tokens_and_validation() -> None:
    lp, old, adv, mask = _ppo_case()
    full, _ = losses.ppo_clip(lp, old, adv, mask)
    n = mask.sum()
    parts = sum(losses.ppo_clip(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], global_tokens=n)[0]
                for i in range(4))
    assert math.isclose(parts.item(), full.item(), rel_tol=1e-12)
    with pytest.raises(ValueError, match=r"clip_c must be > 1.0.*got 1.0"):
        losses.ppo_clip(lp, old, adv, mask, clip_c=1.0)
    with pytest.raises(ValueError, match=r"advantages shape \(4, 5\)"):
        losses.ppo_clip(lp, old, adv[:, :5], mask)
    with pytest.raises(ValueError, match="unknown aggregation mode 'sum'"):
        losses.ppo_clip(lp, old, adv, mask, agg_mode="sum")


def test_gspo_matches_reference() -> None:
    lp, old, adv, mask = _ppo_case()
    adv = adv[:, :1].expand_as(adv).clone()  # GSPO uses one advantage per sequence
    lp = old + (lp - old) * 1e-3  # keep sequence ratios near the tiny clip range
    lp[1] = old[1] + 0.01  # far outside: clipped
    lp.requires_grad_(True)
    lo, hi = 3e-4, 4e-4
    loss, met = losses.gspo(lp, old, adv, mask, clip_low=lo, clip_high=hi)

    L, M, A, O = lp.tolist(), mask.tolist(), adv.tolist(), old.tolist()
    fin, grads, clipf, kls = [], [], [], []
    for b in range(len(L)):
        n = sum(M[b])
        s = math.exp(sum((L[b][t] - O[b][t]) * M[b][t] for t in range(len(M[b]))) / n) if n else 1.0
        row, grow = [], []
        for t in range(len(M[b])):
            p1, p2 = -A[b][t] * s, -A[b][t] * min(max(s, 1 - lo), 1 + hi)
            row.append(max(p1, p2))
            # seq-mean-token-mean gradient: unclipped tokens get -A*s/(n_b*B)
            grow.append(0.0 if (p2 > p1 or not M[b][t]) else -A[b][t] * s / (n * len(L)))
            if M[b][t]:
                clipf.append(float(p2 > p1))
                kls.append(O[b][t] - L[b][t])
        fin.append(row)
        grads.append(grow)
    assert math.isclose(loss.item(), _ref_agg(fin, M, "seq-mean-token-mean"), rel_tol=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(statistics.fmean(clipf), abs=1e-12)
    assert 0 < met["pg_clipfrac"].item() < 1
    assert met["ppo_kl"].item() == pytest.approx(statistics.fmean(kls), abs=1e-12)
    assert met["pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(grads, dtype=torch.float64), **TOL)


def test_gspo_token_level_gradient_with_per_token_advantages() -> None:
    # With per-token A (GSPO-token) the gradient at token t must use A_t, not the row's mean A.
    lp, old, adv, mask = _ppo_case()
    lp = (old + (lp - old) * 1e-2).requires_grad_(True)
    loss, met = losses.gspo(lp, old, adv, mask, clip_low=0.5, clip_high=0.5)
    assert met["pg_clipfrac"].item() == 0.0
    loss.backward()
    L, O, A, M = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    ref = []
    for b in range(len(L)):
        n = sum(M[b])
        s = math.exp(sum((L[b][t] - O[b][t]) * M[b][t] for t in range(len(M[b]))) / n) if n else 1.0
        ref.append([-A[b][t] * s * M[b][t] / (n * len(L)) if n else 0.0 for t in range(len(M[b]))])
    torch.testing.assert_close(lp.grad, torch.tensor(ref, dtype=torch.float64), **TOL)


# ----------------------------------------------------------------------------- the tests' reference helpers


def _ref_log_softmax(row: list[float]) -> list[float]:
    mx = max(row)
    lse = mx + math.log(sum(math.exp(x - mx) for x in row))
    return [x - lse for x in row]


def test_entropy_from_logits() -> None:
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 3
    z[0, 0] *= 1e4  # large magnitudes: must stay finite and near 0 entropy
    ref = [[-sum(math.exp(l) * l for l in _ref_log_softmax(v)) for v in r] for r in z.tolist()]
    got = reference.entropy_from_logits(z)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert torch.isfinite(reference.entropy_from_logits(z.float() * 1e30 / 1e26)).all()
    uniform = reference.entropy_from_logits(torch.zeros(4, dtype=torch.bfloat16))
    assert uniform.dtype == torch.float32 and uniform.item() == pytest.approx(math.log(4), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_logprobs_from_logits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(8)
    z = (torch.randn(3, 4, 13, generator=g, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, 13, (3, 4), generator=g)
    zl = z.double().tolist()
    ref = [[_ref_log_softmax(zl[b][t])[labels[b, t].item()] for t in range(4)] for b in range(3)]
    z.requires_grad_(True)
    got = reference.logprobs_from_logits(z, labels)
    assert got.shape == (3, 4)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), torch.tensor(ref, dtype=torch.float64), rtol=tol, atol=tol)
    got.sum().backward()
    # d/dz of log p[label] = onehot(label) - softmax(z)
    p = torch.softmax(z.detach().double(), -1)
    expected = torch.nn.functional.one_hot(labels, 13).double() - p
    torch.testing.assert_close(z.grad.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    with pytest.raises(ValueError, match=r"labels shape \(3, 3\)"):
        reference.logprobs_from_logits(z, labels[:, :3])


def test_cispo_and_ppo_clip_low_one_is_no_lower_clip() -> None:
    """``clip_low = 1.0`` (MiniMax's CISPO): the ratio's lower bound is 0, so only the upper clip acts;
    verl's ``compute_policy_loss_cispo`` per token: -sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 2
    lp = old + torch.randn(3, 6, generator=g, dtype=torch.float64)
    lp[0, 0], lp[0, 1] = old[0, 0] - 4.0, old[0, 1] + 1.0  # r = e^-4 (kept as it is), r = e (clipped at 1.28)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 6, generator=g) > 0.2).double()
    mask[0, :2] = 1.0
    n = mask.sum().item()
    lpg = lp.clone().requires_grad_(True)
    loss, met = losses.cispo(lpg, old, adv, mask, clip_low=1.0, clip_high=0.28, agg_mode="token-mean")
    ref, grad, clipped = 0.0, [[0.0] * 6 for _ in range(3)], 0
    for i in range(3):
        for t in range(6):
            if mask[i, t]:
                r = math.exp(min(max(lp[i, t].item() - old[i, t].item(), -20.0), 20.0))
                w = min(max(r, 0.0), 1.28)
                ref += -w * adv[i, t].item() * lp[i, t].item() / n
                grad[i][t] = -w * adv[i, t].item() / n
                clipped += w != r
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    assert met["pg_clipfrac"].item() == pytest.approx(clipped / n, rel=1e-12) and clipped >= 1
    loss.backward()
    torch.testing.assert_close(lpg.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert lpg.grad[0, 0].item() == pytest.approx(-math.exp(-4.0) * adv[0, 0].item() / n, rel=1e-9)  # not raised to 0.8
    # PPO-clip: the lower clip at 0 never binds (ratio > 0), so for A > 0 small ratios keep their gradient
    ppo, _ = losses.ppo_clip(lp, old, adv, mask, clip_low=1.0, clip_high=0.28)
    ref_ppo = 0.0
    for i in range(3):
        for t in range(6):
            if mask[i, t]:
                r, a = math.exp(lp[i, t].item() - old[i, t].item()), adv[i, t].item()
                cl = max(-a * r, -a * min(max(r, 0.0), 1.28))
                ref_ppo += (min(cl, -a * 3.0) if a < 0 else cl) / n
    assert ppo.item() == pytest.approx(ref_ppo, rel=1e-12)
    for fn in (losses.cispo, losses.ppo_clip):
        kw = {"agg_mode": "token-mean"}
        with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\].*got 1.01"):
            fn(lp, old, adv, mask, clip_low=1.01, clip_high=0.28, **kw)
