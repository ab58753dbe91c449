"""Tools a model may call during an episode: the registry, the call format, running calls, tool messages.

Usage::

    tools = build_tools(["python", "calculator", "my_tools:lookup"])    # --env.tools
    calls = parse_tool_calls(reply)         # [ToolCall | ToolCallError] from the model's reply text
    with ToolRunner(tools, workers=8) as runner:
        messages = runner.submit(calls).result()   # role "tool" messages, in the calls' order
        stats = runner.take_stats()                 # calls, errors, seconds since the last take

A call is written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes / Qwen
format the chat templates with ``tools=`` support also use); a reply may hold several. The tools are
offered through the chat template's ``tools=`` where the template uses it (:func:`supports_tools`),
else :func:`tools_prompt` describes them in a system message (:func:`with_tools_prompt`).

Nothing here raises because of what the model wrote or what a tool did: bad JSON, an unknown tool,
wrong arguments or a tool that raises each becomes a tool message that says what went wrong, counted
as an error. Built-ins: ``python`` (the sandbox of :mod:`spmd_rl.episodes.sandbox`; a program that fails
is a successful call whose output shows the failure) and ``calculator`` (arithmetic through
:mod:`ast`: numbers, ``+ - * / // % **`` and ``^`` as power, parentheses; no names, no calls). A user
tool ``module:function`` is offered with a JSON schema read from its signature (annotations give the
types, parameters without defaults are required) and its docstring (the first paragraph describes it;
an ``Args:`` section describes the parameters).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
import typing
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence, get_args

from spmd_rl.episodes.calculator import calculate
from spmd_rl.episodes.sandbox import run_python, truncate
from spmd_rl.user_code import import_object

ToolName = Literal["python", "calculator"]
"""The built-in tools' names (``--env.tools`` also takes ``module:function``)."""

TOOL_OUTPUT_CHARS = 8000
"""A tool's answer is cut to this many characters (the ``python`` tool cuts its own output first)."""

CALL_FORMAT = '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>'


@dataclass(frozen=True)
class Tool:
    """A tool: its name, what it does, its parameters as a JSON schema (an ``object``) and the function
    that runs it with those parameters as keyword arguments, returning text (or JSON-able data)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] = field(repr=False, compare=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take in ``tools=``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call found in a reply (whether the tool exists is checked when it runs)."""

    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be read as a call; ``message`` says why."""

    message: str
    text: str
    id: str
    name: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """One call's answer: the text the model gets back and whether the call failed."""

    call: ToolCall | ToolCallError
    content: str
    error: bool
    seconds: float


# --------------------------------------------------------------------------- built-in tools

def _format_sandbox(result: Any, timeout_s: float) -> str:
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append(f"[killed: the time limit of {timeout_s:g} s was reached]")
    elif result.killed_by_memory:
        parts.append("[killed: the memory limit was reached]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) if parts else "(no output; print() what you want to see)"


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, output_chars: int = 4000) -> Tool:
    """The ``python`` tool with these sandbox limits."""

    def python(code: str) -> str:
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, output_chars=output_chars)
        return _format_sandbox(result, timeout_s)

    return Tool(
        name="python",
        description=(f"Run a Python program and get back what it prints (stdout and stderr). Each call is a "
                     f"fresh process: no state is kept between calls, no network, no files outside its own "
                     f"temporary folder, at most {timeout_s:g} s and {memory_mb} MB. Use print() for results."),
        parameters={"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                    "required": ["code"], "additionalProperties": False},
        fn=python,
    )


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression: numbers, + - * / // % ** (or ^ for power) and parentheses.",
    parameters={"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (17 + 4) * 3"}},
                "required": ["expression"], "additionalProperties": False},
    fn=calculate,
)


def builtin_tools() -> dict[str, Tool]:
    """Each built-in tool by name (``python`` with its default limits)."""
    tools = {"python": python_tool(), "calculator": CALCULATOR}
    assert set(tools) == set(get_args(ToolName))
    return tools


# --------------------------------------------------------------------------- user tools

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                               list: "array", tuple: "array", dict: "object"}


