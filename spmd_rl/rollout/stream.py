"""Streaming generation: rows come from a feed while others decode, and each row is handed back the
moment it finishes (``rollout.stream``, asynchronous GRPO's groups in flight).

    def feed(k):              # up to k new rows now (never blocks): [(key, prompt ids), ...]
        ...                   # or (key, prompt ids, most new tokens): that row stops there
    def done(key, tokens, logprobs, swaps, truncated):   # one finished row (CPU tensors)
        ...
    engine.stream(feed=feed, done=done, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256,
                  max_prompt_length=512, seed=7)   # returns when the feed is dry and no row is live

:meth:`~spmd_rl.rollout.native.NativeRollout.generate` takes a call's rows up front and returns them
all at its end; a stream never ends by itself. On the fast path (:func:`stream_decode`) the decoder
keeps its ``rollout.batch_size`` slots busy across what were separate calls: when slots are free and
its queue is empty it asks the feed for more rows, and at every check (every ``check_every`` decode
steps, the host sync the fast path already makes) it reads which slots finished, copies those rows'
outputs to the host and calls ``done`` for each, so its output row is free for a new one (output rows
are handles, twice the slots, recycled). A row's cache is sized for ``max_prompt_length +
max_new_tokens``, the longest any fed row can need.

Weights swapped mid-stream (``swap``, partial rollouts): as in ``generate``, every ``swap_every`` decode
steps the stream asks whether new weights were loaded; if so it stops, the rows still going keep their
tokens and log-probs and are fed again first, their prefix (prompt + tokens so far) prefilled under
the new weights, and ``swaps`` says, per token, how many swaps preceded it. Without ``swap`` the
caller changes weights between streams: its feed returns nothing, the live rows finish, the call
returns (a drain); ``look``, called as often and never stopping anything, lets it receive them
meanwhile (``rollout.stage_weights``).

The Hugging Face loop streams in waves of ``batch_size`` rows (a wave ends when its rows do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable

import torch

from .lengths import LengthDist, draw_lengths
from .sampling import row_seed
from .slots import SlotStream

if TYPE_CHECKING:
    from .fast import FastDecoder

Feed = Callable[[int], list[tuple[Hashable, list[int]] | tuple[Hashable, list[int], int]]]
"""``feed(k)``: at most ``k`` new rows, ``(key, prompt ids)`` or ``(key, prompt ids, most new tokens)``
(a row's own cap, at least 1; the stream's ``max_new_tokens`` caps it too); never blocks (empty: none now)."""
Done = Callable[[Hashable, torch.Tensor, torch.Tensor, torch.Tensor, bool], None]
"""``done(key, tokens, logprobs, swaps, truncated)``: a finished row, its response on the CPU."""


@dataclass(frozen=True)
class StreamEngine:
    """What a stream runs on, handed over by the engine that owns it
    (:meth:`~spmd_rl.rollout.native.NativeRollout.stream`): the fast decoder, or else the Hugging Face
    loop's ``generate_hf(prompts, max_new_tokens=, limits=, interrupt=, **sampling)`` returning
    ``tokens, mask, logprobs, truncated``; ``length_dist`` / ``min_new_tokens`` / ``token_delay_s``: the
    benchmark workloads of :mod:`spmd_rl.rollout.native`."""

    device: torch.device
    batch_size: int
    eos: torch.Tensor
    fast: "FastDecoder | None"
    generate_hf: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    length_dist: LengthDist = "model"
    min_new_tokens: int = 1
    token_delay_s: float = 0.0


@dataclass
class _Row:
    """A streamed row: its prompt, its limit, and what it generated so far (several pieces when
    weight swaps interrupted it)."""

    prompt: list[int]
    limit: int
    tokens: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    swaps: list[torch.Tensor] = field(default_factory=list)

    @property
    def made(self) -> int:
        return sum(len(t) for t in self.tokens)

    def prefix(self) -> list[int]:
        return self.prompt + [t for piece in self.tokens for t in piece.tolist()]


def run_stream(engine: StreamEngine, *, feed: Feed, done: Done, temperature: float, top_p: float, top_k: int,
               max_new_tokens: int, max_prompt_length: int, seed: int, swap: Callable[[], bool] | None = None,
               swap_every: int = 32, look: Callable[[], None] | None = None, keep_prefixes: bool = False) -> int:
    """The engine-level stream (see the module docstring); returns how many weight swaps happened."""
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    rows: dict[Hashable, _Row] = {}
    carry: list[Hashable] = []  # rows a swap interrupted: fed again first
    drawn = [0]
    swaps = 0

    def feed_rows(k: int) -> list[tuple[Hashable, list[int], int]]:
        out = []
        while carry and len(out) < k:
            key = carry.pop(0)
            r = rows[key]
            out.append((key, r.prefix(), r.limit - r.made))
        if len(out) < k:
            new = feed(k - len(out))
            limits = ([max_new_tokens] * len(new) if engine.length_dist == "model" else draw_lengths(
                engine.length_dist, count=len(new), low=min(engine.min_new_tokens, max_new_tokens),
                high=max_new_tokens, seed=seed + drawn[0]))
            drawn[0] += len(new)
            for (key, prompt, *cap), limit in zip(new, limits):
                if cap and not (isinstance(cap[0], int) and cap[0] >= 1):
                    raise ValueError(f"stream: a row's most new tokens must be a positive integer, got {cap[0]!r}")
                limit = min([limit, *cap])
                if len(prompt) > max_prompt_length:
                    raise ValueError(f"stream: a prompt of {len(prompt)} tokens is longer than the stream's "
                                     f"max_prompt_length ({max_prompt_length})")
                rows[key] = _Row(list(prompt), limit)
                out.append((key, list(prompt), limit))
        return out

    def piece(key: Hashable, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        r = rows[key]
        r.tokens.append(tokens.long())
        r.logprobs.append(logprobs.float())
        r.swaps.append(torch.full((len(tokens),), swaps, dtype=torch.long))

    def finish(key: Hashable, tokens: torch.Tensor, logprobs: torch.Tensor, truncated: bool) -> None:
        piece(key, tokens, logprobs)
        r = rows.pop(key)
        done(key, torch.cat(r.tokens), torch.cat(r.logprobs), torch.cat(r.swaps), truncated)

    fired = [False]  # the last interrupt loaded new weights

    def interrupt(steps: int) -> bool:
        if engine.token_delay_s:
            time.sleep(engine.token_delay_s)  # the benchmark's slow rollout, not a wait for anything
        if look is not None and steps % swap_every == 0:
            look()
        fired[0] = swap is not None and steps % swap_every == 0 and swap()
        return fired[0]

    hook = interrupt if swap is not None or look is not None or engine.token_delay_s else None
    slots = max_prompt_length + max_new_tokens
    while True:
        if engine.fast is not None:
            live = stream_decode(engine.fast, feed=feed_rows, finish=finish, max_new_tokens=max_new_tokens,
                                 slots=slots, eos=engine.eos, seed=seed, interrupt=hook, keep_prefixes=keep_prefixes,
                                 **sampling)
        else:
            live = _stream_waves(engine, feed=feed_rows, finish=finish, interrupt=hook, fired=fired, seed=seed,
                                 **sampling)
        if live is None:  # the feed is dry and no row is live
            return swaps
        fired[0] = False
        for key, tokens, logprobs in live:  # sampled by the old weights
            piece(key, tokens, logprobs)
        swaps += 1  # interrupted by new weights: the rows still going continue under them, first
        carry[:0] = [key for key, *_ in live]


def stream_decode(fast: "FastDecoder", *, feed: Callable[[int], list[tuple[Hashable, list[int], int]]],
                  finish: Callable[[Hashable, torch.Tensor, torch.Tensor, bool], None], temperature: float,
                  top_k: int, top_p: float, max_new_tokens: int, slots: int, seed: int,
                  eos: torch.Tensor, interrupt: Callable[[int], bool] | None = None, keep_prefixes: bool = False,
                  ) -> list[tuple[Hashable, torch.Tensor, torch.Tensor]] | None:
    """The fast path's stream: ``feed(k)`` gives ``(key, prompt ids, most new tokens)`` rows,
    ``finish(key, tokens, logprobs, truncated)`` takes each finished one. Returns None when the feed
    is dry and no row is live, or, when ``interrupt(steps)`` said stop, the rows not finished:
    ``(key, tokens so far, logprobs)`` (queued ones with none). A sampled row draws from its own
    uniforms, seeded by ``seed``, its key and its prompt's length
    (:func:`~spmd_rl.rollout.sampling.row_seed`): what it samples does not depend on when the feed gave
    it. ``keep_prefixes``: finished rows stay parked by key, and a row fed again that extends its prefix
    prefills only its new tokens (:mod:`spmd_rl.rollout.prefixes`)."""
    rows = SlotStream(fast, feed=feed, finish=finish, max_new_tokens=max_new_tokens, slots=slots, eos=eos,
                      seed=seed, keep_prefixes=keep_prefixes)
    spare = rows.start(temperature=temperature)
    cur = rows.cap
    rows.pull(cur)
    if not rows.queue:
        return None
    top = rows.fill(list(range(cur)))
    mode = fast.mode(temperature=temperature, top_k=top_k, top_p=top_p)
    span = fast.span(top + fast.check_every + 1)
    step = 0
    while True:
        fast.decode_slots(cur, span, mode)
        step += 1
        stopped = interrupt is not None and interrupt(step)
        if not stopped and step % fast.check_every:
            continue
        finished, row_of, top = rows.check(cur, spare)
        if stopped:
            return rows.unfinished([row_of[s] for s in range(cur) if not finished[s]])
        n_live = cur - sum(finished)
        if not rows.queue and n_live < rows.cap:
            rows.pull(rows.cap - n_live)
        if rows.queue and rows.wanted(n_live) > cur and cur < rows.cap:
            cur = rows.grow(cur, n_live, finished, spare)
        free_slots = [s for s in range(cur) if finished[s]]
        if rows.queue and (n_live == 0 or len(free_slots) >= max(1, int(cur * fast.refill_fraction))):
            top = max(top, rows.fill(free_slots))
            fast.refills += 1
        elif not rows.queue and n_live == 0:
            return None
        elif not rows.queue and fast.bucket(n_live) < cur:
            cur = rows.compact(cur, spare=spare)
        span = fast.span(top + fast.check_every + 1)


def _stream_waves(engine: StreamEngine, *, feed: Callable[[int], list[tuple[Hashable, list[int], int]]],
                  finish: Callable[[Hashable, torch.Tensor, torch.Tensor, bool], None],
                  interrupt: Callable[[int], bool] | None, fired: list[bool], seed: int,
                  **sampling) -> list[tuple[Hashable, torch.Tensor, torch.Tensor]] | None:
    """The Hugging Face loop's stream: waves of ``batch_size`` rows; the same results as
    :func:`stream_decode` (None, or the rows an interrupt left unfinished; ``fired[0]``: the
    interrupt said stop). A wave samples from a generator seeded by ``seed`` and its first row (its key
    and prompt length), so that waves of different calls with one seed do not repeat each other."""
    generator = torch.Generator(device=engine.device)
    while True:
        wave = feed(engine.batch_size)
        if not wave:
            return None
        generator.manual_seed(row_seed(seed, wave[0][0], len(wave[0][1])))
        limits = torch.tensor([limit for _, _, limit in wave])
        tokens, mask, logprobs, truncated = (x.cpu() for x in engine.generate_hf(
            [ids for _, ids, _ in wave], max_new_tokens=int(limits.max()), limits=limits, interrupt=interrupt,
            generator=generator, **sampling))
        lengths, width = mask.sum(1).long().tolist(), tokens.shape[1]
        live = []
        for i, (key, _, limit) in enumerate(wave):
            n = lengths[i]
            if fired[0] and truncated[i] and n == width < limit:  # still going when the weights changed
                live.append((key, tokens[i, :n].clone(), logprobs[i, :n].clone()))
            else:
                finish(key, tokens[i, :n].clone(), logprobs[i, :n].clone(), bool(truncated[i]))
        if fired[0]:
            return live


__all__ = ["Done", "Feed", "StreamEngine", "run_stream", "stream_decode"]
