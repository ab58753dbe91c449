"""Build the run's scorer from ``reward.*`` and call it safely on a batch of completions.

``reward.fn`` picks the main scorer: ``auto`` (``math`` for arithmetic / file / gsm8k, ``countdown``
for countdown), a built-in name (``math``, ``countdown``, ``format``, ``none`` = 0 for every
response, for a reward model alone) or a user function
``module:function`` (``module:Class.attr`` also works) importable from ``sys.path``, with the
signature::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

``columns`` are ``answer`` plus every sample column, as lists aligned with ``completions``. A
function without ``**kwargs`` receives only the columns it names. Usage::

    scorer = build_scorer(fn=cfg.reward.fn, task=cfg.data.task, format_weight=cfg.reward.format_weight,
                          on_error=cfg.reward.on_error, timeout_s=cfg.reward.timeout_s)
    result = scorer(prompts, completions, columns_of(samples))   # ScoreResult

A scorer that raises or returns the wrong number of scores, non-numbers, NaN or inf either stops
the run with :class:`RewardError` naming the scorer, the sample and an excerpt
(``on_error=raise``), or scores that sample 0.0 and counts it (``on_error=skip``). When a batch
call fails as a whole, the samples are re-scored one by one to find the bad ones.

A user function that does not return within ``reward.timeout_s`` seconds (0 = no limit) stops the
run with :class:`RewardError` naming the function and the call's first sample, after ``timeout_s``
(the samples are not scored again one by one, which would wait as long again), whatever ``on_error``
says: the call runs in a daemon thread that Python cannot stop, so the hung call keeps running there
until the process exits, and going on would pile such threads up. The built-in scorers run in the
calling thread with no limit (``math`` keeps math-verify's own per-answer timeouts, which need the
main thread).
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from spmd_rl.reward.countdown import countdown_reward
from spmd_rl.reward.format import format_reward
from spmd_rl.reward.math import math_reward
from spmd_rl.user_code import import_object

ScoreFn = Callable[..., Any]

def no_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Batch scorer ``reward.fn=none``: 0 for every completion (the reward model scores alone)."""
    return [0.0] * len(completions)


BUILTIN: dict[str, ScoreFn] = {"math": math_reward, "countdown": countdown_reward, "format": format_reward,
                               "none": no_reward}
AUTO: dict[str, str] = {"arithmetic": "math", "file": "math", "gsm8k": "math", "countdown": "countdown",
                         "guess_number": "math", "python_math": "math"}
_EXCERPT = 80


class RewardError(RuntimeError):
    """A scorer failed on a sample and ``reward.on_error=raise``."""


@dataclass
class ScoreResult:
    scores: list[float]
    """Total score per completion: main + ``format_weight`` * format."""
    num_errors: int
    """Samples the main scorer failed on (scored 0.0; only with ``on_error=skip``)."""
    format_scores: list[float] | None
    """Format reward per completion when ``format_weight`` is not 0, else None."""
    main_scores: list[float]
    """The main scorer's score per completion, without the format bonus (0.0 where it failed)."""
    model_scores: list[float] | None = None
    """Reward-model score per completion when ``reward.model.path`` is set (already in ``scores``,
    times ``reward.model.weight``), else None."""


def _excerpt(text: Any) -> str:
    s = str(text)
    return repr(s if len(s) <= _EXCERPT else s[: _EXCERPT - 3] + "...")


def load_user_fn(spec: str) -> ScoreFn:
    """Import ``module:function``; every failure is a ``ValueError`` naming ``reward.fn``."""
    flag = f"reward.fn={spec}"
    obj = import_object(spec, flag=flag,
                        usage=f"`auto`, a built-in scorer ({', '.join(BUILTIN)}) or `module:function`")
    if not callable(obj):
        module_name, _, attr_path = spec.partition(":")
        raise ValueError(f"{flag}: {module_name}.{attr_path} is a {type(obj).__name__}, not a function")
    return obj


