"""Tools of episodes (``spmd_rl/episodes/tools.py``): the registry, the call format and its errors, running
calls (never raising), tool messages, the worker pool and its counts, the prompt and the template probe."""

from __future__ import annotations

import json
import textwrap
import threading
import time

import pytest

from spmd_rl.episodes.tool_prompt import supports_tools, tools_prompt, with_tools_prompt
from spmd_rl.episodes.tools import (
    CALL_FORMAT, Tool, ToolCall, ToolCallError, ToolRunner, build_tools, calculate, check_arguments, parse_tool_calls,
    python_tool, run_call, tool_from_function, tool_messages,
)


def call(name: str, **arguments: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# --------------------------------------------------------------------------- parsing

def test_calls_are_parsed_in_order_with_ids() -> None:
    reply = f"Let me compute. {call('calculator', expression='2+2')} and {call('python', code='print(1)')} done"
    calls = parse_tool_calls(reply)
    assert calls == [ToolCall("calculator", {"expression": "2+2"}, "call00000"),
                     ToolCall("python", {"code": "print(1)"}, "call00001")]
    assert parse_tool_calls("no calls here, just <b>text</b>") == []


def test_hermes_style_variants_are_accepted() -> None:
    qwen = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    fenced = '<tool_call>```json\n{"name": "calculator", "arguments": {"expression": "1"}}\n```</tool_call>'
    string_args = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
    llama = '<tool_call>{"name": "calculator", "parameters": {"expression": "4"}}</tool_call>'
    no_args = '<tool_call>{"name": "now"}</tool_call>'
    unclosed = 'answer: <tool_call>{"name": "calculator", "arguments": {"expression": "5"}}'
    got = [parse_tool_calls(r)[0] for r in (qwen, fenced, string_args, llama, no_args, unclosed)]
    assert [c.arguments for c in got] == [{"expression": e} for e in ("1+1", "1", "3", "4")] + [{}, {"expression": "5"}]
    assert all(isinstance(c, ToolCall) for c in got)


@pytest.mark.parametrize("reply, says", [
    ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', 'needs a "name"'),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "calculator", "argum', "not closed with </tool_call>"),
])
def test_malformed_calls_become_errors_that_show_the_format(reply: str, says: str) -> None:
    (error,) = parse_tool_calls(reply)
    assert isinstance(error, ToolCallError)
    assert says in error.message and CALL_FORMAT in error.message


# --------------------------------------------------------------------------- running

TOOLS = dict(build_tools(["calculator", "python"]), python=python_tool(timeout_s=120))
"""The built-ins; the sandbox's time limit raised, so that a busy machine's slow interpreter start is
not a killed call (test_sandbox.py tests the limits)."""


def test_calculator_is_exact_arithmetic_without_names_or_calls() -> None:
    assert calculate("2 * (3 + 4)") == "14"
    assert calculate("7 / 2") == "3.5" and calculate("2^10") == "1024" and calculate("-3 ** 2") == "-9"
    assert calculate("10 // 3") == "3" and calculate("10 % 3") == "1"
    for bad, says in [("__import__('os')", "found Call"), ("x + 1", "found Name"), ("1/0", "division by zero"),
                      ("10 ** 10 ** 10", "too large"), ("1 +", "not an arithmetic expression"),
                      ("'a' * 3", "found Constant")]:
        with pytest.raises(ValueError, match=says):
            calculate(bad)


def test_each_failure_becomes_an_error_message_never_an_exception() -> None:
    def boom(x: int) -> str:
        raise RuntimeError("tool broke")

    tools = dict(TOOLS, boom=tool_from_function(boom))
    cases = [
        (ToolCall("nope", {}, "call00000"), "there is no tool named 'nope'"),
        (ToolCall("calculator", {}, "call00001"), "missing argument(s) ['expression']"),
        (ToolCall("calculator", {"expression": "1", "x": 2}, "call00002"), "unknown argument(s) ['x']"),
        (ToolCall("calculator", {"expression": 12}, "call00003"), "must be of type string, got int"),
        (ToolCall("calculator", {"expression": "1/0"}, "call00004"), "ValueError: division by zero"),
        (ToolCall("boom", {"x": 1}, "call00005"), "boom failed: RuntimeError: tool broke"),
        (parse_tool_calls("<tool_call>{oops</tool_call>")[0], "not valid JSON"),
    ]
    for c, says in cases:
        result = run_call(tools, c)
        assert result.error and result.content.startswith("error: ") and says in result.content, result.content
    ok = run_call(tools, ToolCall("calculator", {"expression": "6*7"}, "call00006"))
    assert not ok.error and ok.content == "42"


