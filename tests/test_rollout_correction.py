"""``spmd_rl.algo.rollout_correction`` against a loop-style reference written here from verl's definitions
(``compute_rollout_correction_and_rejection_mask`` in ``verl/trainer/ppo/rollout_corr_helper.py``): IS
weights, the rejection mask and every ``rollout_corr/*`` metric within 1e-6, on random padded inputs,
for each mode and combinations; 2 and 3 gloo ranks give one process's numbers; bad flags are named.

Run with ``python3 -m pytest tests/test_rollout_correction.py -q``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from spmd_rl.algo import rollout_correction
from spmd_rl.distributed.testing import run_distributed
from support.devices import cuda

B = 20
EPS = 1e-8
SAFE = 20.0


def _case(seed: int, rows: int = B, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.4
    rollout[1, 0] = old[1, 0] - 25.0  # beyond the safety bound: exp is clamped
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0], lengths[1], lengths[3] = width, 3, 0  # a full row, a short one, an empty one
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    rollout = torch.where(mask.bool(), rollout, torch.full_like(rollout, 7.0))  # garbage in the padding
    return old, rollout, mask


# --------------------------------------------------------------------------- the reference (lists, loops)


def _clamp(x, lo=-SAFE, hi=SAFE):
    return min(max(x, lo), hi)


def _rows(t):
    return [list(r) for r in t.tolist()]


class Ref:
    def __init__(self, old, rollout, mask):
        self.old, self.rol, self.mask = _rows(old), _rows(rollout), [[m > 0 for m in r] for r in mask.tolist()]
        self.lr = [[o - r for o, r in zip(ro, rr)] for ro, rr in zip(self.old, self.rol)]

    def tokens(self, table):
        return [v for row, mr in zip(table, self.mask) for v, m in zip(row, mr) if m]

    def row_sum(self, row, i):
        return sum(v for v, m in zip(row, self.mask[i]) if m)

    def row_mean(self, row, i):
        return self.row_sum(row, i) / (sum(self.mask[i]) + EPS)

    def n_tokens(self):
        return sum(sum(r) for r in self.mask)

    # ---- IS
    def weights(self, level, threshold, normalize):
        if level == "token":
            raw = [[math.exp(_clamp(x)) for x in row] for row in self.lr]
            for_metrics = None
        else:
            sums = [self.row_sum(row, i) for i, row in enumerate(self.lr)]
            raw = [[math.exp(_clamp(s))] * len(row) for s, row in zip(sums, self.lr)]
            for_metrics = sums
        w = [[x if m else 0.0 for x, m in zip(row, mr)] for row, mr in zip(raw, self.mask)]
        if isinstance(threshold, str) and "_" in threshold:
            lo, hi = (float(x) for x in threshold.split("_"))
            band = True
        else:
            hi, lo, band = float(threshold), 1.0 / float(threshold), False
        met = self.is_metrics(w, for_metrics, level, lo, hi)
        if band:
            out = [[not (lo <= x <= hi) for x in row] for row in raw]
            met["rollout_is_clipped_fraction"] = sum(map(float, self.tokens(out))) / (self.n_tokens() + EPS)
            if level == "token":
                seq = [any(o and m for o, m in zip(ro, mr)) for ro, mr in zip(out, self.mask)]
            else:
                seq = [row[0] for row in out]
            met["rollout_is_seq_clipped_fraction"] = sum(seq) / len(seq)
            w = [[x if lo <= r <= hi else 0.0 for x, r in zip(row, rr)] for row, rr in zip(w, raw)]
        else:
            w = [[min(x, hi) for x in row] for row in w]
        if normalize:
            if level == "token":
                mean = sum(self.tokens(w)) / self.n_tokens()
            else:
                valid = [i for i in range(len(w)) if any(self.mask[i])]
                mean = sum(self.row_mean(w[i], i) for i in valid) / len(valid)
            if mean > 1e-8:
                w = [[x / mean for x in row] for row in w]
            met["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
        return w, met

    def is_metrics(self, w, seq_log, level, lo, hi):
        toks = self.tokens(w)
        met = {"rollout_is_mean": sum(toks) / (len(toks) + EPS)}
        if level == "sequence":
            met["rollout_is_max"] = math.exp(min(max(seq_log), SAFE))
            met["rollout_is_min"] = math.exp(min(seq_log))
            met["rollout_is_ratio_fraction_high"] = sum(s > math.log(hi) for s in seq_log) / len(seq_log)
            met["rollout_is_ratio_fraction_low"] = sum(s < math.log(lo) for s in seq_log) / len(seq_log)
        else:
            met["rollout_is_max"], met["rollout_is_min"] = max(toks), min(toks)
            met["rollout_is_ratio_fraction_high"] = sum(x > hi for x in toks) / (len(toks) + EPS)
            met["rollout_is_ratio_fraction_low"] = sum(x < lo for x in toks) / (len(toks) + EPS)
        clamped = [min(max(x, lo), hi) for x in toks]
        mean_c = sum(clamped) / (len(toks) + EPS)
        var = sum(c * c for c in clamped) / (len(toks) + EPS) - mean_c ** 2
        met["rollout_is_std"] = math.sqrt(max(var, 0.0)) if len(toks) > 1 else 0.0
        met["rollout_is_eff_sample_size"] = 1.0 / (sum((c / (mean_c + EPS)) ** 2 for c in clamped) / (len(toks) + EPS))
        seq = [self.row_mean(row, i) for i, row in enumerate(w)]
        met.update(rollout_is_seq_mean=statistics.fmean(seq), rollout_is_seq_std=statistics.stdev(seq),
                   rollout_is_seq_max=max(seq), rollout_is_seq_min=min(seq),
                   rollout_is_seq_max_deviation=max(abs(s - 1) for s in seq),
                   rollout_is_seq_fraction_high=sum(s > hi for s in seq) / len(seq),
                   rollout_is_seq_fraction_low=sum(s < lo for s in seq) / len(seq))
        return met

    # ---- RS
    def rejection(self, rs, thresholds):
        options = rs.split(",")
        specs = thresholds.split(",") if len(thresholds.split(",")) > 1 else [thresholds] * len(options)
        keep_all = [[True] * len(r) for r in self.mask]
        met = {}
        for option, spec in zip(options, specs):
            keep, m = self.one_option(option, spec)
            met.update(m)
            keep_all = [[a and b for a, b in zip(ra, rb)] for ra, rb in zip(keep_all, keep)]
        out = [[float(not k) for k in row] for row in keep_all]
        met["rollout_rs_masked_fraction"] = sum(self.tokens(out)) / (self.n_tokens() + EPS)
        met["rollout_rs_seq_masked_fraction"] = sum(
            any((not k) and m for k, m in zip(rk, rm)) for rk, rm in zip(keep_all, self.mask)) / len(self.mask)
        return keep_all, met

    def one_option(self, option, spec):
        kind = option[-2:]
        safe = [[_clamp(x) for x in row] for row in self.lr]
        f = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(x) - 1 - x}[kind]
        tok = [[f(x) for x in row] for row in safe]
        if kind == "k1":
            lo_r, hi_r = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
            lo, hi = math.log(lo_r), math.log(hi_r)
            ok = lambda v: lo <= v <= hi  # noqa: E731
        else:
            lo, hi = 0.0, float(spec)
            ok = lambda v: v <= hi  # noqa: E731
        valid = [i for i in range(len(tok)) if any(self.mask[i])]
        if option.startswith("token"):
            stat, seq = tok, None
            keep = [[ok(v) for v in row] for row in tok]
            seq_values = [self.row_mean(tok[i], i) for i in valid]
        else:
            agg = option.split("_")[1]
            per_row = []
            for i, row in enumerate(tok):
                vals = [v for v, m in zip(row, self.mask[i]) if m]
                per_row.append({"sum": sum(vals), "mean": sum(vals) / (len(vals) + EPS),
                                "max": max(vals) if vals else 0.0}[agg])
            stat = [[s] * len(row) for s, row in zip(per_row, tok)]
            keep = [[ok(s)] * len(row) for s, row in zip(per_row, tok)]
            seq = per_row
            seq_values = [per_row[i] for i in valid]
        p, toks, n = f"rollout_rs_{option}", self.tokens(stat), self.n_tokens()
        met = {f"{p}_mean": sum(toks) / (n + EPS)}
        if seq is not None:
            met[f"{p}_max"], met[f"{p}_min"] = max(seq_values), min(seq_values)
            met[f"{p}_fraction_high"] = sum(v > hi for v in seq_values) / len(seq_values)
            met[f"{p}_fraction_low"] = sum(v < lo for v in seq_values) / len(seq_values) if kind == "k1" else 0.0
        else:
            met[f"{p}_max"], met[f"{p}_min"] = max(toks), min(toks)
            met[f"{p}_fraction_high"] = sum(v > hi for v in toks) / (n + EPS)
            met[f"{p}_fraction_low"] = sum(v < lo for v in toks) / (n + EPS) if kind == "k1" else 0.0
        clamped = [min(max(v, lo if kind == "k1" else 0.0), hi) for v in toks]
        mean_c = sum(clamped) / (n + EPS)
        met[f"{p}_std"] = math.sqrt(max(sum(c * c for c in clamped) / (n + EPS) - mean_c ** 2, 0.0))
        met.update({f"{p}_seq_mean": statistics.fmean(seq_values), f"{p}_seq_std": statistics.stdev(seq_values),
                    f"{p}_seq_max": max(seq_values), f"{p}_seq_min": min(seq_values),
                    f"{p}_seq_max_deviation": max(abs(v) for v in seq_values),
                    f"{p}_seq_fraction_high": sum(v > hi for v in seq_values) / len(seq_values)})
        if kind == "k1":
            met[f"{p}_seq_fraction_low"] = sum(v < lo for v in seq_values) / len(seq_values)
        out = [[float(not k) for k in row] for row in keep]
        met[f"{p}_masked_fraction"] = sum(self.tokens(out)) / (n + EPS)
        met[f"{p}_seq_masked_fraction"] = sum(
            any((not k) and m for k, m in zip(keep[i], self.mask[i])) for i in valid) / len(valid)
        return keep, met

    # ---- diagnostics
    def offpolicy(self):
        rows = range(len(self.old))
        mo = [self.row_mean(self.old[i], i) for i in rows]
        mr = [self.row_mean(self.rol[i], i) for i in rows]
        diff = [a - b for a, b in zip(mr, mo)]
        n = self.n_tokens()
        lr_tok = self.tokens(self.lr)
        seq = [_clamp(self.row_sum(self.lr[i], i)) for i in rows]
        return {"training_ppl": statistics.fmean(math.exp(-x) for x in mo), "training_log_ppl": -statistics.fmean(mo),
                "kl": -sum(lr_tok) / (n + EPS), "k3_kl": sum(math.exp(x) - x - 1 for x in lr_tok) / (n + EPS),
                "rollout_ppl": statistics.fmean(math.exp(-x) for x in mr), "rollout_log_ppl": -statistics.fmean(mr),
                "log_ppl_diff": statistics.fmean(diff), "log_ppl_abs_diff": statistics.fmean(abs(d) for d in diff),
                "log_ppl_diff_max": max(diff), "log_ppl_diff_min": min(diff),
                "ppl_ratio": statistics.fmean(math.exp(d) for d in diff),
                "chi2_token": sum(math.exp(_clamp(x)) ** 2 for x in lr_tok) / (n + EPS) - 1.0,
                "chi2_seq": statistics.fmean(math.exp(2 * s) for s in seq) - 1.0}


def reference(old, rollout, mask, *, is_level=None, is_threshold=2.0, is_batch_normalize=False, rs=None,
              rs_threshold=None):
    ref = Ref(old, rollout, mask)
    met, weights, new_mask = {}, None, mask.tolist()
    if is_level is not None:
        weights, m = ref.weights(is_level, is_threshold, is_batch_normalize)
        met.update(m)
    if rs is not None:
        keep, m = ref.rejection(rs, str(rs_threshold))
        met.update(m)
        new_mask = [[x * float(k) for x, k in zip(row, rk)] for row, rk in zip(new_mask, keep)]
    met.update(ref.offpolicy())
    return weights, new_mask, {f"rollout_corr/{k}": v for k, v in met.items()}


def assert_matches(got, want):
    (w, mask, met), (rw, rmask, rmet) = got, want
    assert (w is None) == (rw is None)
    if w is not None:
        torch.testing.assert_close(w, torch.tensor(rw, dtype=w.dtype), rtol=1e-6, atol=1e-6)
    assert mask.tolist() == rmask
    assert set(met) == set(rmet), sorted(set(met) ^ set(rmet))
    for k, v in rmet.items():
        assert met[k] == pytest.approx(v, rel=1e-6, abs=1e-6), k


# --------------------------------------------------------------------------- single process

CASES = [
    dict(),
    dict(is_level="token"),
    dict(is_level="token", is_threshold=1.5),
    dict(is_level="sequence", is_threshold=5.0),
    dict(is_level="token", is_batch_normalize=True),
    dict(is_level="sequence", is_batch_normalize=True, is_threshold=3.0),
    dict(is_level="token", is_threshold="0.8_1.25"),
    dict(is_level="sequence", is_threshold="0.3_2.0", is_batch_normalize=True),
    *[dict(rs=o, rs_threshold=t) for o, t in [
        ("token_k1", "0.7_1.3"), ("token_k1", "1.5"), ("token_k2", "0.05"), ("token_k3", "0.1"),
        ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", "0.3"), ("seq_sum_k3", "0.3"),
        ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k2", "0.05"), ("seq_mean_k3", "0.05"),
        ("seq_max_k2", "0.2"), ("seq_max_k3", "0.2")]],
    dict(rs="token_k1,seq_max_k2,seq_mean_k3", rs_threshold="0.6_1.6,0.3,0.04"),
    dict(rs="token_k3,seq_sum_k2", rs_threshold="0.2"),
    dict(is_level="token", is_threshold=2.0, rs="token_k1", rs_threshold="0.5_2.0"),
    dict(is_level="sequence", is_threshold="0.5_5.0", is_batch_normalize=True, rs="seq_mean_k1,seq_max_k3",
         rs_threshold="0.8_1.2,0.5"),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "diagnostics")
def test_matches_reference(kw) -> None:
    for seed in (0, 1):
        old, rollout, mask = _case(seed)
        assert_matches(rollout_correction(old, rollout, mask, **kw), reference(old, rollout, mask, **kw))


@cuda
@pytest.mark.parametrize("kw", CASES[::3], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "diagnostics")
def test_on_the_gpu_as_on_the_cpu(kw) -> None:
    """The batch's tensors on a GPU (as the actor holds them there): the same weights, mask and metrics."""
    old, rollout, mask = _case(0)
    w, m, met = rollout_correction(old, rollout, mask, **kw)
    gw, gm, gmet = rollout_correction(old.cuda(), rollout.cuda(), mask.cuda(), **kw)
    assert gm.is_cuda and torch.allclose(gm.cpu(), m)
    assert (w is None) == (gw is None) and (w is None or torch.allclose(gw.cpu(), w, atol=1e-6))
    assert gmet.keys() == met.keys() and all(gmet[k] == pytest.approx(met[k], rel=1e-5, abs=1e-9) for k in met)


