"""Turn samples into prompt token ids with the tokenizer's chat template, dropping long prompts.

Used once at start-up on every prompt set::

    train, ids, dropped = render_prompts(train, tokenizer, system_prompt=cfg.data.system_prompt,
                                         max_prompt_length=cfg.data.max_prompt_length)

A sample becomes ``[system?, user]`` messages (or its own chat ``messages``, with the system prompt
put first when the chat has none), rendered with ``apply_chat_template(add_generation_prompt=True,
tokenize=True)``. A tokenizer without a chat template gets the raw text instead: the system prompt
(if any), a blank line, then the message contents joined by blank lines, encoded with the
tokenizer's ordinary ``encode`` (its own special tokens such as BOS, nothing else added).

Prompts longer than ``max_prompt_length`` tokens are dropped and counted, never truncated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

from spmd_rl.data.tasks import Sample

_CHUNK = 512
"""Conversations rendered per ``apply_chat_template`` call."""


def sample_messages(sample: Sample, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat a sample is rendered from."""
    if sample.messages is not None:
        messages = [dict(m) for m in sample.messages]
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages
    messages = [{"role": "user", "content": sample.prompt}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _as_id_lists(out: Any, n: int) -> list[list[int]]:
    """Plain ``list[list[int]]`` from whatever ``apply_chat_template`` returned for ``n`` chats
    (a BatchEncoding / dict with ``input_ids``, a tensor, or lists)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    rows = [list(map(int, r.tolist() if hasattr(r, "tolist") else r)) for r in out]
    if len(rows) != n:
        raise ValueError(f"apply_chat_template returned {len(rows)} token lists for {n} prompts")
    return rows


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_chats(tokenizer: Any, chats: Sequence[list[dict[str, str]]]) -> list[list[int]]:
    """Token ids of each chat, with the generation prompt (the assistant turn's opening) added."""
    if not chats:
        return []
    if not has_chat_template(tokenizer):
        texts = ["\n\n".join(m["content"] for m in chat) for chat in chats]
        return [list(map(int, tokenizer.encode(t))) for t in texts]
    ids: list[list[int]] = []
    for start in range(0, len(chats), _CHUNK):
        part = [list(c) for c in chats[start : start + _CHUNK]]
        out = tokenizer.apply_chat_template(part, add_generation_prompt=True, tokenize=True)
        ids.extend(_as_id_lists(out, len(part)))
    return ids


def render_prompts(
    samples: Sequence[Sample],
    tokenizer: Any,
    *,
    system_prompt: str | None,
    max_prompt_length: int,
) -> tuple[list[Sample], list[list[int]], int]:
    """``(kept_samples, prompt_token_ids, n_dropped)``; prompts over ``max_prompt_length`` tokens
    are dropped. Raises ``ValueError`` naming ``data.max_prompt_length`` when every prompt is
    dropped. An empty input gives empty outputs."""
    if max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
    samples = list(samples)
    if not samples:
        return [], [], 0
    ids = encode_chats(tokenizer, [sample_messages(s, system_prompt) for s in samples])
    kept: list[Sample] = []
    kept_ids: list[list[int]] = []
    for sample, row in zip(samples, ids):
        if len(row) <= max_prompt_length:
            kept.append(sample)
            kept_ids.append(row)
    if not kept:
        shortest = min(len(r) for r in ids)
        raise ValueError(
            f"all {len(samples)} prompts are longer than data.max_prompt_length ({max_prompt_length}) tokens "
            f"after the chat template; the shortest has {shortest} tokens"
        )
    return kept, kept_ids, len(samples) - len(kept)


__all__ = ["encode_chats", "has_chat_template", "render_prompts", "sample_messages"]