def test_the_python_tool_runs_in_the_sandbox_and_reports_failures_as_output() -> None:
    ok = run_call(TOOLS, ToolCall("python", {"code": "print(sum(range(101)))"}, "call00000"))
    assert not ok.error and ok.content == "5050"
    failing = run_call(TOOLS, ToolCall("python", {"code": "print('hi')\nraise ValueError('bad input')"}, "call00001"))
    assert not failing.error  # the call worked; the program failed, and the model reads why
    assert failing.content.startswith("hi\nstderr:") and "ValueError: bad input" in failing.content
    assert failing.content.endswith("[exit code 1]")
    quiet = run_call(TOOLS, ToolCall("python", {"code": "x = 1"}, "call00002"))
    assert "no output" in quiet.content


def test_tool_messages_carry_the_name_and_call_id() -> None:
    results = [run_call(TOOLS, c) for c in parse_tool_calls(call("calculator", expression="1+2") + "<tool_call>x</tool_call>")]
    assert tool_messages(results) == [
        {"role": "tool", "tool_call_id": "call00000", "name": "calculator", "content": "3"},
        {"role": "tool", "tool_call_id": "call00001", "content": results[1].content},
    ]
    assert all(len(m["tool_call_id"]) == 9 and m["tool_call_id"].isalnum() for m in tool_messages(results))
    (user,) = tool_messages(results, as_user=True)
    assert user["role"] == "user" and user["content"].startswith("<tool_response>\n3\n</tool_response>\n")
    assert tool_messages([], as_user=True) == []


# --------------------------------------------------------------------------- the registry

def test_user_tools_get_a_schema_from_signature_and_docstring(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_tools_mod.py").write_text(textwrap.dedent('''
        from __future__ import annotations

        def lookup(city: str, days: int = 1, metric: bool | None = None) -> dict:
            """Look up the weather of a city.

            Args:
                city: the city's name
                days (int): how many days ahead
            """
            return {"city": city, "days": days}

        NOT_CALLABLE = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = build_tools(["calculator", "my_tools_mod:lookup"])
    assert list(tools) == ["calculator", "lookup"]
    tool = tools["lookup"]
    assert tool.description == "Look up the weather of a city."
    assert tool.parameters == {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "description": "the city's name"},
                       "days": {"type": "integer", "description": "how many days ahead"},
                       "metric": {"type": "boolean"}},
    }
    result = run_call(tools, ToolCall("lookup", {"city": "Oslo", "days": 2}, "call00000"))
    assert json.loads(result.content) == {"city": "Oslo", "days": 2}
    with pytest.raises(ValueError, match=r"env\.tools=my_tools_mod:NOT_CALLABLE: .* is a int, not a function"):
        build_tools(["my_tools_mod:NOT_CALLABLE"])
    with pytest.raises(ValueError, match=r"env\.tools=my_tools_mod:lookup: a second tool named 'lookup'"):
        build_tools(["my_tools_mod:lookup", "my_tools_mod:lookup"])


