"""Built-in environments (``--env.name``) and the data rows they play from.

* ``guess_number`` (:class:`GuessNumberEnv`): a hidden whole number in ``[low, high]``; each model turn is
  one guess (the last integer in the reply), answered "Higher." or "Lower."; reward 1 when found within
  ``max_guesses`` turns, else 0. Rows: ``{"target": 7, "low": 1, "high": 16, "max_guesses": 5}``, made by
  :func:`guess_number_rows`. The defaults, 1..16 in 5 guesses, are exactly what halving the interval
  always solves (16 numbers need at most 5 guesses), while 5 distinct guesses that ignore the hints
  find it with probability 5/16: a signal a small model can improve on within a few turns.
* ``python_math`` (:class:`PythonMathEnv`): a question with a numeric answer (``question`` and
  ``answer``; a GSM8K ``answer`` with ``#### x`` is read as ``x``), the ``python`` tool available. A reply
  with tool calls gets the tools' answers (the environment runs them itself, in the thread that calls
  ``step``); the first reply without a tool call is the final answer, reward 1 when
  :func:`spmd_rl.reward.math.math_score` accepts it. The episode opens with a system message that shows
  the call format and the ``\\boxed{}`` answer (:data:`PYTHON_MATH_SYSTEM`), then two worked examples
  played out as finished episodes (:data:`PYTHON_MATH_EXAMPLES`: question, call, the tool's answer, the
  boxed answer), then the row's question: without the examples SmolLM2-135M-Instruct never calls the
  tool (docs/RESULTS.md). Rows: :func:`python_math_rows` (sums, products, ``a * b ± c`` and word
  problems in turn) or any file with those columns.

Both count what the runner reports: ``turns``, and for ``python_math`` ``tool_calls`` and ``tool_errors``
(attributes of the instance, read after the episode). Usage::

    env = GuessNumberEnv()
    messages = env.reset({"target": 7})            # [{"role": "user", "content": "I am thinking of ..."}]
    new, reward, done = env.step("My guess: 8")    # [{"role": "user", "content": "Lower. ..."}], 0.0, False
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from spmd_rl.episodes.tools import Tool, parse_tool_calls, python_tool, run_calls, tool_messages
from spmd_rl.reward.math import math_score

GUESS_LOW, GUESS_HIGH, GUESS_TURNS = 1, 16, 5
"""``guess_number``'s defaults: the interval and the number of guesses."""

_INT_RE = re.compile(r"(?<!\d)-?\d+")


def _int(row: dict, key: str, default: int) -> int:
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise ValueError(f"guess_number: the row's {key!r} must be a whole number, got {value!r}")
    return int(value)


class GuessNumberEnv:
    """``guess_number``: find a hidden number in ``[low, high]`` from "higher" / "lower" hints."""

    def reset(self, row: dict) -> list[dict]:
        self.low, self.high = _int(row, "low", GUESS_LOW), _int(row, "high", GUESS_HIGH)
        self.target = _int(row, "target", (self.low + self.high) // 2)
        self.max_guesses = _int(row, "max_guesses", GUESS_TURNS)
        if not self.low <= self.target <= self.high or self.max_guesses < 1:
            raise ValueError(f"guess_number: the row needs low <= target <= high and max_guesses >= 1, got {row}")
        self.turns = 0
        self.found = False
        return [{"role": "user", "content": (
            f"I am thinking of a whole number between {self.low} and {self.high}. Guess it in at most "
            f"{self.max_guesses} tries. Reply with one number; after each guess I say whether my number is "
            f"higher or lower.")}]

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        left = self.max_guesses - self.turns
        numbers = _INT_RE.findall(reply)
        if numbers and int(numbers[-1]) == self.target:
            self.found = True
            return [], 1.0, True
        if left <= 0:
            return [], 0.0, True
        if not numbers:
            hint = (f"I found no number in your reply. Reply with one whole number between {self.low} and "
                    f"{self.high}.")
        else:
            guess = int(numbers[-1])
            if not self.low <= guess <= self.high:
                hint = f"{guess} is not between {self.low} and {self.high}."
            else:
                hint = "Higher." if guess < self.target else "Lower."
        tries = "try" if left == 1 else "tries"
        return [{"role": "user", "content": f"{hint} {left} {tries} left."}], 0.0, False


def guess_number_rows(n: int, seed: int, *, low: int = GUESS_LOW, high: int = GUESS_HIGH,
                      max_guesses: int = GUESS_TURNS) -> list[dict]:
    """``n`` rows of ``guess_number``, targets uniform in ``[low, high]``, the same for the same ``seed``."""
    if n < 0 or low > high or max_guesses < 1:
        raise ValueError(f"guess_number_rows: need n >= 0, low <= high, max_guesses >= 1; got {n}, {low}, {high}, "
                         f"{max_guesses}")
    rng = random.Random(f"{seed}/guess_number")
    return [{"target": rng.randint(low, high), "low": low, "high": high, "max_guesses": max_guesses}
            for _ in range(n)]


def _final_answer(answer: Any) -> str:
    text = str(answer)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def _python_call(code: str) -> str:
    return '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>' % code


PYTHON_MATH_SYSTEM = (
    "You can run Python with the `python` tool. To call it, write only a tool call like this:\n"
    f"{_python_call('print(37 * 48)')}\n"
    "The tool answers with what the program prints. Then reply with the final answer in \\boxed{}, for example "
    "\\boxed{1776}.")
"""``python_math``'s system message: the call format and the final answer's."""

PYTHON_MATH_EXAMPLES: tuple[tuple[str, str, int], ...] = (
    ("What is 38 * 291 - 5170?", "print(38 * 291 - 5170)", 38 * 291 - 5170),
    ("A crate holds 57 bottles. How many bottles are in 4213 crates and 906 loose bottles?",
     "print(4213 * 57 + 906)", 4213 * 57 + 906),
)
"""``python_math``'s worked examples ``(question, code, printed)``: each is played out before the row's
question as one finished episode (the question, the call, the tool's answer, the boxed answer)."""


def python_math_examples() -> list[dict]:
    """The worked examples as chat messages, in the form the episode's own turns take."""
    messages: list[dict] = []
    for question, code, printed in PYTHON_MATH_EXAMPLES:
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": _python_call(code)},
                     {"role": "tool", "tool_call_id": "call00000", "name": "python", "content": str(printed)},
                     {"role": "assistant", "content": f"\\boxed{{{printed}}}"}]
    return messages


