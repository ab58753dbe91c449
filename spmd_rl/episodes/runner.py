"""Multi-turn episodes on a rollout engine: the model's turns generated in one stream, the
environment's steps and tool calls on worker threads beside it.

    runner = EpisodeRunner(load_env(fn, name), framing=TurnFraming(tok, eos_ids=eos), tokenizer=tok,
                           max_turns=4, max_tokens=1024, tools=None, workers=8, skip_errors=False)
    out = runner.run(engine, rows, n=4, sampling=dict(temperature=1.0, top_p=1.0, top_k=0,
                                                      max_new_tokens=256, seed=7))

Each data row plays ``n`` episodes (prompt-major, as a round's responses are). An episode starts from
its environment's ``reset(row)`` messages; each model turn is streamed by the engine
(:meth:`~spmd_rl.rollout.native.NativeRollout.stream`: a finished turn frees its slot for another
episode's, and its K/V stays parked there until another row needs the slot, so that the episode's
next turn prefills only the environment's new tokens: :mod:`spmd_rl.rollout.prefixes`) and handed to a
worker thread, which runs the turn's tool calls (``env.tools``) or the
environment's ``step``, and tokenizes what comes back (:class:`~spmd_rl.episodes.framing.TurnFraming`);
the episode then waits for its next turn, while the others go on. The episode ends when the
environment says done, after ``env.max_turns`` model turns, or when its tokens after the prompt
reach ``env.max_tokens`` (cut there: ``truncated``).

Token-in / token-out: the model's tokens and their log-probs are kept as sampled; only the
environment's messages are tokenized. The output is a round's rows (``response_ids``, ``logprobs``,
``truncated``) with ``response_mask`` on the model's tokens, ``context_mask`` on the environment's,
each episode's prompt (``prompt_ids``, ``prompt_lengths``) and its ``env_*`` counts.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from spmd_rl.distributed.watchdog import current as current_watchdog
from spmd_rl.episodes.env import Env, check_messages, check_step
from spmd_rl.episodes.framing import TurnFraming
from spmd_rl.episodes.tool_prompt import with_tools_prompt
from spmd_rl.episodes.tools import Tool, parse_tool_calls, run_calls, tool_messages
from spmd_rl.models.tokenizer import decode_tokens

log = logging.getLogger("spmd_rl")


@dataclass
class Episode:
    """One episode's state: its prompt, the tokens after it (the model's, masked 1, and the
    environment's), the model's log-probs, and its counts."""

    row: dict
    env: Env
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)  # 1: a model token
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    seconds: float = 0.0  # inside reset, step and tools
    fed: int = 0  # tokens its turns were fed with (prompt and context), summed over its turns
    reused: int = 0  # of those, the tokens whose K/V was still parked (not prefilled again)
    done: bool = False
    truncated: bool = False
    failed: str | None = None


class EpisodeRunner:
    """Plays a round's episodes on an engine (module docstring)."""

    def __init__(self, make_env: Callable[[], Env], *, framing: TurnFraming, tokenizer: Any, max_turns: int,
                 max_tokens: int, tools: dict[str, Tool] | None, workers: int, skip_errors: bool,
                 tools_as_user: bool = True, reuse_prefixes: bool = True, warn_after_s: float = 0.0) -> None:
        self.make_env, self.framing, self.tokenizer = make_env, framing, tokenizer
        self.reuse_prefixes = reuse_prefixes  # an episode's next turn prefills only its new tokens
        self._busy: dict[int, tuple[str, float]] = {}  # episode -> the call it is in, since (monotonic)
        # waiting this long for environments with nothing to generate logs what they are in (0: never);
        # a run of one process has no stall watchdog to say it
        self.warn_after_s = warn_after_s
        self.max_turns, self.max_tokens, self.tools = max_turns, max_tokens, tools
        self.workers, self.skip_errors, self.tools_as_user = workers, skip_errors, tools_as_user

    # ------------------------------------------------------------------ one round
    def run(self, engine: Any, rows: list[dict], *, n: int, sampling: dict) -> dict[str, torch.Tensor]:
        """``n`` episodes of every row (prompt-major); the round's rows (module docstring)."""
        episodes = [Episode(row=dict(row), env=self.make_env()) for row in rows for _ in range(n)]
        forget = getattr(engine, "forget_prefixes", lambda: None)
        forget()  # the keys below are this round's episodes
        watchdog = current_watchdog()
        watchdog.describe(self.waiting)  # a stall report names the environment call that hangs
        try:
            with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="spmd_rl-env") as pool:
                for e, prompt in zip(episodes, pool.map(self._reset, episodes)):
                    e.prompt = prompt
                self._play(engine, episodes, pool, sampling)
        finally:
            watchdog.describe(None)
            forget()
        return episode_rows(episodes)

    def waiting(self) -> str:
        """The oldest environment call in progress, its row and for how long ("" when none): what the
        stall watchdog names (:meth:`~spmd_rl.distributed.watchdog.Watchdog.describe`)."""
        busy = list(self._busy.values())
        if not busy:
            return ""
        what, since = min(busy, key=lambda b: b[1])
        return (f"waits for {what} (running {time.monotonic() - since:.0f} s; {len(busy)} environment "
                f"call{'s' if len(busy) > 1 else ''} in progress)")

    @contextmanager
    def _calling(self, e: Episode, what: str) -> Iterator[None]:
        """Time a call of ``e``'s environment or tools and show it to :meth:`waiting` meanwhile."""
        start = time.perf_counter()
        self._busy[id(e)] = (f"{what} on the row {e.row!r:.160}", time.monotonic())
        try:
            yield
        finally:
            self._busy.pop(id(e), None)
            e.seconds += time.perf_counter() - start

    def _play(self, engine: Any, episodes: list[Episode], pool: ThreadPoolExecutor, sampling: dict) -> None:
        """Streams until every episode ended: a turn that finishes goes to ``pool``; an episode whose
        step came back is fed again, before any new one. Reusing prefixes, at most as many episodes
        as the engine has slots are under way at once, so that each finds its K/V parked on its next
        turn (new rows would otherwise take over the parked slots of the episodes at their tools)."""
        fresh = [i for i, e in enumerate(episodes) if not e.done]
        ready: list[int] = []  # episodes under way whose step came back
        steps: dict[Future, int] = {}
        slots = getattr(engine, "batch_size", None) if self.reuse_prefixes else None
        under_way = [0]
        forget = getattr(engine, "forget_prefixes", lambda *keys: None)
        take_reused = getattr(engine, "take_reused_tokens", lambda key: 0)

        def collect(futures: list[Future]) -> None:
            for future in futures:
                i = steps.pop(future)
                future.result()  # a step that raised: its error, with the row (see _failed)
                if not episodes[i].done:
                    ready.append(i)
                else:  # its slot is free for good
                    under_way[0] -= 1
                    forget(i)

        def feed(k: int) -> list[tuple[int, list[int]]]:
            collect([f for f in steps if f.done()])
            taken, ready[:] = ready[:k], ready[k:]
            room = k - len(taken) if slots is None else min(k - len(taken), slots - under_way[0])
            if room > 0 and fresh:
                new, fresh[:] = fresh[:room], fresh[room:]
                taken += new
                under_way[0] += len(new)
            for i in taken:
                episodes[i].fed += len(episodes[i].prompt) + len(episodes[i].tokens)
            return [(i, episodes[i].prompt + episodes[i].tokens) for i in taken]

        def done(key: int, tokens: torch.Tensor, logprobs: torch.Tensor, swaps: torch.Tensor, truncated: bool) -> None:
            episodes[key].reused += take_reused(key)
            steps[pool.submit(self._turn, episodes[key], tokens.tolist(), logprobs.tolist())] = key

        longest = max(len(e.prompt) for e in episodes) + self.max_tokens
        while ready or steps or fresh:
            if not ready and not (fresh and (slots is None or under_way[0] < slots)):
                # every episode under way waits for its environment (and no new one may start)
                finished = wait(list(steps), timeout=self.warn_after_s or None, return_when=FIRST_COMPLETED)[0]
                if not finished:
                    log.warning("episodes: nothing to generate for %.0f s: %s", self.warn_after_s, self.waiting())
                collect(list(finished))
                continue
            engine.stream(feed=feed, done=done, max_prompt_length=longest, temperature=sampling["temperature"],
                          top_p=sampling["top_p"], top_k=sampling["top_k"], max_new_tokens=sampling["max_new_tokens"],
                          seed=sampling["seed"], keep_prefixes=self.reuse_prefixes)

    # ------------------------------------------------------------------ worker threads
    def _reset(self, e: Episode) -> list[int]:
        try:
            with self._calling(e, f"{type(e.env).__qualname__}.reset"):
                messages = check_messages(e.env.reset(e.row), e.env, "reset")
        except Exception as err:  # noqa: BLE001 - named with the row, or the episode skipped
            self._failed(e, "reset", err)
            return self.framing.first([{"role": "user", "content": ""}])
        if self.tools and self.tools_as_user:
            messages = with_tools_prompt(messages, self.tools)
        return self.framing.first(messages)

    def _turn(self, e: Episode, tokens: list[int], logprobs: list[float]) -> None:
        """The model's turn: its tokens kept, then the tools' or the environment's answer."""
        room = self.max_tokens - len(e.tokens)
        e.tokens += tokens[:room]
        e.model += [1] * min(len(tokens), room)
        e.logprobs += logprobs[:room]
        e.turns += 1
        if len(tokens) >= room:  # the episode's token budget is spent
            e.done = e.truncated = True
            return
        try:
            messages = self._answer(e, decode_tokens(self.tokenizer, [tokens])[0])
        except Exception as err:  # noqa: BLE001 - named with the row, or the episode skipped
            self._failed(e, "step", err)
            return
        if e.done or e.turns >= self.max_turns:
            e.done = True
            return
        more = self.framing.after(tokens, messages)
        room = self.max_tokens - len(e.tokens)
        e.tokens += more[:room]
        e.model += [0] * min(len(more), room)
        e.logprobs += [0.0] * min(len(more), room)
        if len(more) >= room:  # no room left for another model turn
            e.done = e.truncated = True

    def _answer(self, e: Episode, reply: str) -> list[dict]:
        """The tools' answers to the reply's calls, or else the environment's step (its reward added)."""
        calls = parse_tool_calls(reply) if self.tools else []
        if calls:
            with self._calling(e, "the tools " + ", ".join(sorted({getattr(c, "name", "(malformed)") for c in calls}))):
                results = run_calls(self.tools, calls)
            e.tool_calls += len(results)
            e.tool_errors += sum(r.error for r in results)
            return tool_messages(results, as_user=self.tools_as_user)
        with self._calling(e, f"{type(e.env).__qualname__}.step"):
            result = e.env.step(reply)
        messages, reward, done = check_step(result, e.env)
        e.reward += reward
        e.done = done
        return messages

    def _failed(self, e: Episode, method: str, err: Exception) -> None:
        where = f"{type(e.env).__qualname__}.{method} failed on the row {e.row!r:.200}: {type(err).__name__}: {err}"
        if not self.skip_errors:
            raise RuntimeError(f"environment {where} (or --reward.on-error skip)") from err
        e.failed, e.done = where, True