@pytest.mark.parametrize("spec, says", [
    ("calculater", r"env\.tools=calculater: not a built-in tool \(python, calculator\) nor `module:function`"),
    ("no_such_tools_module_xyz:fn", r"env\.tools=no_such_tools_module_xyz:fn: no module named 'no_such_tools_module_xyz'"),
    ("json:no_such_fn", r"env\.tools=json:no_such_fn: .* has no attribute 'no_such_fn'"),
    ("json:", r"env\.tools=json:: expected a built-in tool \(python, calculator\) or `module:function`"),
])
def test_bad_tool_names_say_which_flag_and_value(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        build_tools([spec])


def test_check_arguments_accepts_what_the_schema_allows() -> None:
    tool = Tool("t", "t", {"type": "object", "properties": {"n": {"type": ["integer", "null"]}}, "required": []}, print)
    assert check_arguments(tool, {"n": None}) is None and check_arguments(tool, {"n": 3}) is None
    assert "must be of type integer or null" in check_arguments(tool, {"n": True})
    assert check_arguments(tool, {"other": 1}) is None  # additionalProperties not false


# --------------------------------------------------------------------------- the runner

def test_the_runner_runs_calls_concurrently_and_counts_them() -> None:
    release = threading.Event()
    started = []

    def wait(tag: str) -> str:
        """Block until released."""
        started.append(tag)
        assert release.wait(60)
        return tag

    tools = dict(TOOLS, wait=tool_from_function(wait))
    with ToolRunner(tools, workers=4, max_calls=3) as runner:
        slow = runner.submit([ToolCall("wait", {"tag": "a"}, "call00000"), ToolCall("wait", {"tag": "b"}, "call00001")])
        fast = runner.submit(parse_tool_calls(call("calculator", expression="2*21") + "<tool_call>{</tool_call>"))
        # the other episode's calls finish while the slow episode's two calls are both still running
        assert [m["content"] for m in fast.result(timeout=60)][0] == "42"
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(started) == ["a", "b"] and not slow.done()
        release.set()
        assert [m["content"] for m in slow.result(timeout=60)] == ["a", "b"]
        capped = runner.submit_results([ToolCall("calculator", {"expression": str(i)}, f"call{i:05d}") for i in range(5)])
        results = capped.result(timeout=60)
        assert [r.error for r in results] == [False, False, False, True, True]
        assert "at most 3 tool calls per reply" in results[4].content
        stats = runner.take_stats()
        assert (stats.calls, stats.errors) == (9, 3) and stats.seconds >= 0
        assert runner.take_stats().calls == 0
        assert runner.submit([]).result(timeout=5) == []


# --------------------------------------------------------------------------- offering tools

def test_tools_prompt_holds_the_format_and_every_schema() -> None:
    prompt = tools_prompt(TOOLS)
    assert CALL_FORMAT in prompt
    for tool in TOOLS.values():
        assert json.dumps(tool.schema()) in prompt
    messages = with_tools_prompt([{"role": "user", "content": "hi"}], TOOLS)
    assert messages[0] == {"role": "system", "content": prompt} and messages[1]["content"] == "hi"
    kept = with_tools_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS)
    assert kept[0]["content"] == "Be brief.\n\n" + prompt and len(kept) == 2


def _tokenizer(template: str | None):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = template
    return tok


PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
WITH_TOOLS = "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>" \
             "<|im_end|>\n{% endif %}" + PLAIN


def test_supports_tools_renders_the_template_with_and_without_tools() -> None:
    assert supports_tools(_tokenizer(WITH_TOOLS))
    assert not supports_tools(_tokenizer(PLAIN))
    assert not supports_tools(_tokenizer(None))
    assert not supports_tools(_tokenizer("{{ raise_exception('no') }}"))


def test_python_calls_from_several_episodes_run_side_by_side() -> None:
    with ToolRunner(TOOLS, workers=4) as runner:
        futures = [runner.submit([ToolCall("python", {"code": f"print({i} * 11)"}, "call00000")]) for i in range(6)]
        assert [f.result(timeout=300)[0]["content"] for f in futures] == [str(i * 11) for i in range(6)]
        assert runner.take_stats().errors == 0


def test_calls_left_waiting_when_the_runner_closes_are_answered_as_errors() -> None:
    release, started = threading.Event(), threading.Event()

    def wait() -> str:
        """Block until released."""
        started.set()
        assert release.wait(60)
        return "ran"

    runner = ToolRunner(dict(TOOLS, wait=tool_from_function(wait)), workers=1)
    future = runner.submit_results([ToolCall("wait", {}, "call00000"), ToolCall("wait", {}, "call00001")])
    assert started.wait(60)
    runner.close()  # the first call is running (it finishes); the second has not started: it is cancelled
    release.set()
    first, second = future.result(timeout=60)
    assert (first.content, first.error) == ("ran", False)
    assert second.error and "the tool runner was closed" in second.content