def _json_type(annotation: Any) -> str | None:
    """The JSON schema type of an annotation; None when it has none (any value)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(kinds[0]) if len(kinds) == 1 else None
    return _JSON_TYPES.get(origin or annotation)


def _docstring_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(the first paragraph, {parameter: description}) from ``Args:`` or ``:param x:`` lines."""
    doc = inspect.getdoc(fn) or ""
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    described: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        m = re.match(r":param\s+(?:\w+\s+)?(\w+):\s*(.*)", stripped)
        if m is None and in_args:
            m = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", stripped)
            in_args = bool(stripped)
        if m:
            described[m.group(1)] = m.group(2)
    return summary, described


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A tool whose schema is read from ``fn``'s signature and docstring (see the module docstring)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    summary, described = _docstring_parts(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    extra = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = True
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        prop: dict[str, Any] = {}
        kind = _json_type(hints.get(p.name, p.annotation))
        if kind:
            prop["type"] = kind
        if p.name in described:
            prop["description"] = described[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    tool_name = name or getattr(fn, "__name__", "tool")
    return Tool(name=tool_name, description=summary or tool_name, fn=fn,
                parameters={"type": "object", "properties": properties, "required": required,
                            "additionalProperties": extra})


def _user_tool(spec: str) -> Tool:
    flag = f"env.tools={spec}"
    fn = import_object(spec, flag=flag, usage=f"a built-in tool ({', '.join(get_args(ToolName))}) or `module:function`")
    if not callable(fn):
        raise ValueError(f"{flag}: {spec} is a {type(fn).__name__}, not a function")
    return tool_from_function(fn)


def build_tools(names: Sequence[str]) -> dict[str, Tool]:
    """The tools of ``--env.tools``: built-in names and ``module:function``, by tool name, in order."""
    builtin = builtin_tools()
    tools: dict[str, Tool] = {}
    for spec in names:
        spec = spec.strip()
        if spec in builtin:
            tool = builtin[spec]
        elif ":" in spec:
            tool = _user_tool(spec)
        else:
            raise ValueError(f"env.tools={spec}: not a built-in tool ({', '.join(builtin)}) nor `module:function`")
        if tool.name in tools:
            raise ValueError(f"env.tools={spec}: a second tool named {tool.name!r}; tool names must differ")
        tools[tool.name] = tool
    return tools


# --------------------------------------------------------------------------- calls in a reply

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _read_call(body: str, call_id: str) -> ToolCall | ToolCallError:
    text = body.strip()
    fenced = _FENCE_RE.match(text)
    if fenced:
        text = fenced.group(1)
    hint = f"write each call as {CALL_FORMAT}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos}); {hint}", body, call_id)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCallError(f'the tool call needs a "name" (a string); {hint}', body, call_id)
    name = data["name"]
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" must be a JSON object; {hint}', body, call_id, name)
    return ToolCall(name, arguments, call_id)


