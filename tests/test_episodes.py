"""Environments of episodes (``spmd_rl/episodes/``): ``load_env`` and its errors, the return-value checks,
the built-ins ``guess_number`` and ``python_math`` played by scripted players, and the TextArena adapter
on a real TextArena game, offline."""

from __future__ import annotations

import random
import re
import socket
import textwrap
from typing import get_args

import pytest

from spmd_rl.episodes.adapters import TextArenaEnv, textarena_rows
from spmd_rl.episodes.builtin import GuessNumberEnv, PythonMathEnv, guess_number_rows, python_math_rows
from spmd_rl.episodes.env import BUILTIN_ENVS, Env, EnvName, check_messages, check_step, load_env
from spmd_rl.episodes.tools import calculate


def play(env: Env, row: dict, replies) -> tuple[list[dict], float, int, bool]:
    """Run an episode: ``replies(messages)`` gives each reply; returns (chat, summed reward, turns, done)."""
    chat = check_messages(env.reset(row), env)
    total, turns, done = 0.0, 0, False
    while not done and turns < 50:
        reply = replies(chat)
        chat.append({"role": "assistant", "content": reply})
        new, reward, done = check_step(env.step(reply), env)
        chat += new
        total += reward
        turns += 1
    return chat, total, turns, done


# --------------------------------------------------------------------------- load_env

USER_ENVS = '''
class Fixed:
    """Three turns, reward 0.5 each."""
    def reset(self, row):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]
    def step(self, reply):
        self.n += 1
        return [{"role": "user", "content": "again"}], 0.5, self.n == 3

class NoStep:
    def reset(self, row):
        return []

class NeedsArgs:
    def __init__(self, level):
        self.level = level
    def reset(self, row):
        return []
    def step(self, reply):
        return [], 0.0, True

def not_a_class():
    return None
'''


