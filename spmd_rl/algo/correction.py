"""Rollout correction: importance weights, rejection of divergent tokens or sequences, and the
diagnostics of the gap between the policy that sampled (the rollout engine) and the trainer's.

    weights, mask, metrics = rollout_correction(old_logprobs, rollout_logprobs, response_mask,
                                                is_level="token", is_threshold=2.0,
                                                rs="token_k1,seq_max_k2", rs_threshold="0.5_2.0,2.0")
    loss_token = weights * policy_loss_token      # over `mask`: rejected tokens leave the loss

The definitions and metric names are verl's ``compute_rollout_correction_and_rejection_mask``
(``verl/trainer/ppo/rollout_corr_helper.py``; docs "rollout_corr"), with r = pi_old / pi_rollout per
token, ``log r = old - rollout`` clamped to [-20, 20] wherever it is exponentiated:

* ``is_level="token"``: w_t = r_t; ``"sequence"``: w_t = prod_t r_t of the row. A number
  ``is_threshold`` truncates (``min(w, threshold)``, TIS); ``"L_U"`` keeps weights in [L, U] and sets
  the others to 0 (IcePop's band; verl's former ``rollout_is_mode=clip``). ``is_batch_normalize``
  divides the weights by their mean over the batch's tokens (token level) or sequences (sequence
  level). Weights are detached and 0 on padding.
* ``rs``: comma-separated criteria (:data:`spmd_rl.algo.ROLLOUT_RS_OPTIONS`), every one must pass; a
  rejected token (token criteria) or sequence (sequence criteria) is 0 in the returned mask. k1 options
  keep -log r (or its row sum / mean) in [log L, log U]; k2 / k3 options keep the statistic <= U.
* ``metrics``: ``rollout_corr/...`` floats: the weights' statistics before truncation
  (``rollout_is_*``: mean, std and ESS of the weights clamped to [1/U, U], max, min, shares above U and
  below 1/U, per-sequence means), each rejection option's statistic (``rollout_rs_<option>_*``) and
  the masked shares, and the mismatch diagnostics, always: ``kl`` (k1 estimate of
  KL(rollout || trainer)), ``k3_kl``, ``training_ppl`` / ``rollout_ppl`` (mean per-sequence perplexity)
  and their logs, ``log_ppl_diff`` (+ abs, max, min), ``ppl_ratio``, ``chi2_token`` (E[r^2] - 1) and
  ``chi2_seq`` (E[(prod r)^2] - 1).

As verl, a row without any valid token still counts in the statistics taken over rows (the
perplexities, ``chi2_seq``, ``rollout_is_seq_*``, ``rollout_rs_seq_masked_fraction``), with 0 as its
mean log-prob. Statistics are computed in float64.

Data parallelism: with ``group`` every statistic (and the batch normalisation) is taken over the rows
of all ranks of the group, so N ranks give one process's numbers; ``sum_weight`` 0 marks a rank whose
rows another rank of the group already counts (Ulysses sp ranks, tp / pp ranks of megatron).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from spmd_rl.algo import ROLLOUT_IS_LEVELS, parse_is_threshold, parse_rollout_rs

__all__ = ["SAFETY_BOUND", "NoValidToken", "rollout_correction", "importance_weights"]

SAFETY_BOUND = 20.0
"""log r is clamped to [-20, 20] before it is exponentiated."""
EPS = 1e-8  # verl's masked_mean: sum / (count + 1e-8)
PREFIX = "rollout_corr/"


class NoValidToken(ValueError):
    """:func:`rollout_correction` of a batch (over the group) without any valid token."""


class _Global:
    """Scalars summed, maxed and minned over a group's ranks, each kind in one packed all-reduce."""

    def __init__(self, group: dist.ProcessGroup | None, sum_weight: float) -> None:
        self.group, self.sum_weight = group, float(sum_weight)
        self.distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1

    def _reduce(self, values: dict[str, torch.Tensor], op: str) -> dict[str, float]:
        if not values:
            return {}
        counts = self.sum_weight > 0
        fill = {"sum": 0.0, "max": -math.inf, "min": math.inf}[op]
        # the batch's tensors may live on a GPU and a count on the host: one device for the stack
        dev = next(iter(values.values())).device
        packed = torch.stack([v.double().reshape(()).to(dev) if counts else torch.tensor(fill, dtype=torch.float64,
                                                                                        device=dev)
                              for v in values.values()]).cpu()
        if op == "sum":
            packed = packed * self.sum_weight
        if self.distributed:
            red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            dist.all_reduce(packed, op=red, group=self.group)
        return dict(zip(values, packed.tolist()))

    def sums(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return self._reduce(values, "sum")

    def maxes(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return self._reduce(values, "max")

    def mins(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        return self._reduce(values, "min")


def _msum(x: torch.Tensor, keep: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``keep`` (garbage outside it, NaN or inf included, never leaks in)."""
    z = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def _amax(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.full((), -math.inf, dtype=x.dtype, device=x.device)).amax() if x.numel() \
        else torch.tensor(-math.inf, dtype=torch.float64)


def _amin(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.full((), math.inf, dtype=x.dtype, device=x.device)).amin() if x.numel() \
        else torch.tensor(math.inf, dtype=torch.float64)


class _Batch:
    """The float64 views every statistic reads: log r, the token mask and the rows."""

    def __init__(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        self.old, self.rollout = old.detach().double(), rollout.detach().double()
        self.keep = mask.detach() != 0
        self.m = self.keep.double()
        self.log_ratio = self.old - self.rollout
        self.safe = self.log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        self.row_tokens = self.m.sum(-1)
        self.row_valid = self.row_tokens > 0
        self.all_rows = torch.ones_like(self.row_valid)

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        return _msum(x, self.keep, -1) / (self.row_tokens + EPS)

    def row_sum(self, x: torch.Tensor) -> torch.Tensor:
        return _msum(x, self.keep, -1)


def importance_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       level: str, threshold: float | str) -> torch.Tensor:
    """The importance weights of one micro-batch, without batch normalisation or metrics (each
    token's or row's weight depends on its own row only): truncated at a number ``threshold``, 0
    outside an ``"L_U"`` band; detached, 0 on padding, in ``old_logprobs``' dtype."""
    b = _Batch(old_logprobs, rollout_logprobs, mask)
    raw = _raw_weights(b, level)
    return (_apply_threshold(raw, *parse_is_threshold(threshold)) * b.m).to(old_logprobs.dtype)


def _raw_weights(b: _Batch, level: str) -> torch.Tensor:
    """exp of the clamped log-ratio of each token (``token``) or of its row's sum (``sequence``), [B, T]."""
    if level == "token":
        return torch.exp(b.safe)
    seq = b.row_sum(b.log_ratio).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(seq).unsqueeze(-1).expand_as(b.m)


def _apply_threshold(raw: torch.Tensor, lower: float | None, upper: float) -> torch.Tensor:
    if lower is None:
        return raw.clamp(max=upper)
    return raw * ((raw >= lower) & (raw <= upper)).double()


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       is_level: str | None = None, is_threshold: float | str = 2.0, is_batch_normalize: bool = False,
                       rs: str | None = None, rs_threshold: float | str | None = None,
                       group: dist.ProcessGroup | None = None, sum_weight: float = 1.0,
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """``(is_weights or None, mask, metrics)`` (module docstring): weights ``[B, T]`` when ``is_level``
    is set, the mask with rejected tokens / rows set to 0 (``mask``'s dtype), the ``rollout_corr/*``
    metrics. ``group`` / ``sum_weight``: statistics over the ranks of a data-parallel group (every
    rank must call). Raises ValueError on a bad option or threshold, and when the batch (over the
    group) has no valid token."""
    for name, t in (("rollout_logprobs", rollout_logprobs), ("mask", mask)):
        if t.shape != old_logprobs.shape or old_logprobs.dim() != 2:
            raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)} and {name} {tuple(t.shape)} must be the same [B, T]")
    if is_level is not None and is_level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"is_level (algo.rollout_is) must be None or one of {list(ROLLOUT_IS_LEVELS)}, got {is_level!r}")
    band = parse_is_threshold(is_threshold) if is_level is not None else None
    rules = parse_rollout_rs(rs, rs_threshold) if rs is not None else []
    b, red = _Batch(old_logprobs, rollout_logprobs, mask), _Global(group, sum_weight)
    n = red.sums({"tokens": b.m.sum(), "rows": torch.tensor(float(len(b.m))), "valid_rows": b.row_valid.sum()})
    if n["tokens"] <= 0:
        raise NoValidToken("rollout_correction: the mask has no valid token")
    metrics: dict[str, float] = {}
    weights = None
    if is_level is not None:
        weights = _is_part(b, red, n, is_level, *band, is_batch_normalize, metrics)
        weights = weights.to(old_logprobs.dtype)
    keep = torch.ones_like(b.keep)
    if rules:
        keep = _rs_part(b, red, n, rules, metrics)
    metrics.update(_offpolicy_metrics(b, red, n))
    new_mask = (mask * keep.to(mask.dtype)) if rules else mask.clone()
    return weights, new_mask, {PREFIX + k: float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------- importance weights


def _is_part(b: _Batch, red: _Global, n: dict[str, float], level: str, lower: float | None, upper: float,
             normalize: bool, metrics: dict[str, float]) -> torch.Tensor:
    """The weights (thresholded, batch-normalised) and their ``rollout_is_*`` metrics."""
    raw = _raw_weights(b, level)
    w = raw * b.m  # before truncation: what the metrics describe
    low_m = lower if lower is not None else 1.0 / upper
    metrics.update(_weight_stats(b, red, n, w, level, low_m, upper))
    if lower is not None:  # IcePop's band: shares of tokens / rows set to 0
        out = ~((raw >= lower) & (raw <= upper))
        seq_out = (out & b.keep).any(-1) if level == "token" else out[:, 0] if out.shape[1] else b.row_valid & False
        s = red.sums({"out": _msum(out.double(), b.keep), "seq_out": seq_out.double().sum()})
        metrics["rollout_is_clipped_fraction"] = s["out"] / (n["tokens"] + EPS)
        metrics["rollout_is_seq_clipped_fraction"] = s["seq_out"] / n["rows"]
    w = _apply_threshold(raw, lower, upper) * b.m
    if normalize:
        if level == "token":
            s = red.sums({"w": _msum(w, b.keep), "n": b.m.sum()})
        else:
            seq_w = b.row_mean(w)
            s = red.sums({"w": (seq_w * b.row_valid.double()).sum(), "n": b.row_valid.double().sum()})
        mean = s["w"] / max(s["n"], EPS)
        if mean > EPS:
            w = w / mean
        metrics["rollout_is_batch_norm_factor"] = mean if mean > EPS else 1.0
    return w


def _weight_stats(b: _Batch, red: _Global, n: dict[str, float], w: torch.Tensor, level: str, low: float,
                  high: float) -> dict[str, float]:
    """verl's ``compute_is_metrics`` of the untruncated weights ``w`` (0 on padding)."""
    keep, tok = b.keep, n["tokens"] + EPS
    clamped = w.clamp(low, high)
    seq_w = b.row_mean(w)  # every row, the empty ones 0
    sums = {"w": _msum(w, keep), "c1": _msum(clamped, keep), "c2": _msum(clamped.square(), keep),
            "seq": seq_w.sum(), "seq_hi": (seq_w > high).double().sum(), "seq_lo": (seq_w < low).double().sum()}
    maxes = {"seq_max": _amax(seq_w, b.all_rows), "seq_dev": _amax((seq_w - 1.0).abs(), b.all_rows)}
    mins = {"seq_min": _amin(seq_w, b.all_rows)}
    if level == "sequence":  # from the row's log-ratio sum, unclamped where it is not exponentiated
        log_seq = b.row_sum(b.log_ratio)
        sums.update(hi=(log_seq > math.log(high)).double().sum(), lo=(log_seq < math.log(low)).double().sum())
        maxes["max"], mins["min"] = _amax(log_seq, b.all_rows), _amin(log_seq, b.all_rows)
    else:
        sums.update(hi=_msum((w > high).double(), keep), lo=_msum((w < low).double(), keep))
        maxes["max"], mins["min"] = _amax(w, keep), _amin(w, keep)
    s, mx, mn = red.sums(sums), red.maxes(maxes), red.mins(mins)
    rows = n["rows"]
    out = {"rollout_is_mean": s["w"] / tok}
    if level == "sequence":
        out.update(rollout_is_max=math.exp(min(mx["max"], SAFETY_BOUND)), rollout_is_min=_exp(mn["min"]),
                   rollout_is_ratio_fraction_high=s["hi"] / rows, rollout_is_ratio_fraction_low=s["lo"] / rows)
    else:
        out.update(rollout_is_max=mx["max"], rollout_is_min=mn["min"],
                   rollout_is_ratio_fraction_high=s["hi"] / tok, rollout_is_ratio_fraction_low=s["lo"] / tok)
    mean_c = s["c1"] / tok
    out["rollout_is_std"] = math.sqrt(max(s["c2"] / tok - mean_c ** 2, 0.0)) if n["tokens"] > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / (s["c2"] / (mean_c + EPS) ** 2 / tok)
    seq_mean = s["seq"] / rows
    out.update(rollout_is_seq_mean=seq_mean, rollout_is_seq_std=_std(red, seq_w, b.all_rows, seq_mean, rows),
               rollout_is_seq_max=mx["seq_max"], rollout_is_seq_min=mn["seq_min"],
               rollout_is_seq_max_deviation=mx["seq_dev"], rollout_is_seq_fraction_high=s["seq_hi"] / rows,
               rollout_is_seq_fraction_low=s["seq_lo"] / rows)
    return out


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _std(red: _Global, values: torch.Tensor, keep: torch.Tensor, mean: float, count: float) -> float:
    """The sample standard deviation (n - 1) of ``values[keep]`` over the group, ``mean`` their global mean."""
    centered = red.sums({"sq": _msum((values - mean).square(), keep)})["sq"]
    return math.sqrt(centered / (count - 1)) if count > 1 else 0.0


# --------------------------------------------------------------------------- rejection


def _rs_part(b: _Batch, red: _Global, n: dict[str, float], rules: list[tuple[str, float | None, float]],
             metrics: dict[str, float]) -> torch.Tensor:
    """The tokens every rule keeps ([B, T] bool) and each rule's ``rollout_rs_<option>_*`` metrics."""
    token = {"k1": -b.safe, "k2": 0.5 * b.safe.square(), "k3": torch.exp(b.safe) - 1.0 - b.safe}
    keep_all = torch.ones_like(b.keep)
    for option, lower, upper in rules:
        kind = option[-2:]
        if option.startswith("token_"):
            stat, seq_stat = token[kind], None
        else:
            agg = option.split("_")[1]
            seq_stat = {"sum": b.row_sum, "mean": b.row_mean, "max": lambda x: _row_max(b, x)}[agg](token[kind])
            stat = seq_stat.unsqueeze(-1).expand_as(b.m)
        if lower is not None:  # k1: ratio bounds, compared in log space
            lo_m, hi_m = math.log(lower), math.log(upper)
            keep = (stat >= lo_m) & (stat <= hi_m)
        else:
            lo_m, hi_m = 0.0, upper
            keep = stat <= hi_m
        keep_all &= keep
        metrics.update(_rs_stats(b, red, n, option, stat, seq_stat, keep, lo_m, hi_m, lower is not None))
    rejected_rows = (~keep_all & b.keep).any(-1).double().sum()
    s = red.sums({"out": _msum((~keep_all).double(), b.keep), "rows": rejected_rows})
    metrics["rollout_rs_masked_fraction"] = s["out"] / (n["tokens"] + EPS)
    metrics["rollout_rs_seq_masked_fraction"] = s["rows"] / n["rows"]
    return keep_all


def _row_max(b: _Batch, x: torch.Tensor) -> torch.Tensor:
    """Each row's largest value over its valid tokens; 0 for a row without any."""
    top = torch.where(b.keep, x, torch.full((), -math.inf, dtype=x.dtype)).amax(-1) if x.shape[-1] \
        else torch.zeros(len(x), dtype=x.dtype)
    return torch.where(b.row_valid, top, torch.zeros_like(top))


def _rs_stats(b: _Batch, red: _Global, n: dict[str, float], option: str, stat: torch.Tensor,
              seq_stat: torch.Tensor | None, keep: torch.Tensor, lo: float, hi: float, two_sided: bool) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` of one option, plus its masked shares."""
    tok, valid = n["tokens"] + EPS, b.row_valid
    seq_values = seq_stat if seq_stat is not None else b.row_mean(stat)
    clamped = stat.clamp(min=lo if two_sided else 0.0, max=hi)
    vd = valid.double()
    sums = {"mean": _msum(stat, b.keep), "c1": _msum(clamped, b.keep), "c2": _msum(clamped.square(), b.keep),
            "seq": _msum(seq_values, valid), "seq_hi": _msum((seq_values > hi).double(), valid),
            "seq_lo": _msum((seq_values < lo).double(), valid), "out": _msum((~keep).double(), b.keep),
            "seq_out": ((~keep & b.keep).any(-1).double() * vd).sum(),
            "hi": _msum((stat > hi).double(), b.keep), "lo": _msum((stat < lo).double(), b.keep)}
    maxes = {"seq_max": _amax(seq_values, valid), "seq_dev": _amax(seq_values.abs(), valid), "max": _amax(stat, b.keep)}
    mins = {"seq_min": _amin(seq_values, valid), "min": _amin(stat, b.keep)}
    s, mx, mn = red.sums(sums), red.maxes(maxes), red.mins(mins)
    rows, p = n["valid_rows"], f"rollout_rs_{option}"
    out = {f"{p}_mean": s["mean"] / tok}
    if seq_stat is not None and rows > 0:
        out.update({f"{p}_max": mx["seq_max"], f"{p}_min": mn["seq_min"], f"{p}_fraction_high": s["seq_hi"] / rows,
                    f"{p}_fraction_low": s["seq_lo"] / rows if two_sided else 0.0})
    else:
        out.update({f"{p}_max": mx["max"], f"{p}_min": mn["min"], f"{p}_fraction_high": s["hi"] / tok,
                    f"{p}_fraction_low": s["lo"] / tok if two_sided else 0.0})
    mean_c = s["c1"] / tok
    out[f"{p}_std"] = math.sqrt(max(s["c2"] / tok - mean_c ** 2, 0.0)) if n["tokens"] > 1 else 0.0
    if rows > 0:
        seq_mean = s["seq"] / rows
        out.update({f"{p}_seq_mean": seq_mean, f"{p}_seq_std": _std(red, seq_values, valid, seq_mean, rows),
                    f"{p}_seq_max": mx["seq_max"], f"{p}_seq_min": mn["seq_min"], f"{p}_seq_max_deviation": mx["seq_dev"],
                    f"{p}_seq_fraction_high": s["seq_hi"] / rows})
        if two_sided:
            out[f"{p}_seq_fraction_low"] = s["seq_lo"] / rows
    out[f"{p}_masked_fraction"] = s["out"] / tok
    out[f"{p}_seq_masked_fraction"] = s["seq_out"] / rows if rows > 0 else 0.0
    return out


# --------------------------------------------------------------------------- diagnostics


def _offpolicy_metrics(b: _Batch, red: _Global, n: dict[str, float]) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: KL, perplexities and chi^2 of the rollout / trainer gap."""
    old_mean, roll_mean = b.row_mean(b.old), b.row_mean(b.rollout)
    diff = roll_mean - old_mean
    seq_sum = b.row_sum(b.log_ratio).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    s = red.sums({"kl": _msum(b.rollout - b.old, b.keep), "k3": _msum(torch.exp(b.log_ratio) - b.log_ratio - 1, b.keep),
                  "train_ppl": torch.exp(-old_mean).sum(), "train_log_ppl": (-old_mean).sum(),
                  "roll_ppl": torch.exp(-roll_mean).sum(), "roll_log_ppl": (-roll_mean).sum(),
                  "diff": diff.sum(), "abs_diff": diff.abs().sum(), "ratio": torch.exp(diff).sum(),
                  "chi2_token": _msum(torch.exp(b.safe).square(), b.keep), "chi2_seq": torch.exp(2.0 * seq_sum).sum()})
    mx, mn = red.maxes({"diff": _amax(diff, b.all_rows)}), red.mins({"diff": _amin(diff, b.all_rows)})
    tok, rows = n["tokens"] + EPS, n["rows"]
    return {"training_ppl": s["train_ppl"] / rows, "training_log_ppl": s["train_log_ppl"] / rows,
            "kl": s["kl"] / tok, "k3_kl": s["k3"] / tok,
            "rollout_ppl": s["roll_ppl"] / rows, "rollout_log_ppl": s["roll_log_ppl"] / rows,
            "log_ppl_diff": s["diff"] / rows, "log_ppl_abs_diff": s["abs_diff"] / rows,
            "log_ppl_diff_max": mx["diff"], "log_ppl_diff_min": mn["diff"], "ppl_ratio": s["ratio"] / rows,
            "chi2_token": s["chi2_token"] / tok - 1.0, "chi2_seq": s["chi2_seq"] / rows - 1.0}