def test_some_rows_rejected_and_weights_detached() -> None:
    old, rollout, mask = _case(2)
    old.requires_grad_(True)
    w, new, met = rollout_correction(old, rollout, mask, is_level="token", rs="seq_max_k2", rs_threshold="0.2")
    assert not w.requires_grad and w.dtype == old.dtype and new.dtype == mask.dtype
    assert 0 < met["rollout_corr/rollout_rs_seq_masked_fraction"] < 1
    assert ((new == 0) | (mask == 1)).all() and (w[mask == 0] == 0).all()
    w32, _, _ = rollout_correction(old.float(), rollout.float(), mask.float(), is_level="token")
    assert w32.dtype == torch.float32


def test_bad_inputs_name_the_flag() -> None:
    old, rollout, mask = _case(0)
    with pytest.raises(ValueError, match=r"algo.rollout_rs: unknown rejection option 'seq_max_k1'"):
        rollout_correction(old, rollout, mask, rs="seq_max_k1", rs_threshold="1.0")
    with pytest.raises(ValueError, match=r"algo.rollout_rs_threshold has 2 entries for the 3 options"):
        rollout_correction(old, rollout, mask, rs="token_k1,token_k2,seq_sum_k3", rs_threshold="2.0,1.0")
    with pytest.raises(ValueError, match=r"algo.rollout_rs=token_k2 needs algo.rollout_rs_threshold"):
        rollout_correction(old, rollout, mask, rs="token_k2")
    with pytest.raises(ValueError, match=r"algo.rollout_rs_threshold: option token_k2 takes one upper bound"):
        rollout_correction(old, rollout, mask, rs="token_k2", rs_threshold="0.5_2")
    with pytest.raises(ValueError, match=r"algo.rollout_is_threshold must be > 0"):
        rollout_correction(old, rollout, mask, is_level="token", is_threshold="2_1")
    with pytest.raises(ValueError, match=r"is_level \(algo.rollout_is\) must be None or one of"):
        rollout_correction(old, rollout, mask, is_level="geometric")
    with pytest.raises(ValueError, match="no valid token"):
        rollout_correction(old, rollout, torch.zeros_like(mask))


