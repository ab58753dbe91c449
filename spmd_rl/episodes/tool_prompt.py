"""How an episode's tools are offered to the model: through the chat template's ``tools=`` where the
template renders it (:func:`supports_tools`), else as a system prompt with the tools' JSON schemas and
the ``<tool_call>`` format (:func:`tools_prompt`, :func:`with_tools_prompt`).

    native = supports_tools(tokenizer)                       # the template renders tools=
    messages = messages if native else with_tools_prompt(messages, tools)
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from spmd_rl.episodes.tools import CALL_FORMAT, Tool


def tools_prompt(tools: dict[str, Tool] | Sequence[Tool]) -> str:
    """Instructions and JSON schemas of the tools, for a system message (templates without ``tools=``)."""
    listed = list(tools.values()) if isinstance(tools, dict) else list(tools)
    schemas = "\n".join(json.dumps(t.schema()) for t in listed)
    return ("# Tools\n\nYou may call one or more tools. They are described by these JSON schemas:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            f"To call a tool, write its name and arguments as JSON between tags:\n{CALL_FORMAT}\n"
            "Each call is answered in a message of its own. When you give your final answer, call no tool.")


def with_tools_prompt(messages: list[dict[str, Any]], tools: dict[str, Tool] | Sequence[Tool]) -> list[dict[str, Any]]:
    """``messages`` with :func:`tools_prompt` appended to the system message (one is added if absent)."""
    prompt = tools_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip())
        return [first] + list(messages[1:])
    return [{"role": "system", "content": prompt}] + list(messages)


_PROBE_TOOL = {"type": "function", "function": {"name": "spmd_rl_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools=`` (the probe tool's name appears in the
    rendered prompt only when it is given); False without a chat template or when rendering fails."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = [{"role": "user", "content": "hello"}]
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return isinstance(with_tools, str) and with_tools != without and "spmd_rl_probe_tool" in with_tools


__all__ = ["supports_tools", "tools_prompt", "with_tools_prompt"]
