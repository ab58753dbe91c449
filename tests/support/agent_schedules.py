"""Agents with a schedule for the endpoint's prefix-reuse tests (``fn(client, row) -> reward``): when
each episode's requests come is set by its row, and one agent rewrites its history."""

from __future__ import annotations

import time

from spmd_rl.episodes.agent import MODEL_NAME


def late_two_turns(client, row: dict) -> float:
    """``two_turns`` that waits ``row["delay"]`` seconds before its first request and ``row["think"]``
    between its two (an agent at its tools), each reply capped at ``row["cap"]`` tokens."""
    time.sleep(row.get("delay", 0.0))
    messages = [{"role": "user", "content": f"Tell me about {row['answer']}."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=row.get("cap", 5))
    time.sleep(row.get("think", 0.0))
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=row.get("cap", 5))
    return 0.5


def edits_history(client, row: dict) -> float:
    """Two turns; the second request's first message is not the one the first request sent (the agent
    rewrote its history), so the episode's tokens start again there."""
    messages = [{"role": "user", "content": f"Tell me about {row['answer']}."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5)
    messages = [{"role": "user", "content": f"Tell me all about the number {row['answer']}."},
                {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5)
    return 0.5