# --------------------------------------------------------------------------- N ranks = one process

DIST_CASES = [
    dict(is_level="token", is_batch_normalize=True, rs="token_k1,seq_max_k2", rs_threshold="0.6_1.6,0.3"),
    dict(is_level="sequence", is_threshold="0.3_4.0", is_batch_normalize=True, rs="seq_sum_k1,seq_mean_k3",
         rs_threshold="0.5_2.0,0.05"),
]


def _ranks(rank: int, world: int, cuts: list[int], duplicate: bool) -> list:
    """Rank ``rank``'s rows of the case (rows [cuts[rank], cuts[rank + 1])); with ``duplicate`` every
    rank after the first holds rank 0's rows again with sum_weight 0 besides (as sp ranks do), here
    modelled by a second call pattern: the last rank repeats its predecessor's rows, not counted."""
    import torch.distributed as dist

    old, rollout, mask = _case(5)
    lo, hi = cuts[rank], cuts[rank + 1]
    weight = 1.0
    if duplicate and rank == world - 1:
        lo, hi, weight = cuts[rank - 1], cuts[rank], 0.0
    out = []
    for kw in DIST_CASES:
        w, m, met = rollout_correction(old[lo:hi], rollout[lo:hi], mask[lo:hi], **kw, group=dist.group.WORLD,
                                       sum_weight=weight)
        out.append((w, m, met))
    return out


