"""Tests for spmd_rl.reward: answer extraction and comparison, countdown equations, the format
reward, and the scorer registry (built-ins, user ``module:function`` scorers, error policy).

Run with ``python3 -m pytest tests/test_reward.py -q``. User scorers are real modules written to
``tmp_path`` and imported through ``sys.path``.
"""

from __future__ import annotations

import re
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from spmd_rl.reward import (
    RewardError, build_scorer, countdown_score, evaluate_equation, extract_answer, extract_equation,
    format_score, math_score, numbers_equal, solve_countdown,
)

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,234.", "1,234"),
        ("so \\boxed{\\frac{3}{4}} it is", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{{2}+1}", "{2}+1"),
        ("x = -5", "-5"),
        ("12.0", "12.0"),
        ("3 apples and 4 pears make 7", "7"),
        ("3-5 is -2", "-2"),
        ("12-7", "7"),
        ("no number here", None),
        ("", None),
        ("<answer>42</answer>", "42"),
        ("<answer>The total is 42 dollars</answer> and 99", "42"),
        ("<answer>x = 7</answer>", "7"),
        ("<answer>\\sqrt{2}</answer>", "\\sqrt{2}"),
        ("steps 1 2 3\n#### 1,000\nmore 5", "1,000"),
        ("The answer is $\\frac{1}{2}$ of it", "\\frac{1}{2}"),
        ("Answer: 50% of 80", "50"),
        ("the answer is 8, since 2 and 6", "8"),
        ("version 3.5 then 0.25", "0.25"),
        ("about \u22123 degrees", "-3"),
        ("The answer is below. 1+1=2", "2"),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("use_mv", [False, True] if HAVE_MATH_VERIFY else [False])
@pytest.mark.parametrize(
    "pred, ref, equal",
    [
        ("1,234", "1234", True), ("12.0", "12", True), ("12.", "12", True), ("$5", "5", True),
        ("50%", "50", True), ("\\frac{3}{4}", "0.75", True), ("3/4", "0.75", True), ("\\dfrac{6}{8}", "3/4", True),
        ("-3", "-3", True), ("-3", "3", False), ("0.3333", "1/3", False), ("0.3333333", "1/3", True), ("1234.1", "1234", False),
        ("18", "18.0000000001", True), ("7", "8", False), ("+4", "4", True), ("abc", "abd", False),
        # beyond float range (a model's runaway digits): compared exactly, no OverflowError
        ("9" * 400, "18", False), ("9" * 400, "9" * 400, True), ("1/" + "9" * 400, "1", False),
    ],
)
def test_numbers_equal(pred: str, ref: str, equal: bool, use_mv: bool) -> None:
    assert numbers_equal(pred, ref, use_math_verify=use_mv) is equal


@pytest.mark.skipif(not HAVE_MATH_VERIFY, reason="math-verify not installed: symbolic answers fall back to string compare")
def test_math_verify_for_symbolic_answers() -> None:
    assert numbers_equal("\\sqrt{8}", "2\\sqrt{2}")
    assert not numbers_equal("\\sqrt{8}", "2\\sqrt{3}")
    assert not numbers_equal("\\sqrt{8}", "2\\sqrt{2}", use_math_verify=False)
    assert numbers_equal("\\sqrt{8}", "\\sqrt{8}", use_math_verify=False)


def test_math_score() -> None:
    assert math_score("The answer is 1,234.", "1234") == 1.0
    assert math_score("\\boxed{\\frac{3}{4}}", "0.75") == 1.0
    assert math_score("-7", -7) == 1.0
    assert math_score("I think 5 but maybe 6", "5") == 0.0
    assert math_score("no idea", "5") == 0.0
    assert math_score("12.0", "12") == 1.0
    assert math_score("\\boxed{18 \\text{ dollars}}", "18") == 1.0
    assert math_score("\\boxed{90^\\circ}", "90") == 1.0
    # a numeric reference needs a numeric answer, not an expression that evaluates to it
    assert math_score("<answer>12 + 7</answer>", "19") == 0.0
    assert math_score("\\boxed{12+7}", "19") == 0.0
    assert math_score("<answer>19</answer>", "19") == 1.0


# --------------------------------------------------------------------------- countdown


def test_countdown_scores() -> None:
    nums = [3, 7, 12]
    assert countdown_score("<answer>(3 + 7) * 12</answer>", target=120, numbers=nums) == 1.0
    assert countdown_score("<answer>12 * (7 + 3) = 120</answer>", target=120, numbers=nums) == 1.0
    assert countdown_score("Let me think.\nSo (3 + 7) * 12 = 120.", target=120, numbers=nums) == 1.0
    assert countdown_score("<answer>3 + 7 + 12</answer>", target=120, numbers=nums) == 0.0  # wrong value
    assert countdown_score("<answer>(7 + 3) * 12 * 1</answer>", target=120, numbers=nums) == 0.0  # extra number
    assert countdown_score("<answer>(3 + 3) * 20</answer>", target=120, numbers=[3, 20, 5]) == 0.0  # reused 3
    assert countdown_score("<answer>(3 + 3) * 20</answer>", target=120, numbers=[3, 3, 20]) == 1.0  # given twice
    assert countdown_score("<answer>3 * 7</answer>", target=21, numbers=nums) == 0.0  # 12 unused
    assert countdown_score("<answer>7 / 3 * 12</answer>", target=28, numbers=nums) == 1.0  # exact fractions
    assert countdown_score("<answer>12 / (3 - 3)</answer>", target=1, numbers=[12, 3, 3]) == 0.0
    assert countdown_score("<answer>2 ** 3</answer>", target=8, numbers=[2, 3]) == 0.0
    assert countdown_score("<answer>12 // 3</answer>", target=4, numbers=[12, 3]) == 0.0
    assert countdown_score("no equation", target=1, numbers=[1]) == 0.0


def test_countdown_never_evaluates_text(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    attack = f"<answer>__import__('os').system('touch {marker}')</answer>"
    assert countdown_score(attack, target=0, numbers=[]) == 0.0
    assert countdown_score(f"__import__('os').system('touch {marker}') + 1", target=1, numbers=[1]) == 0.0
    assert countdown_score("<answer>(lambda: 1)() + 2</answer>", target=3, numbers=[1, 2]) == 0.0
    assert not marker.exists()
    assert evaluate_equation("__import__('os')") is None
    assert evaluate_equation("(" * 150 + "1" + ")" * 150) is None  # too long
    assert evaluate_equation("1.5 + 2") is None
    value, used = evaluate_equation("-(3 - 10) * 2")  # type: ignore[misc]
    assert value == 14 and used == [3, 10, 2]
    assert extract_equation("<answer> 1 + 2 </answer>") == "1 + 2"


def test_solve_countdown() -> None:
    assert solve_countdown([3, 7, 12], 120) is not None
    found = solve_countdown([4, 6, 9], 30)
    assert found is not None and countdown_score(f"<answer>{found}</answer>", target=30, numbers=[4, 6, 9]) == 1.0
    assert solve_countdown([1, 1], 5) is None


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "text, score",
    [("42", 1.0), (" -3.5 ", 1.0), ("1,234.", 1.0), ("3/4", 1.0), ("The result is \\boxed{7}.", 1.0),
     ("\\boxed{\\frac{\\sqrt{2}}{2}}", 1.0), ("<answer>1 + 2</answer>", 1.0), ("<answer> </answer>", 0.0),
     ("The answer is 42", 0.0), ("\\boxed{}", 0.0), ("42 apples", 0.0)],
)
def test_format_score(text: str, score: float) -> None:
    assert format_score(text) == score


# --------------------------------------------------------------------------- registry


@pytest.fixture
def user_module(tmp_path: Path) -> Iterator[str]:
    """A real module on sys.path with scorers that work, raise, or return bad values."""
    name = f"user_scorers_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import math
        NOT_A_FUNCTION = 3

        def length_bonus(prompts, completions, *, answer, **columns):
            return [float(c == a) + 0.5 * ("level" in columns) for c, a in zip(completions, answer)]

        def only_answer(prompts, completions, answer):
            return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

        def raises_on_bad(prompts, completions, **columns):
            return [1.0 / (0 if c == "bad" else 1) for c in completions]

        def nan_on_bad(prompts, completions, **columns):
            return [math.nan if c == "bad" else 1.0 for c in completions]

        def text_on_bad(prompts, completions, **columns):
            return ["oops" if c == "bad" else 1.0 for c in completions]

        def short(prompts, completions, **columns):
            return [1.0]

        def batch_only_fails(prompts, completions, **columns):
            if len(completions) > 1:
                raise RuntimeError("cannot do batches")
            return [2.0]

        def needs_target(prompts, completions, target):
            return [1.0] * len(completions)
    """))
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def test_builtin_and_auto_scorers() -> None:
    s = build_scorer(fn="auto", task="gsm8k", format_weight=0.0, on_error="raise")
    r = s(["q1", "q2", "q3"], ["#### 18", "\\boxed{7}", "18"], {"answer": ["18", "8", "18"]})
    assert r.scores == [1.0, 0.0, 1.0] and r.num_errors == 0 and r.format_scores is None
    s = build_scorer(fn="auto", task="countdown", format_weight=0.5, on_error="raise")
    cols = {"answer": ["120", "120"], "target": [120, 120], "numbers": [[3, 7, 12], [3, 7, 12]]}
    r = s(["p", "p"], ["<answer>(3 + 7) * 12</answer>", "(3 + 7) * 12"], cols)
    assert r.scores == [1.5, 1.0] and r.format_scores == [1.0, 0.0] and r.main_scores == [1.0, 1.0]
    r = build_scorer(fn="format", task="arithmetic", format_weight=0.0, on_error="raise")(["p"], ["5"], {"answer": ["4"]})
    assert r.scores == [1.0]
    with pytest.raises(ValueError, match=r"reward\.fn=countdown needs the columns \['numbers', 'target'\].*missing"):
        build_scorer(fn="countdown", task="gsm8k", format_weight=0.0, on_error="raise")(["p"], ["1"], {"answer": ["1"]})
    assert build_scorer(fn="math", task="arithmetic", format_weight=0.0, on_error="skip")([], [], {"answer": []}).scores == []


def test_user_scorer_gets_columns(user_module: str) -> None:
    s = build_scorer(fn=f"{user_module}:length_bonus", task="file", format_weight=0.0, on_error="raise")
    r = s(["p1", "p2"], ["a", "b"], {"answer": ["a", "c"], "level": [1, 2]})
    assert r.scores == [1.5, 0.5]
    # a function without **kwargs gets only the columns it names
    s = build_scorer(fn=f"{user_module}:only_answer", task="file", format_weight=0.0, on_error="raise")
    assert s(["p"], ["a"], {"answer": ["a"], "level": [1]}).scores == [1.0]
    s = build_scorer(fn=f"{user_module}:needs_target", task="file", format_weight=0.0, on_error="raise")
    with pytest.raises(ValueError, match=r"needs_target needs the columns \['target'\].*missing \['target'\]"):
        s(["p"], ["a"], {"answer": ["a"]})


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nocolon", r"reward\.fn=nocolon: expected `auto`, a built-in scorer .* or `module:function`"),
        ("mod:", r"expected `auto`"),
        ("no_such_module_xyz:fn", r"reward\.fn=no_such_module_xyz:fn: no module named 'no_such_module_xyz' on sys\.path"),
        ("{mod}:missing", r"reward\.fn=\S+:missing: .*\.py has no attribute 'missing'; callables there: \[.*'length_bonus'"),
        ("{mod}:NOT_A_FUNCTION", r"NOT_A_FUNCTION is a int, not a function"),
    ],
)
def test_user_scorer_load_errors(user_module: str, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_scorer(fn=spec.format(mod=user_module), task="file", format_weight=0.0, on_error="raise")


def test_user_module_that_fails_to_import(tmp_path: Path) -> None:
    (tmp_path / "broken_scorer_mod.py").write_text("import not_installed_pkg_abc\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"importing module 'broken_scorer_mod' failed: ModuleNotFoundError.*not_installed_pkg_abc"):
            build_scorer(fn="broken_scorer_mod:f", task="file", format_weight=0.0, on_error="raise")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    "fn, reason",
    [
        ("raises_on_bad", r"raised ZeroDivisionError: .*division by zero"),
        ("nan_on_bad", r"returned nan"),
        ("text_on_bad", r"returned a non-number str: 'oops'"),
    ],
)
def test_raise_mode_names_scorer_sample_and_excerpt(user_module: str, fn: str, reason: str) -> None:
    s = build_scorer(fn=f"{user_module}:{fn}", task="file", format_weight=0.0, on_error="raise")
    prompts = ["What is 1?", "What is 2?", "What is the third " + "long " * 40]
    with pytest.raises(RewardError) as info:
        s(prompts, ["ok", "ok", "bad"], {"answer": ["1", "2", "3"]})
    msg = str(info.value)
    assert f"reward.fn={user_module}:{fn} failed on sample 2: " in msg
    assert re.search(reason, msg)
    assert "prompt: 'What is the third long" in msg and "...'" in msg and "completion: 'bad'" in msg
    assert isinstance(info.value, RuntimeError)


def test_raise_mode_batch_level_errors(user_module: str) -> None:
    s = build_scorer(fn=f"{user_module}:short", task="file", format_weight=0.0, on_error="raise")
    with pytest.raises(RewardError, match=r"failed on the batch of 3 completions: returned 1 scores for 3 completions"):
        s(["a", "b", "c"], ["x", "y", "z"], {"answer": ["1", "2", "3"]})
    s = build_scorer(fn=f"{user_module}:batch_only_fails", task="file", format_weight=0.0, on_error="raise")
    with pytest.raises(RewardError, match=r"RuntimeError: cannot do batches \(but each sample alone scored fine\)"):
        s(["a", "b"], ["x", "y"], {"answer": ["1", "2"]})


@pytest.mark.parametrize("fn", ["raises_on_bad", "nan_on_bad", "text_on_bad"])
def test_skip_mode_scores_zero_and_counts(user_module: str, fn: str) -> None:
    s = build_scorer(fn=f"{user_module}:{fn}", task="file", format_weight=0.25, on_error="skip")
    r = s(["p"] * 5, ["bad", "ok", "bad", "42", "bad"], {"answer": ["1"] * 5})
    assert r.num_errors == 3
    assert r.format_scores == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert r.scores == [0.0, 1.0, 0.0, 1.25, 0.0] and r.main_scores == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_skip_mode_batch_level_errors(user_module: str) -> None:
    s = build_scorer(fn=f"{user_module}:batch_only_fails", task="file", format_weight=0.0, on_error="skip")
    r = s(["a", "b"], ["x", "y"], {"answer": ["1", "2"]})
    assert r.scores == [2.0, 2.0] and r.num_errors == 0
    s = build_scorer(fn=f"{user_module}:short", task="file", format_weight=0.0, on_error="skip")
    r = s(["a", "b", "c"], ["x", "y", "z"], {"answer": ["1", "2", "3"]})
    assert r.scores == [1.0, 1.0, 1.0] and r.num_errors == 0  # alone, each call returns one score


def test_scorer_input_checks() -> None:
    s = build_scorer(fn="math", task="gsm8k", format_weight=0.0, on_error="raise")
    with pytest.raises(ValueError, match="scorer column 'answer' has 1 values for 2 completions"):
        s(["a", "b"], ["1", "2"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="got 1 prompts but 2 completions"):
        s(["a"], ["1", "2"], {"answer": ["1", "2"]})
    with pytest.raises(ValueError, match="reward.on_error must be `raise` or `skip`"):
        build_scorer(fn="math", task="gsm8k", format_weight=0.0, on_error="ignore")


# --------------------------------------------------------------------------- reward.timeout_s


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_scorer_that_never_returns_stops_with_the_sample(on_error: str) -> None:
    """A hung user scorer is a RewardError naming the function, the call's first sample and its prompt,
    after one timeout (the batch's samples are not scored again one by one, which waited a second
    timeout before), even with `skip`."""
    from support import rewards

    s = build_scorer(fn="support.rewards:hangs_on_seven", task="file", format_weight=0.0, on_error=on_error,
                     timeout_s=2.0)  # room for a busy machine to run the scorer that returns
    assert s(["1+1", "2+2"], ["2", "4"], {"answer": ["2", "4"]}).scores == [1.0, 1.0]  # no hang: scored
    calls = rewards.HANG_CALLS[0]
    with pytest.raises(RewardError) as info:  # the timeout's own error (a hang would never raise)
        s(["1+1", "3+7", "2+2"], ["2", "10", "4"], {"answer": ["2", "10", "4"]})
    assert rewards.HANG_CALLS[0] == calls + 1, "the hung batch was called again (one more timeout_s waited)"
    msg = str(info.value)
    assert "reward.fn=support.rewards:hangs_on_seven failed on sample 0: did not return within reward.timeout_s=2 s" in msg
    assert "on a call with 3 completions" in msg
    assert "prompt: '1+1'" in msg and "raise --reward.timeout-s" in msg
    assert "stops the run even with reward.on_error=skip" in msg
    with pytest.raises(RewardError, match=r"failed on sample 0: did not return within reward\.timeout_s=2 s"):
        s(["7"], ["7"], {"answer": ["7"]})  # a batch of one is not scored twice
    assert rewards.HANG_CALLS[0] == calls + 2


def test_timeout_zero_and_builtin_scorers_run_in_the_calling_thread(user_module: str) -> None:
    """`reward.timeout_s=0` calls the function directly; the built-ins are never put in a thread
    (math-verify's own timeouts need the main thread); a user function's errors keep their policy."""
    import threading

    seen: list[str] = []
    s = build_scorer(fn="math", task="gsm8k", format_weight=0.0, on_error="raise", timeout_s=5)
    s.fn = lambda p, c, **k: seen.append(threading.current_thread().name) or [1.0] * len(c)
    s(["p"], ["1"], {"answer": ["1"]})
    user = build_scorer(fn=f"{user_module}:raises_on_bad", task="file", format_weight=0.0, on_error="skip", timeout_s=5)
    assert user.timeout_s == 5 and s.timeout_s == 0
    assert user(["p", "q"], ["bad", "ok"], {"answer": ["1", "1"]}).num_errors == 1
    s0 = build_scorer(fn=f"{user_module}:raises_on_bad", task="file", format_weight=0.0, on_error="raise", timeout_s=0)
    s0.fn = lambda p, c, **k: seen.append(threading.current_thread().name) or [1.0] * len(c)
    s0(["p"], ["1"], {"answer": ["1"]})
    assert seen == [threading.current_thread().name] * 2


def test_run_reward_takes_the_timeout_from_the_config() -> None:
    from spmd_rl.config import RewardConfig
    from spmd_rl.data.tasks import Sample
    from spmd_rl.reward.run import build_run_reward

    assert RewardConfig().timeout_s == 60
    reward = build_run_reward(reward=RewardConfig(fn="support.rewards:hangs_on_seven", timeout_s=0.2), task="file",
                              system_prompt=None, actor_tokenizer=None, group=None, mesh=None, exchange=None,
                              device=None, cache_dir=None)  # type: ignore[arg-type]
    with pytest.raises(RewardError, match=r"hangs_on_seven failed on sample 0: did not return within reward\.timeout_s=0\.2 s"):
        reward([Sample(prompt="7*7", answer="49")], ["49"], [[1]], [[2]])
