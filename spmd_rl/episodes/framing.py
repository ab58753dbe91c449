"""Token ids of an episode's turns, token-in / token-out: the model's tokens are never decoded and
encoded again; only the environment's new messages are rendered with the chat template's turn
framing and tokenized.

    framing = TurnFraming(tokenizer, eos_ids=eos, tools=schemas)
    prompt = framing.first(messages)                        # the episode's first prompt (generation prompt added)
    ids = framing.after(model_tokens, [{"role": "user", "content": "Higher."}])   # what follows the model's turn

:meth:`TurnFraming.after` gives what the chat template puts between the model's last token and the
next generation prompt: the end of the model's turn when the model did not end it itself (a reply cut
by ``rollout.max_new_tokens``), the template's text after an assistant turn's end (ChatML's newline),
the new messages and the next assistant turn's opening. The template's renderings of a fixed short
conversation with and without the new messages are compared once per call, so the same framing
follows whatever the conversation so far was. A template that renders the earlier turns differently
once more follow (one that rewrites history) is refused with its name.
"""

from __future__ import annotations

from typing import Any

from spmd_rl.data.prompts import encode_chats, has_chat_template

_SENTINEL = "\x02spmd_rl reply\x03"
_BASE = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _SENTINEL}]


class TurnFraming:
    """An episode's framing for one tokenizer (module docstring); ``tools``: the JSON schemas given to
    a template that renders ``tools=`` (None: no tools, or the template does not take them)."""

    def __init__(self, tokenizer: Any, *, eos_ids: list[int], tools: list[dict] | None = None) -> None:
        if not eos_ids:
            raise ValueError("multi-turn episodes need the tokenizer's end-of-turn token: it has no eos token")
        self.tokenizer, self.eos_ids, self.tools = tokenizer, list(eos_ids), tools
        self.templated = has_chat_template(tokenizer)
        # the fixed short conversation rendered once: every turn's framing is read against it
        self._base = self._render(_BASE, generation=False) if self.templated else ""
        self.end_of_turn = self._end_of_turn()
        self.glue = self._glue()

    def _render(self, messages: list[dict], *, generation: bool) -> str:
        extra = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra)

    def _end_of_turn(self) -> int:
        """The token that ends the model's turn: the eos token the template writes after a reply."""
        if not self.templated:
            return self.eos_ids[0]
        after = self._base[self._base.index(_SENTINEL) + len(_SENTINEL):]
        for token in self.eos_ids:
            if after.startswith(self.tokenizer.decode([token])):
                return token
        return self.eos_ids[0]

    def _glue(self) -> str:
        """The template's text after an assistant turn's end token (ChatML: a newline)."""
        if not self.templated:
            return ""
        after = self._base[self._base.index(_SENTINEL) + len(_SENTINEL):]
        end = self.tokenizer.decode([self.end_of_turn])
        return after[len(end):] if after.startswith(end) else after

    def first(self, messages: list[dict]) -> list[int]:
        """The episode's first prompt: ``messages`` and the generation prompt."""
        if not self.tools or not self.templated:
            return encode_chats(self.tokenizer, [messages])[0]
        return self.encode(self._render(messages, generation=True))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def after(self, model_tokens: list[int], messages: list[dict]) -> list[int]:
        """What follows the model's turn ``model_tokens`` in the episode: its end (when the reply did
        not end it), the template's framing, ``messages`` and the next turn's generation prompt."""
        closed = [] if model_tokens and model_tokens[-1] in self.eos_ids else [self.end_of_turn]
        if not self.templated:
            return closed + self.encode("\n\n" + "\n\n".join(str(m.get("content") or "") for m in messages) + "\n\n")
        before = self._base
        whole = self._render(_BASE + list(messages), generation=True)
        if not whole.startswith(before):
            name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
            raise ValueError(f"the chat template of {name} renders earlier turns differently once new messages "
                             f"follow, so an episode's tokens cannot be extended in place: use a model whose "
                             f"template appends turns (e.g. ChatML)")
        return closed + self.encode(self.glue + whole[len(before):])


__all__ = ["TurnFraming"]