@pytest.mark.parametrize("world,cuts,duplicate", [(2, [0, 7, 20], False), (3, [0, 12, 20, 20], True),
                                                  (3, [0, 3, 3, 20], False)])
def test_ranks_match_one_process(world: int, cuts: list[int], duplicate: bool) -> None:
    """Uneven shares, a rank without rows, and a rank whose rows another counts (sum_weight 0)."""
    results = run_distributed(_ranks, world, cuts, duplicate)
    old, rollout, mask = _case(5)
    for i, kw in enumerate(DIST_CASES):
        w, m, met = rollout_correction(old, rollout, mask, **kw)
        ranks = range(world - 1) if duplicate else range(world)
        got_w = torch.cat([results[r][i][0] for r in ranks])
        got_m = torch.cat([results[r][i][1] for r in ranks])
        torch.testing.assert_close(got_w, w, rtol=1e-9, atol=1e-12)
        assert torch.equal(got_m, m)
        for r in range(world):
            assert results[r][i][2].keys() == met.keys()
            for k, v in met.items():
                assert results[r][i][2][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (r, k)


# --------------------------------------------------------------------------- the update (ActorUpdate, a fake engine)


class _Engine:
    """Runs ``loss_fn`` on each micro-batch with the rows' stored "current" log-probs (``_lp``)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.forwards = 0

    def micro_batches(self, mini, *, micro_batch_size):
        return list(mini.split(micro_batch_size))

    def compute_logprobs(self, batch, *, temperature, micro_batch_size, with_entropy=False):
        self.forwards += 1
        return batch["_lp"].clone(), None

    def train_mini_batch(self, micros, loss_fn, *, temperature, need_entropy_grad):
        for micro in micros:
            loss, _ = loss_fn(micro["_lp"].clone().requires_grad_(True), None, micro)
            self.losses.append(loss.detach())
        return {"grad_norm": 0.0, "lr": 0.0}


def _update_batch():
    from spmd_rl.data.batch import RolloutBatch

    old, rollout, mask = _case(7, rows=8, width=6)
    adv = torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return RolloutBatch(prompts=[[1, 2]] * 8, tensors={"response_mask": mask, "rollout_logprobs": rollout,
                                                       "advantages": adv, "_lp": old})


@pytest.mark.parametrize("algo_kw", [
    dict(rollout_is="sequence", rollout_is_threshold="0.3_4.0", rollout_is_batch_normalize=True,
         rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.6_1.6,0.3"),
    dict(rollout_is="token", rollout_is_threshold=1.5),
])
def test_update_drops_rejected_tokens_from_loss_and_counts(algo_kw) -> None:
    """The update's loss, summed over micro-batches, is the objective of the whole batch over the mask
    after rejection, weighted by the step's (batch-normalised) weights, and divided by the kept tokens."""
    from spmd_rl.actor import ActorUpdate
    from spmd_rl.algo.objective import actor_objective
    from spmd_rl.config import Config
    from spmd_rl.metrics import MetricAccumulator

    cfg = Config()
    cfg.algo.use_kl_loss = False
    for k, v in algo_kw.items():
        setattr(cfg.algo, k, v)
    cfg.actor.micro_batch_size = 3
    engine, acc, batch = _Engine(), MetricAccumulator(), _update_batch()
    ActorUpdate(engine, cfg=cfg, mini_batches=1, sum_weight=1.0, group=None, device=torch.device("cpu"),
                temperature=1.0, logs_rollout_gap=True)(batch, acc)
    old, rollout, mask = batch["_lp"], batch["rollout_logprobs"], batch["response_mask"]
    w, kept, met = rollout_correction(old, rollout, mask, is_level=cfg.algo.rollout_is_level,
                                      is_threshold=cfg.algo.rollout_is_threshold,
                                      is_batch_normalize=cfg.algo.rollout_is_batch_normalize,
                                      rs=cfg.algo.rollout_rs, rs_threshold=cfg.algo.rollout_rs_threshold)
    want, _ = actor_objective(old, None, old_logprobs=old, advantages=batch["advantages"], response_mask=kept,
                              ref_logprobs=None, algo=cfg.algo, global_tokens=kept.sum().item(), global_seqs=8.0,
                              rollout_logprobs=rollout, is_weights=w)
    assert sum(engine.losses).item() == pytest.approx(want.item(), rel=1e-9)
    assert engine.forwards == (1 if cfg.algo.rollout_rs else 0)  # the old log-probs the rejection needs
    got = acc.reduce()
    for k, v in met.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert "rollout/logprob_abs_diff" in got and "rollout/is_weight_mean" in got
    if cfg.algo.rollout_rs:
        assert kept.sum() < mask.sum() and 0 < got["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert "loss_mask" not in batch and "is_weights" not in batch  # the step's correction is the update's only


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize("flags,message", [
    (["--algo.rollout-rs", "seq_max_k9", "--algo.rollout-rs-threshold", "1"], "algo.rollout_rs: unknown rejection option 'seq_max_k9'"),
    (["--algo.rollout-rs", "token_k1,seq_max_k2", "--algo.rollout-rs-threshold", "0.5_2,1,3"],
     "algo.rollout_rs_threshold has 3 entries for the 2 options of algo.rollout_rs"),
    (["--algo.rollout-rs", "token_k3"], "algo.rollout_rs=token_k3 needs algo.rollout_rs_threshold"),
    (["--algo.rollout-rs-threshold", "2"], "algo.rollout_rs_threshold=2 is set but algo.rollout_rs is not"),
    (["--algo.rollout-is", "token", "--algo.rollout-is-threshold", "abc"], "algo.rollout_is_threshold must be a number"),
    (["--algo.rollout-is-batch-normalize"], "algo.rollout_is_batch_normalize normalises importance weights"),
    (["--algo.rollout-is", "token_truncated", "--algo.rollout-is-cap", "0.5"], "algo.rollout_is_cap must be >= 1, got 0.5"),
])
def test_flags_refused_by_name(flags, message) -> None:
    from spmd_rl.config import load_config

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(flags)


def test_flags_and_old_yaml_load(tmp_path) -> None:
    from spmd_rl.config import load_config, to_yaml

    cfg = load_config(["--algo.rollout-is", "sequence", "--algo.rollout-is-threshold", "0.5_5.0",
                       "--algo.rollout-is-batch-normalize", "--algo.rollout-rs", "token_k1,seq_max_k2",
                       "--algo.rollout-rs-threshold", "0.5_2.0,0.3"])
    assert (cfg.algo.rollout_is_level, cfg.algo.rollout_is_threshold, cfg.algo.rollout_rs_threshold) == \
        ("sequence", "0.5_5.0", "0.5_2.0,0.3")
    old = tmp_path / "old.yaml"
    old.write_text("algo:\n  rollout_is: token_truncated\n  rollout_is_cap: 3.0\n")
    cfg = load_config(["--config", str(old)])
    assert (cfg.algo.rollout_is_level, float(cfg.algo.rollout_is_threshold)) == ("token", 3.0)
    again = tmp_path / "again.yaml"
    again.write_text(to_yaml(cfg))
    assert load_config(["--config", str(again)]).algo == cfg.algo


def test_update_with_every_token_rejected_has_zero_loss() -> None:
    from spmd_rl.actor import ActorUpdate
    from spmd_rl.config import Config
    from spmd_rl.metrics import MetricAccumulator

    cfg = Config()
    cfg.algo.use_kl_loss, cfg.algo.rollout_rs, cfg.algo.rollout_rs_threshold = False, "token_k2", "1e-30"
    engine, acc, batch = _Engine(), MetricAccumulator(), _update_batch()
    ActorUpdate(engine, cfg=cfg, mini_batches=1, sum_weight=1.0, group=None, device=torch.device("cpu"),
                temperature=1.0, logs_rollout_gap=False)(batch, acc)
    assert all(loss.item() == 0.0 for loss in engine.losses) and acc.reduce()["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1.0)
