"""Built-in generated prompt tasks and the ``Sample`` record every prompt source produces.

Two synthetic tasks need no files and are deterministic from ``data.seed``:

* ``arithmetic`` -- "What is 12 + 7? <instruction>", answer ``"19"``.
* ``countdown`` -- reach a target with given numbers and ``+ - * /``; the target is built from a
  random expression over *all* the numbers, so a solution using each number exactly once always
  exists (the countdown scorer requires exactly that, see :mod:`spmd_rl.reward.countdown`).

Train and validation never overlap: validation is drawn from its own seed stream first and every
question it holds is excluded from training. Used by :func:`spmd_rl.data.files.build_prompts`::

    train, val = generate_task("arithmetic", seed=1234, val_size=64, ...)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

GENERATED_TRAIN_SIZE = 10_000
"""Largest training set a built-in task generates (fewer when the task has fewer distinct questions)."""

_MAX_MISSES = 2_000
"""Consecutive draws that yield no new distinct question before a generator gives up."""

COUNTDOWN_INSTRUCTION = (
    "Use each number exactly once, with + - * / and parentheses, and put only the equation inside "
    "<answer> </answer>."
)


@dataclass
class Sample:
    """One prompt with its reference answer.

    ``prompt`` is the user message text (instruction already appended); ``messages``, when set,
    is a full chat (list of ``{"role", "content"}``) used instead of ``prompt`` by the chat
    template. ``columns`` holds extra per-sample fields a scorer may use (countdown: ``target``,
    ``numbers``); scorers receive them, together with ``answer``, as keyword lists.
    """

    prompt: str
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None

    @property
    def row(self) -> dict[str, Any]:
        """The sample as a data row (what an environment's ``reset`` gets): ``prompt``, ``answer``,
        ``messages`` when set, and every column."""
        row: dict[str, Any] = {"prompt": self.prompt, "answer": self.answer}
        if self.messages is not None:
            row["messages"] = [dict(m) for m in self.messages]
        return {**row, **self.columns}


def columns_of(samples: Iterable[Sample]) -> dict[str, list[Any]]:
    """Column-wise view of samples for scorers: ``{"answer": [...], "target": [...], ...}``.

    Always holds ``answer``; a column missing in some samples is ``None`` there.
    """
    samples = list(samples)
    names: list[str] = ["answer"]
    for s in samples:
        for k in s.columns:
            if k not in names:
                names.append(k)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for s in samples:
        out["answer"].append(s.answer)
        for name in names[1:]:
            out[name].append(s.columns.get(name))
    return out


def _distinct(
    draw: Callable[[random.Random], tuple[Hashable, Sample]],
    rng: random.Random,
    count: int,
    exclude: set[Hashable],
) -> tuple[list[Sample], set[Hashable]]:
    """Draw up to ``count`` samples with distinct keys not in ``exclude``.

    Stops early after ``_MAX_MISSES`` consecutive repeats (the question space is exhausted).
    """
    seen: set[Hashable] = set()
    out: list[Sample] = []
    misses = 0
    while len(out) < count and misses < _MAX_MISSES:
        key, sample = draw(rng)
        if key in seen or key in exclude:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        out.append(sample)
    return out, seen


def _split(
    task: str,
    draw: Callable[[random.Random], tuple[Hashable, Sample]],
    *,
    seed: int,
    val_size: int,
    space_hint: str,
) -> tuple[list[Sample], list[Sample]]:
    """Validation from seed stream ``(seed, "val")``, then training from ``(seed, "train")``
    excluding every validation question."""
    if val_size < 0:
        raise ValueError(f"data.val_size must be >= 0, got {val_size}")
    val, val_keys = _distinct(draw, random.Random(f"{seed}/{task}/val"), val_size, set())
    if len(val) < val_size:
        raise ValueError(
            f"data.val_size ({val_size}) is more than the {len(val)} distinct {task} questions "
            f"found with {space_hint}; lower data.val_size or widen the task"
        )
    train, _ = _distinct(draw, random.Random(f"{seed}/{task}/train"), GENERATED_TRAIN_SIZE, val_keys)
    if not train:
        raise ValueError(
            f"data.val_size ({val_size}) uses up every distinct {task} question with {space_hint}; "
            f"no training questions are left"
        )
    return train, val


def arithmetic_question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"data.ops: unknown operator {op!r}; use any of '+-*'")


def generate_arithmetic(
    *, seed: int, val_size: int, operand_min: int, operand_max: int, ops: str, instruction: str
) -> tuple[list[Sample], list[Sample]]:
    """(train, val) of ``a op b`` questions with operands in ``[operand_min, operand_max]``."""
    if operand_min > operand_max:
        raise ValueError(f"data.operand_min ({operand_min}) must be <= data.operand_max ({operand_max})")
    op_list = sorted(set(ops))
    for op in op_list:
        _apply(0, op, 0)
    suffix = f" {instruction}" if instruction else ""

    def draw(rng: random.Random) -> tuple[Hashable, Sample]:
        a = rng.randint(operand_min, operand_max)
        b = rng.randint(operand_min, operand_max)
        op = rng.choice(op_list)
        question = arithmetic_question(a, op, b)
        return question, Sample(prompt=question + suffix, answer=str(_apply(a, op, b)))

    hint = f"data.operand_min={operand_min}, data.operand_max={operand_max}, data.ops={ops!r}"
    return _split("arithmetic", draw, seed=seed, val_size=val_size, space_hint=hint)


def random_expression(numbers: list[int], rng: random.Random, ops: str = "+-*") -> tuple[str, int]:
    """A random expression using every number once, as ``(text, value)``.

    Builds a random binary tree over the numbers (in the given order); inner nodes are
    parenthesised unless they are the root.
    """

    def build(lo: int, hi: int) -> tuple[str, int]:
        if hi - lo == 1:
            return str(numbers[lo]), numbers[lo]
        cut = rng.randint(lo + 1, hi - 1)
        (lt, lv), (rt, rv) = build(lo, cut), build(cut, hi)
        op = rng.choice(ops)
        lt = lt if cut - lo == 1 else f"({lt})"
        rt = rt if hi - cut == 1 else f"({rt})"
        return f"{lt} {op} {rt}", _apply(lv, op, rv)

    if not numbers:
        raise ValueError("random_expression needs at least one number")
    return build(0, len(numbers))


def countdown_prompt(numbers: list[int], target: int) -> str:
    shown = ", ".join(str(n) for n in numbers)
    return f"Using the numbers {shown}, write an equation that equals {target}. {COUNTDOWN_INSTRUCTION}"


def generate_countdown(
    *, seed: int, val_size: int, countdown_numbers: int, countdown_max: int
) -> tuple[list[Sample], list[Sample]]:
    """(train, val) countdown problems: ``countdown_numbers`` numbers in ``[1, countdown_max]``
    and a positive target reached by a random ``+ - *`` expression over all of them.

    Columns: ``target`` (int), ``numbers`` (list[int]), ``solution`` (one valid equation).
    ``answer`` is the target as a string.
    """
    if countdown_numbers < 2:
        raise ValueError(f"data.countdown_numbers must be >= 2, got {countdown_numbers}")
    if countdown_max < 1:
        raise ValueError(f"data.countdown_max must be >= 1, got {countdown_max}")

    def draw(rng: random.Random) -> tuple[Hashable, Sample]:
        while True:
            numbers = [rng.randint(1, countdown_max) for _ in range(countdown_numbers)]
            text, value = random_expression(numbers, rng)
            if value >= 1:
                break
        shown = list(numbers)
        rng.shuffle(shown)
        sample = Sample(
            prompt=countdown_prompt(shown, value),
            answer=str(value),
            columns={"target": value, "numbers": shown, "solution": text},
        )
        return (tuple(sorted(numbers)), value), sample

    hint = f"data.countdown_numbers={countdown_numbers}, data.countdown_max={countdown_max}"
    return _split("countdown", draw, seed=seed, val_size=val_size, space_hint=hint)


def generate_episode_rows(task: str, *, seed: int, val_size: int) -> tuple[list[Sample], list[Sample]]:
    """(train, val) rows of a built-in environment's task (``guess_number``, ``python_math``): each
    row's fields are its sample's columns, which the environment's ``reset`` reads; the prompt is the
    environment's first message (what a single-turn run of the same task shows). Held-out rows come
    from their own seed: with 16 targets, ``guess_number``'s splits cannot be disjoint."""
    from spmd_rl.episodes.builtin import GuessNumberEnv, PythonMathEnv, guess_number_rows, python_math_rows

    make, env = {"guess_number": (guess_number_rows, GuessNumberEnv),
                 "python_math": (python_math_rows, PythonMathEnv)}[task]

    def samples(rows: list[dict]) -> list[Sample]:
        return [Sample(prompt=env().reset(row)[-1]["content"], answer=str(row.get("answer", row.get("target"))),
                       columns=dict(row)) for row in rows]

    return samples(make(GENERATED_TRAIN_SIZE, seed)), samples(make(val_size, seed + 1))


__all__ = [
    "COUNTDOWN_INSTRUCTION", "GENERATED_TRAIN_SIZE", "Sample", "arithmetic_question", "columns_of",
    "countdown_prompt", "generate_arithmetic", "generate_countdown", "generate_episode_rows", "random_expression",
]