def _signature_columns(fn: ScoreFn) -> tuple[set[str] | None, set[str]]:
    """``(accepted, required)`` column names of ``fn``'s keyword parameters after its first two
    positional ones; ``accepted`` is None when it takes ``**kwargs`` (or cannot be inspected)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, set()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    skip = [p.name for p in params if p.kind in positional][:2]
    named = [p for p in params if p.name not in skip
             and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    required = {p.name for p in named if p.default is inspect.Parameter.empty}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None, required
    return {p.name for p in named}, required


class _BatchError(Exception):
    """The scoring call failed as a whole (raised, or returned no list of the right length)."""


class _Timeout(_BatchError):
    """The scoring call did not return within ``reward.timeout_s``."""


def _call_with_timeout(fn: ScoreFn, timeout_s: float, name: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, in a daemon thread when ``timeout_s`` > 0; ``_Timeout`` when it has not
    returned after ``timeout_s`` seconds (the thread cannot be stopped: it is left to run)."""
    if timeout_s <= 0:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            box["err"] = e

    worker = threading.Thread(target=target, name=f"spmd_rl reward.fn={name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _Timeout(f"did not return within reward.timeout_s={timeout_s:g} s (the call is left running in a "
                       "daemon thread; raise --reward.timeout-s if it is only slow, 0 = no limit)")
    if "err" in box:
        raise box["err"]
    return box["out"]


class Scorer:
    """A scoring function with the run's error policy and format bonus (see the module docstring)."""

    def __init__(self, fn: ScoreFn, *, name: str, format_weight: float, on_error: str, timeout_s: float = 0.0) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"reward.on_error must be `raise` or `skip`, got {on_error!r}")
        if not timeout_s >= 0:
            raise ValueError(f"reward.timeout_s must be >= 0 (0 = no limit), got {timeout_s}")
        self.timeout_s = timeout_s
        if not math.isfinite(format_weight):
            raise ValueError(f"reward.format_weight must be finite, got {format_weight}")
        self.fn = fn
        self.name = name
        self.format_weight = format_weight
        self.on_error = on_error
        self._accepts, self._required = _signature_columns(fn)

    def _call(self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> list[float | str]:
        """Scores of one call; a bad element is returned as the reason string, a failed call
        raises ``_BatchError``."""
        kwargs = columns if self._accepts is None else {k: v for k, v in columns.items() if k in self._accepts}
        try:
            out = _call_with_timeout(self.fn, self.timeout_s, self.name, prompts, completions, **kwargs)
        except _Timeout:
            raise
        except Exception as e:
            raise _BatchError(f"raised {type(e).__name__}: {e}") from e
        if hasattr(out, "tolist"):
            out = out.tolist()
        if not isinstance(out, (list, tuple)):
            raise _BatchError(f"returned a {type(out).__name__}, expected a list of {len(completions)} floats")
        if len(out) != len(completions):
            raise _BatchError(f"returned {len(out)} scores for {len(completions)} completions")
        scores: list[float | str] = []
        for v in out:
            if not isinstance(v, numbers.Real):
                scores.append(f"returned a non-number {type(v).__name__}: {_excerpt(v)}")
            elif not math.isfinite(float(v)):
                scores.append(f"returned {float(v)}")
            else:
                scores.append(float(v))
        return scores

    def _error(self, index: int, reason: str, prompts: Sequence[str], completions: Sequence[str], *,
               note: str = "reward.on_error=skip scores such samples 0 and counts them") -> RewardError:
        return RewardError(
            f"reward.fn={self.name} failed on sample {index}: {reason}\n"
            f"  prompt: {_excerpt(prompts[index])}\n  completion: {_excerpt(completions[index])}\n"
            f"  ({note})"
        )

    def _timeout_error(self, index: int, err: _Timeout, prompts: Sequence[str], completions: Sequence[str]) -> RewardError:
        """Whatever ``on_error`` says (see the module docstring)."""
        alone = f" (on a call with {len(completions)} completions; the first is shown)" if len(completions) > 1 else ""
        return self._error(index, f"{err}{alone}", prompts, completions,
                           note="a call that hangs cannot be stopped, so this stops the run even with "
                                "reward.on_error=skip")

    def _main_scores(self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]) -> tuple[list[float], int]:
        try:
            raw = self._call(prompts, completions, columns)
        except _BatchError as batch_err:
            if isinstance(batch_err, _Timeout):  # no re-scoring one by one: that would wait timeout_s again
                raise self._timeout_error(0, batch_err, prompts, completions) from None
            # Score each sample alone to find the bad ones (the one a timed-out call hangs on).
            raw = []
            for i in range(len(completions)):
                try:
                    raw.extend(self._call([prompts[i]], [completions[i]], {k: [v[i]] for k, v in columns.items()}))
                except _Timeout as err:
                    raise self._timeout_error(i, err, prompts, completions) from None
                except _BatchError as err:
                    if self.on_error == "raise":
                        raise self._error(i, str(err), prompts, completions) from err.__cause__
                    raw.append(str(err))
            if self.on_error == "raise" and all(not isinstance(r, str) for r in raw):
                raise RewardError(
                    f"reward.fn={self.name} failed on the batch of {len(completions)} completions: {batch_err} "
                    f"(but each sample alone scored fine)"
                ) from batch_err.__cause__
        scores: list[float] = []
        errors = 0
        for i, r in enumerate(raw):
            if isinstance(r, str):
                if self.on_error == "raise":
                    raise self._error(i, r, prompts, completions)
                errors += 1
                r = 0.0
            scores.append(r)
        return scores, errors

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], columns: dict[str, list[Any]]) -> ScoreResult:
        prompts, completions = list(prompts), list(completions)
        if len(prompts) != len(completions):
            raise ValueError(f"scorer got {len(prompts)} prompts but {len(completions)} completions")
        for key, values in columns.items():
            if key in ("prompts", "completions"):
                raise ValueError(f"column {key!r} clashes with the scorer's positional argument; rename it in the data file")
            if len(values) != len(completions):
                raise ValueError(f"scorer column {key!r} has {len(values)} values for {len(completions)} completions")
        missing = sorted(self._required - set(columns))
        if missing:
            raise ValueError(
                f"reward.fn={self.name} needs the columns {sorted(self._required)} but the data has "
                f"{sorted(columns)}; missing {missing}"
            )
        if not completions:
            return ScoreResult([], 0, [] if self.format_weight else None, [])
        main, errors = self._main_scores(prompts, completions, columns)
        total, fmt = main, None
        if self.format_weight:
            fmt = format_reward(prompts, completions)
            total = [m + self.format_weight * f for m, f in zip(main, fmt)]
        return ScoreResult(scores=total, num_errors=errors, format_scores=fmt, main_scores=main)


def build_scorer(*, fn: str, task: str, format_weight: float, on_error: str, timeout_s: float = 0.0) -> Scorer:
    """The scorer for ``reward.fn`` (``auto`` resolves by ``data.task``); ``timeout_s`` (``reward.timeout_s``)
    bounds each call of a user function, not of a built-in one (see the module docstring)."""
    name = fn.strip()
    if name == "auto":
        if task not in AUTO:
            raise ValueError(f"reward.fn=auto: no default scorer for data.task={task}; known tasks: {sorted(AUTO)}")
        name = AUTO[task]
    if name in BUILTIN:
        return Scorer(BUILTIN[name], name=name, format_weight=format_weight, on_error=on_error)
    return Scorer(load_user_fn(name), name=name, format_weight=format_weight, on_error=on_error, timeout_s=timeout_s)


__all__ = ["AUTO", "BUILTIN", "RewardError", "ScoreResult", "Scorer", "build_scorer", "load_user_fn"]
