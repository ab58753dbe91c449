"""Agents for the endpoint tests (``--agent.fn support.agents:fn``): ``fn(client, row) -> reward``."""

from __future__ import annotations

from spmd_rl.episodes.agent import MODEL_NAME

SEEN: list[dict] = []
"""What two_turns saw: each reply's text and finish reason (in-process tests read it)."""


def two_turns(client, row: dict) -> float:
    """Asks, then asks again after the reply it got: two model turns, reward 0.5."""
    messages = [{"role": "user", "content": f"Tell me about {row['answer']}."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5)
    reply = first.choices[0].message
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Go on."}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5)
    SEEN.append({"replies": [reply.content, second.choices[0].message.content],
                 "finish": [first.choices[0].finish_reason, second.choices[0].finish_reason],
                 "usage": [first.usage.completion_tokens, second.usage.completion_tokens]})
    return 0.5