def parse_tool_calls(reply: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>...</tool_call>`` of the reply, in order, as a call or as what was wrong with it.
    A last ``<tool_call>`` left open (the reply ended inside it) is read too when it holds valid JSON."""
    out: list[ToolCall | ToolCallError] = []
    end = 0
    for m in _CALL_RE.finditer(reply):
        out.append(_read_call(m.group(1), f"call{len(out):05d}"))
        end = m.end()
    rest = reply[end:]
    if "<tool_call>" in rest:
        call = _read_call(rest.split("<tool_call>", 1)[1], f"call{len(out):05d}")
        if isinstance(call, ToolCallError):
            call = ToolCallError(f"the tool call is not closed with </tool_call>; {call.message}", call.text, call.id)
        out.append(call)
    return out


# --------------------------------------------------------------------------- running calls

_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for ``tool`` (missing, unknown, wrong type), or None."""
    properties = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {missing}"
    if not tool.parameters.get("additionalProperties", True):
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; {tool.name} takes {sorted(properties)}"
    for key, value in arguments.items():
        kinds = properties.get(key, {}).get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if kinds and not any(_TYPE_CHECKS.get(k, lambda v: True)(value) for k in kinds):
            return f"argument {key!r} must be of type {' or '.join(kinds)}, got {type(value).__name__}"
    return None


def _failed(call: ToolCall | ToolCallError, message: str, started: float) -> ToolResult:
    return ToolResult(call, f"error: {message}", True, time.monotonic() - started)


def run_call(tools: dict[str, Tool], call: ToolCall | ToolCallError) -> ToolResult:
    """Run one call; never raises: every failure is an error result whose text tells the model why."""
    started = time.monotonic()
    if isinstance(call, ToolCallError):
        return _failed(call, call.message, started)
    tool = tools.get(call.name)
    if tool is None:
        return _failed(call, f"there is no tool named {call.name!r}; the tools are {sorted(tools)}", started)
    problem = check_arguments(tool, call.arguments)
    if problem:
        return _failed(call, f"{call.name}: {problem}", started)
    try:
        out = tool.fn(**call.arguments)
    except (Exception, SystemExit) as e:
        return _failed(call, f"{call.name} failed: {type(e).__name__}: {e}", started)
    try:
        content = out if isinstance(out, str) else json.dumps(out, default=str)
    except (TypeError, ValueError) as e:
        return _failed(call, f"{call.name} returned a {type(out).__name__} that is not text: {e}", started)
    return ToolResult(call, truncate(content, TOOL_OUTPUT_CHARS)[0], False, time.monotonic() - started)


def limit_calls(calls: Sequence[ToolCall | ToolCallError], max_calls: int) -> list[ToolCall | ToolCallError]:
    """The first ``max_calls`` calls; each one past them becomes an error saying it was not run."""
    out = list(calls[:max_calls])
    for call in calls[max_calls:]:
        out.append(ToolCallError(f"not run: at most {max_calls} tool calls per reply", getattr(call, "text", ""),
                                 call.id, call.name))
    return out


def run_calls(tools: dict[str, Tool], calls: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
    """Run calls one after the other in this thread (an environment's own tools; see :class:`ToolRunner`)."""
    return [run_call(tools, call) for call in calls]


def tool_messages(results: Sequence[ToolResult], *, as_user: bool = False) -> list[dict[str, Any]]:
    """The messages that answer the calls: one ``role: tool`` message per result with the tool's
    ``name`` and the call's ``tool_call_id`` (nine letters and digits, as Mistral's templates require);
    ``as_user``: one user message with each answer in ``<tool_response>`` tags, for chat templates
    without a tool role."""
    if as_user:
        body = "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)
        return [{"role": "user", "content": body}] if results else []
    out = []
    for r in results:
        message: dict[str, Any] = {"role": "tool", "tool_call_id": r.call.id, "content": r.content}
        if r.call.name:
            message["name"] = r.call.name
        out.append(message)
    return out


@dataclass
class ToolStats:
    """Tool calls run, the failed ones among them, and the seconds they took (summed over calls)."""

    calls: int = 0
    errors: int = 0
    seconds: float = 0.0

    def add(self, results: Sequence[ToolResult]) -> None:
        self.calls += len(results)
        self.errors += sum(r.error for r in results)
        self.seconds += sum(r.seconds for r in results)


class ToolRunner:
    """Runs tool calls on a pool of worker threads (the ``python`` tool is a child process, so threads
    suffice), so that a slow call holds its own episode only. Thread-safe; ``close`` or ``with``."""

    def __init__(self, tools: dict[str, Tool], *, workers: int = 4, max_calls: int = 8) -> None:
        if workers < 1 or max_calls < 1:
            raise ValueError(f"ToolRunner: workers and max_calls must be >= 1, got {workers}, {max_calls}")
        self.tools = tools
        self.max_calls = max_calls
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spmd_rl-tool")
        self._lock = threading.Lock()
        self._stats = ToolStats()

    def submit_results(self, calls: Sequence[ToolCall | ToolCallError]) -> Future[list[ToolResult]]:
        """A future of the calls' results, in their order; the calls run concurrently."""
        calls = limit_calls(calls, self.max_calls)
        out: Future[list[ToolResult]] = Future()
        results: list[ToolResult | None] = [None] * len(calls)
        left = [len(calls)]
        if not calls:
            out.set_result([])
            return out

        def finished(i: int, call: ToolCall | ToolCallError, future: Future[ToolResult]) -> None:
            if future.cancelled():
                result = ToolResult(call, "error: not run: the tool runner was closed", True, 0.0)
            elif future.exception() is not None:  # run_call does not raise; this keeps the future from hanging
                result = ToolResult(call, f"error: {future.exception()}", True, 0.0)
            else:
                result = future.result()
            with self._lock:
                results[i] = result
                left[0] -= 1
                complete = left[0] == 0
                if complete:
                    self._stats.add(results)  # type: ignore[arg-type]
            if complete:
                out.set_result(list(results))  # type: ignore[arg-type]

        for i, call in enumerate(calls):
            self._pool.submit(run_call, self.tools, call).add_done_callback(
                lambda f, i=i, call=call: finished(i, call, f))
        return out

    def submit(self, calls: Sequence[ToolCall | ToolCallError], *, as_user: bool = False) -> Future[list[dict]]:
        """A future of the tool messages answering ``calls`` (see :func:`tool_messages`)."""
        out: Future[list[dict]] = Future()

        def answered(results: Future[list[ToolResult]]) -> None:
            try:
                out.set_result(tool_messages(results.result(), as_user=as_user))
            except Exception as e:  # not expected; the caller sees it instead of waiting forever
                out.set_exception(e)

        self.submit_results(calls).add_done_callback(answered)
        return out

    def take_stats(self) -> ToolStats:
        """The counts since the last take (for ``env/tool_calls``, ``env/tool_errors``, ``timing_s/env``)."""
        with self._lock:
            stats, self._stats = self._stats, ToolStats()
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "CALCULATOR", "CALL_FORMAT", "TOOL_OUTPUT_CHARS", "Tool", "ToolCall", "ToolCallError", "ToolName", "ToolResult",
    "ToolRunner", "ToolStats", "build_tools", "builtin_tools", "calculate", "check_arguments", "limit_calls",
    "parse_tool_calls", "python_tool", "run_call", "run_calls", "tool_from_function", "tool_messages",
]