class PythonMathEnv:
    """``python_math``: answer a question, with the ``python`` tool at hand (see the module docstring)."""

    tools: ClassVar[tuple[str, ...]] = ("python",)
    """The tools this environment runs itself (their schemas go to the chat template)."""
    max_turns: ClassVar[int] = 6
    """Turns before the episode ends unanswered (reward 0) unless the row says ``max_turns``."""

    def __init__(self, tools: dict[str, Tool] | None = None) -> None:
        self._tools = tools if tools is not None else {"python": python_tool()}

    def reset(self, row: dict) -> list[dict]:
        question = row.get("question", row.get("prompt"))
        if not isinstance(question, str) or "answer" not in row:
            raise ValueError(f"python_math: the row needs a `question` (text) and an `answer`, got keys {sorted(row)}")
        self.answer = _final_answer(row["answer"])
        self.limit = int(row.get("max_turns", self.max_turns))
        self.turns = self.tool_calls = self.tool_errors = 0
        self.correct = False
        return ([{"role": "system", "content": PYTHON_MATH_SYSTEM}] + python_math_examples()
                + [{"role": "user", "content": question}])

    @property
    def used_tool(self) -> bool:
        return self.tool_calls > 0

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        calls = parse_tool_calls(reply)
        if not calls:
            self.correct = math_score(reply, self.answer) == 1.0
            return [], float(self.correct), True
        results = run_calls(self._tools, calls)
        self.tool_calls += len(results)
        self.tool_errors += sum(r.error for r in results)
        if self.turns >= self.limit:
            return [], 0.0, True
        return tool_messages(results), 0.0, False


PYTHON_MATH_KINDS = ("sum", "product", "product_plus", "word")
"""``python_math_rows``' kinds of question, in turn: ``a + b`` (two digits each, which SmolLM2-135M sometimes
adds right in its head), ``a * b`` (two digits each), ``a * b ± c`` (up to 4, 3 and 5 digits) and a word
problem whose answer is ``a * b ± c`` (up to 3 digits each, ``c`` below the product)."""

_WORD_PROBLEMS = (
    ("A box holds {b} pencils. A school buys {a} boxes and {c} loose pencils. How many pencils does it buy?", 1),
    ("A farm packs {b} eggs into each of {a} crates and sells {c} of the packed eggs. How many packed eggs are "
     "left?", -1),
    ("A printer prints {b} pages a minute for {a} minutes, then {c} more pages. How many pages does it print?", 1),
    ("A library has {a} shelves of {b} books each. {c} of the books are on loan. How many books are on the "
     "shelves?", -1),
)


def python_math_rows(n: int, seed: int) -> list[dict]:
    """``n`` rows of ``python_math``, the kinds of :data:`PYTHON_MATH_KINDS` in turn (``kind``): sums a
    small model sometimes gets right unaided, and products, longer expressions and word problems that
    need the tool; the same for the same ``seed``."""
    if n < 0:
        raise ValueError(f"python_math_rows: n must be >= 0, got {n}")
    rng = random.Random(f"{seed}/python_math")
    rows = []
    for i in range(n):
        kind = PYTHON_MATH_KINDS[i % len(PYTHON_MATH_KINDS)]
        if kind == "sum":
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            question, answer = f"What is {a} + {b}?", a + b
        elif kind == "product":
            a, b = rng.randint(12, 99), rng.randint(12, 99)
            question, answer = f"What is {a} * {b}?", a * b
        elif kind == "product_plus":
            a, b, c, sign = rng.randint(100, 9999), rng.randint(12, 999), rng.randint(1, 99999), rng.choice((1, -1))
            question, answer = f"What is {a} * {b} {'+' if sign > 0 else '-'} {c}?", a * b + sign * c
        else:
            template, sign = rng.choice(_WORD_PROBLEMS)
            a, b = rng.randint(12, 999), rng.randint(12, 999)
            c = rng.randint(1, min(999, a * b - 1))
            question, answer = template.format(a=a, b=b, c=c), a * b + sign * c
        rows.append({"question": question, "answer": str(answer), "kind": kind})
    return rows


__all__ = ["GUESS_HIGH", "GUESS_LOW", "GUESS_TURNS", "GuessNumberEnv", "PYTHON_MATH_EXAMPLES", "PYTHON_MATH_KINDS",
           "PYTHON_MATH_SYSTEM", "PythonMathEnv", "guess_number_rows", "python_math_examples", "python_math_rows"]
