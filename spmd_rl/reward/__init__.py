"""Rule-based rewards: math answer checking, countdown equations, answer format, the
``reward.fn`` registry that also loads user scorers (``module:function``), and reward shaping
(DAPO's ``overlong_penalty``).

    from spmd_rl.reward import build_scorer
    scorer = build_scorer(fn="auto", task="gsm8k", format_weight=0.0, on_error="raise")
    result = scorer(prompts, completions, {"answer": answers})   # result.scores, result.num_errors
"""

from spmd_rl.reward.countdown import countdown_score, evaluate_equation, extract_equation, solve_countdown
from spmd_rl.reward.format import format_score
from spmd_rl.reward.math import extract_answer, math_score, numbers_equal
from spmd_rl.reward.registry import RewardError, Scorer, ScoreResult, build_scorer, load_user_fn
from spmd_rl.reward.shaping import overlong_penalty

__all__ = [
    "RewardError", "ScoreResult", "Scorer", "build_scorer", "countdown_score", "evaluate_equation",
    "extract_answer", "extract_equation", "format_score", "load_user_fn", "math_score", "numbers_equal",
    "overlong_penalty", "solve_countdown",
]