def episode_rows(episodes: list[Episode]) -> dict[str, torch.Tensor]:
    """The episodes as a round's rows (module docstring): tensors right-padded with 0."""
    rows = len(episodes)
    width = max(max(len(e.tokens) for e in episodes), 1)
    prompt_width = max(len(e.prompt) for e in episodes)
    out = {"response_ids": torch.zeros(rows, width, dtype=torch.long),
           "response_mask": torch.zeros(rows, width), "context_mask": torch.zeros(rows, width),
           "logprobs": torch.zeros(rows, width), "prompt_ids": torch.zeros(rows, prompt_width, dtype=torch.long)}
    for r, e in enumerate(episodes):
        t = len(e.tokens)
        model = torch.tensor(e.model, dtype=torch.float32)
        if e.failed is not None:  # skipped (reward.on_error=skip): nothing of it is trained on
            model.zero_()
        out["response_ids"][r, :t] = torch.tensor(e.tokens, dtype=torch.long)
        out["response_mask"][r, :t] = model
        out["context_mask"][r, :t] = 1.0 - torch.tensor(e.model, dtype=torch.float32)
        out["logprobs"][r, :t] = torch.tensor(e.logprobs, dtype=torch.float32)
        out["prompt_ids"][r, :len(e.prompt)] = torch.tensor(e.prompt, dtype=torch.long)
    counts = {"prompt_lengths": [len(e.prompt) for e in episodes], "truncated": [e.truncated for e in episodes],
              "env_turns": [e.turns for e in episodes], "env_failed": [e.failed is not None for e in episodes],
              "env_tool_calls": [e.tool_calls + int(getattr(e.env, "tool_calls", 0)) for e in episodes],
              "env_tool_errors": [e.tool_errors + int(getattr(e.env, "tool_errors", 0)) for e in episodes],
              "env_fed_tokens": [e.fed for e in episodes], "env_reused_tokens": [e.reused for e in episodes]}
    out.update({k: torch.tensor(v, dtype=torch.long) for k, v in counts.items()})
    out["env_reward"] = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    out["env_seconds"] = torch.tensor([e.seconds for e in episodes], dtype=torch.float32)
    return out


__all__ = ["Episode", "EpisodeRunner", "episode_rows"]