@pytest.fixture
def user_envs(tmp_path, monkeypatch) -> str:
    (tmp_path / "user_envs_mod.py").write_text(textwrap.dedent(USER_ENVS))
    (tmp_path / "broken_envs_mod.py").write_text("import not_installed_pkg_qwe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_envs_mod"


def test_builtins_by_name_and_the_names_are_one_literal() -> None:
    assert set(get_args(EnvName)) == set(BUILTIN_ENVS)
    assert load_env(None, "guess_number") is GuessNumberEnv
    assert load_env(None, " python_math ") is PythonMathEnv
    assert load_env("", "textarena") is TextArenaEnv
    for cls in BUILTIN_ENVS.values():
        assert isinstance(cls(), Env)


def test_a_user_class_loads_and_its_rewards_sum(user_envs: str) -> None:
    make = load_env(f"{user_envs}:Fixed", None)
    _, total, turns, done = play(make(), {"prompt": "go"}, lambda chat: "ok")
    assert (total, turns, done) == (1.5, 3, True)


@pytest.mark.parametrize("fn, name, says", [
    ("m:C", "guess_number", r"env\.fn=m:C and env\.name=guess_number are both set; set one of them"),
    (None, None, r"no environment: set --env\.fn module:Class or --env\.name \(guess_number, python_math, textarena\)"),
    (None, "guess_numbers", r"env\.name=guess_numbers: no such built-in environment; the built-ins are guess_number"),
    ("user_envs_mod", None, r"env\.fn=user_envs_mod: expected `module:Class`"),
    ("no_such_env_module_q:Env", None, r"env\.fn=no_such_env_module_q:Env: no module named 'no_such_env_module_q' on sys\.path"),
    ("broken_envs_mod:Env", None, r"env\.fn=broken_envs_mod:Env: importing module 'broken_envs_mod' failed: "
                                  r"ModuleNotFoundError: .*not_installed_pkg_qwe"),
    ("user_envs_mod:Missing", None, r"env\.fn=user_envs_mod:Missing: .*user_envs_mod\.py has no attribute 'Missing'; "
                                    r"callables there: \[.*'Fixed'"),
    ("user_envs_mod:not_a_class", None, r"env\.fn=user_envs_mod:not_a_class: is a function, not a class with reset"),
    ("user_envs_mod:NoStep", None, r"env\.fn=user_envs_mod:NoStep: class NoStep has no method step"),
    ("user_envs_mod:NeedsArgs", None, r"env\.fn=user_envs_mod:NeedsArgs: class NeedsArgs needs the argument\(s\) "
                                      r"\['level'\], but each episode's environment is built with none"),
])
def test_load_env_errors_name_the_flag_and_what_is_wrong(user_envs: str, fn, name, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        load_env(fn, name)


@pytest.mark.parametrize("result, says", [
    ([], r"Fixed\.step returned \[\], expected a tuple \(messages, reward, done\)"),
    (("hi", 1.0, True), r"Fixed\.step returned a str as messages"),
    (([{"role": "user"}], 1.0, True), r"Fixed\.step: message 0 is .*needs a `role` and a `content` string"),
    (([], float("nan"), True), r"Fixed\.step returned the reward nan, expected a finite number"),
    (([], "1", True), r"returned the reward '1'"),
    (([], 1.0, None), r"returned done=None, expected a bool"),
])
def test_wrong_return_values_name_the_environment(user_envs: str, result, says: str) -> None:
    make = load_env(f"{user_envs}:Fixed", None)
    with pytest.raises(TypeError, match=says):
        check_step(result, make)
    assert check_step(([], 1, 0), make) == ([], 1.0, False)


# --------------------------------------------------------------------------- guess_number

def bisect_player(low: int, high: int):
    bounds = [low, high]

    def reply(chat: list[dict]) -> str:
        last = chat[-1]["content"]
        if chat[-1]["role"] == "user" and len(chat) > 1:
            guess = int(re.findall(r"\d+", chat[-2]["content"])[-1])
            if last.startswith("Higher"):
                bounds[0] = guess + 1
            elif last.startswith("Lower"):
                bounds[1] = guess - 1
        return f"Between {bounds[0]} and {bounds[1]}, I guess {(bounds[0] + bounds[1]) // 2}"

    return reply


def test_guess_number_halving_finds_every_target_within_the_default_turns() -> None:
    for target in range(1, 17):
        chat, total, turns, done = play(GuessNumberEnv(), {"target": target}, bisect_player(1, 16))
        assert done and total == 1.0 and turns <= 5, (target, chat)
    assert "between 1 and 16" in chat[0]["content"] and "at most 5 tries" in chat[0]["content"]


def test_guess_number_hints_formats_and_running_out() -> None:
    env = GuessNumberEnv()
    env.reset({"target": 7, "low": 1, "high": 16, "max_guesses": 4})
    assert env.step("I think 3")[0][0]["content"] == "Higher. 3 tries left."
    assert env.step("maybe 20? no: 12")[0][0]["content"] == "Lower. 2 tries left."  # the last integer counts
    new, reward, done = env.step("no idea")
    assert "found no number" in new[0]["content"] and "between 1 and 16" in new[0]["content"] and not done
    assert new[0]["content"].endswith("1 try left.")
    assert env.step("99") == ([], 0.0, True) and env.turns == 4 and not env.found
    env.reset({"target": 5, "max_guesses": 3})
    assert env.step("17")[0][0]["content"].startswith("17 is not between 1 and 16.")
    assert env.step("5") == ([], 1.0, True) and env.found


def test_guess_number_rows_are_reproducible_and_valid() -> None:
    rows = guess_number_rows(200, seed=3)
    assert rows == guess_number_rows(200, seed=3) and rows != guess_number_rows(200, seed=4)
    assert {r["target"] for r in rows} == set(range(1, 17))
    assert all(r == {"target": r["target"], "low": 1, "high": 16, "max_guesses": 5} for r in rows)
    assert guess_number_rows(2, 0, low=5, high=5, max_guesses=2) == [{"target": 5, "low": 5, "high": 5, "max_guesses": 2}] * 2
    with pytest.raises(ValueError, match="guess_number: the row's 'target' must be a whole number"):
        GuessNumberEnv().reset({"target": "seven"})
    with pytest.raises(ValueError, match="low <= target <= high"):
        GuessNumberEnv().reset({"target": 30})


# --------------------------------------------------------------------------- python_math

def tool_call(code: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def test_python_math_runs_the_tool_then_scores_the_final_answer() -> None:
    env = PythonMathEnv()
    replies = iter([f"Let me compute. {tool_call('print(4821 * 739 + 5)')}", "The answer is \\boxed{3562724}."])
    chat, total, turns, done = play(env, {"question": "What is 4821 * 739 + 5?", "answer": "3562724"},
                                    lambda chat: next(replies))
    opening = len(PythonMathEnv().reset({"question": "What is 4821 * 739 + 5?", "answer": "3562724"}))
    assert (total, turns, done) == (1.0, 2, True)
    assert chat[opening + 1] == {"role": "tool", "tool_call_id": "call00000", "name": "python", "content": "3562724"}
    assert env.correct and env.used_tool and (env.tool_calls, env.tool_errors) == (1, 0)
    assert "`python` tool" in chat[0]["content"]


def test_python_math_opens_with_the_call_format_and_worked_examples() -> None:
    """The system message shows the call and the answer format; each worked example is a finished
    episode whose call, run by the real tool, prints exactly what the example shows and whose boxed
    answer the environment rewards; the row's question comes last, alone."""
    from spmd_rl.episodes.builtin import PYTHON_MATH_EXAMPLES, PYTHON_MATH_SYSTEM
    from spmd_rl.episodes.tools import ToolCall, parse_tool_calls, python_tool, run_calls

    messages = PythonMathEnv().reset({"question": "What is 17 * 23?", "answer": "391"})
    assert messages[0] == {"role": "system", "content": PYTHON_MATH_SYSTEM}
    shown = parse_tool_calls(messages[0]["content"])
    assert len(shown) == 1 and isinstance(shown[0], ToolCall) and shown[0].arguments == {"code": "print(37 * 48)"}
    assert "\\boxed{1776}" in messages[0]["content"] and 37 * 48 == 1776
    assert messages[-1] == {"role": "user", "content": "What is 17 * 23?"}
    examples = messages[1:-1]
    assert len(examples) == 4 * len(PYTHON_MATH_EXAMPLES) >= 8
    assert any(not q.startswith("What is") for q, _, _ in PYTHON_MATH_EXAMPLES)  # a word problem among them
    tools = {"python": python_tool()}
    for i, (question, _, printed) in enumerate(PYTHON_MATH_EXAMPLES):
        user, call, answer, final = examples[4 * i: 4 * i + 4]
        assert (user, [m["role"] for m in (call, answer, final)]) == (
            {"role": "user", "content": question}, ["assistant", "tool", "assistant"])
        result, = run_calls(tools, parse_tool_calls(call["content"]))
        assert not result.error and result.content == answer["content"] == str(printed)
        env = PythonMathEnv()
        env.reset({"question": question, "answer": str(printed)})
        assert env.step(call["content"])[0] == [dict(answer, tool_call_id="call00000")]
        assert env.step(final["content"]) == ([], 1.0, True)


def test_python_math_counts_tool_errors_and_wrong_answers() -> None:
    env = PythonMathEnv()
    replies = iter(['<tool_call>{"name": "python", "arguments": {"source": "1"}}</tool_call>'
                    '<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "It is 71."])
    chat, total, turns, _ = play(env, {"question": "Q?", "answer": "Natalia sold 48/2 = 24 clips.\n#### 72"},
                                 lambda chat: next(replies))
    opening = len(chat) - 4
    assert total == 0.0 and turns == 2 and not env.correct
    assert (env.tool_calls, env.tool_errors) == (2, 2)
    assert "missing argument(s) ['code']" in chat[opening + 1]["content"]
    assert "no tool named 'shell'" in chat[opening + 2]["content"]
    env.reset({"question": "Q?", "answer": "#### 72"})
    assert env.step("so \\boxed{72}") == ([], 1.0, True) and not env.used_tool


def test_python_math_ends_unanswered_after_its_turns() -> None:
    env = PythonMathEnv()
    _, total, turns, done = play(env, {"question": "Q?", "answer": "1", "max_turns": 2},
                                 lambda chat: tool_call("print(1)"))
    assert (total, turns, done) == (0.0, 2, True) and env.tool_calls == 2


def test_python_math_rows_hold_their_own_answers() -> None:
    rows = python_math_rows(50, seed=1)
    assert rows == python_math_rows(50, seed=1) and rows != python_math_rows(50, seed=2)
    for row in rows:
        numbers = [int(x) for x in re.findall(r"\d+", row["question"])]
        if row["kind"] == "word":  # "... {b} ... {a} ... {c} ...": a * b, then c added or taken away
            b, a, c = numbers
            taken = "left" in row["question"] or "on loan" in row["question"]
            assert int(row["answer"]) == a * b + (-c if taken else c) and 0 < c < a * b
        else:
            expression = re.fullmatch(r"What is (.*)\?", row["question"]).group(1)
            assert calculate(expression) == row["answer"]
    with pytest.raises(ValueError, match="python_math: the row needs a `question`"):
        PythonMathEnv().reset({"prompt": 3})


def test_python_math_rows_mix_easy_and_tool_sized_questions() -> None:
    """Every kind in equal shares, in turn: two-digit sums (some within a small model's head), and
    products, ``a * b ± c`` and word problems whose answers have 3 to 8 digits (the tool's work)."""
    from spmd_rl.data.tasks import generate_episode_rows
    from spmd_rl.episodes.builtin import PYTHON_MATH_EXAMPLES, PYTHON_MATH_KINDS

    rows = python_math_rows(64, seed=0)
    assert not {r["question"] for r in rows} & {q for q, _, _ in PYTHON_MATH_EXAMPLES}
    assert PYTHON_MATH_KINDS == ("sum", "product", "product_plus", "word")
    assert [r["kind"] for r in rows] == list(PYTHON_MATH_KINDS) * 16
    digits = {kind: {len(r["answer"].lstrip("-")) for r in rows if r["kind"] == kind} for kind in PYTHON_MATH_KINDS}
    assert digits["sum"] <= {2, 3} and digits["product"] <= {3, 4}
    assert max(digits["product_plus"]) >= 7 and min(digits["word"]) >= 3 and max(digits["word"]) >= 5
    assert len({r["question"].split(" ")[1] for r in rows if r["kind"] == "word"}) > 1  # several templates
    train, val = generate_episode_rows("python_math", seed=0, val_size=8)
    assert [s.columns for s in val] == python_math_rows(8, seed=1)
    assert all(s.prompt == s.columns["question"] and s.answer == s.columns["answer"] for s in train[:8] + val)


# --------------------------------------------------------------------------- TextArena

@pytest.fixture
def no_network(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the game tried to reach the network")

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refused)
    monkeypatch.setattr(socket, "getaddrinfo", refused)
    monkeypatch.setattr(socket, "create_connection", refused)


def ta_bisect(chat: list[dict]) -> str:
    low, high = 1, 20
    for asked, answer in zip(chat[1::2], chat[2::2]):
        guess = int(re.search(r"\[(\d+)\]", asked["content"]).group(1))
        if "higher" in answer["content"]:
            low = guess + 1
        elif "lower" in answer["content"]:
            high = guess - 1
    return f"I guess [{(low + high) // 2}]"


def test_textarena_guess_the_number_plays_offline_and_reproducibly(no_network) -> None:
    pytest.importorskip("textarena")
    row = textarena_rows("GuessTheNumber-v0-raw", 1, seed=0)[0]
    before = random.getstate()
    chat, total, turns, done = play(TextArenaEnv(), row, ta_bisect)
    assert random.getstate() == before  # the process's global random state is left alone
    assert done and total == 1.0 and turns <= 5
    assert "Guess The Number" in chat[0]["content"] and chat[2]["content"].startswith("The target number is")
    again, *_ = play(TextArenaEnv(), row, ta_bisect)
    assert again == chat  # the same seed plays the same game


def test_textarena_invalid_moves_subclasses_and_refusals(no_network) -> None:
    pytest.importorskip("textarena")

    class Guess(TextArenaEnv):
        env_id = "GuessTheNumber-v0-raw"

    env = Guess()
    env.reset({"seed": 1})
    new, reward, done = env.step("fifteen")
    assert not done and reward == 0.0 and "invalid move" in new[0]["content"] and "'[number]'" in new[0]["content"]
    with pytest.raises(ValueError, match="ConnectFour-v0-raw is not a single-player game"):
        TextArenaEnv().reset({"env_id": "ConnectFour-v0-raw", "seed": 1})
    with pytest.raises(ValueError, match="no game; give the row an `env_id`"):
        TextArenaEnv().reset({"seed": 1})
    rows = textarena_rows("Mastermind-v0-raw", 3, seed=2)
    assert rows == textarena_rows("Mastermind-v0-raw", 3, seed=2) and len({r["seed"] for r in rows}) == 3
