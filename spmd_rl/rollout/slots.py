"""The fast decoder's slot-based KV cache: its memory check and allocation, and the state of its
slots during a call (the call's start, queued rows prefilled into free slots, compaction).

    class FastDecoder(PrefixCache): ...     # spmd_rl.rollout.fast: the decoder is a SlotCache
                                            # (PrefixCache, spmd_rl.rollout.prefixes, adds parked prefixes)
    fast.memory_needed(rows=64, slots=4224, out_rows=128)   # {"kv": ..., "buffers": ..., "transient": ...}
    fast.release(); fast.restore()          # rollout sleep: free the cache and graphs, reallocate
    rows = SlotStream(fast, feed=feed, finish=finish, ...)   # a stream's rows over the slots (rollout.stream)

``cache [full-length layers, 2, rows, slots, kv_heads, head_dim]`` holds one cache row (a sequence
slot) per decoding row: ``rows`` is the largest batch bucket used so far, ``slots`` the longest
prompt + ``max_new_tokens`` rounded up to 64 (both grow only). A row holds its left-padded prompt at
slots ``0..P-1`` (``pad`` slots of padding first) and writes its ``t``-th new token at slot ``P + t``:
every row has its own write slot and position. Sliding-window layers keep ``ring [windowed layers,
2, rows, kv_heads, min(window, slots), head_dim]`` instead, slot ``s`` at ring index ``s % R``.
Paged blocks would let rows share memory by their actual lengths, but need a block-table attention
kernel on every device (CPU included) and a gather per step; slots keep one contiguous run per row,
which masked SDPA, flash varlen and the Triton kernel read in place, and a queued row reserves
nothing until it gets a slot. Before allocating, the bytes are checked against the device's free
memory (:meth:`SlotCache.memory_needed`): too little fails with the numbers and the flags to change.
Every buffer a captured step reads or writes is allocated here once per shape, so CUDA graphs keep
their addresses; refills and compactions only rewrite them.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from .sampling import row_seed, row_uniforms


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can take: what torch's allocator holds unused plus what it
    may still reserve, the driver's free memory capped by this process's memory fraction (set for
    processes that share a GPU, ``pools.colocate``); None off CUDA (no check there)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index  # the fraction wants one
    free, total = torch.cuda.mem_get_info(index)
    reserved, allocated = torch.cuda.memory_reserved(index), torch.cuda.memory_allocated(index)
    fraction = torch.cuda.get_per_process_memory_fraction(index) if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    growth = min(free, max(0, int(total * fraction) - reserved))
    return reserved - allocated + growth


def size(n: float) -> str:
    """Bytes as GiB (MiB below 0.1 GiB), for messages."""
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 / 10 else f"{n / 2 ** 20:.2f} MiB"


class SlotCache:
    """The cache half of :class:`~spmd_rl.rollout.fast.FastDecoder`, its base class. It reads the
    decoder's shape and settings (``inner``, ``layers``, ``windows``, ``window``, ``kv_heads``,
    ``head_dim``, ``vocab``, ``rope_keys``, ``fused``, ``prefill_tokens``, ``pad_token_id``, ``device``,
    ``memory_budget``; ``record_routes``, ``moe_layers``, ``top_k`` for router replay) and calls its
    ``_prefill`` and ``bucket``."""

    _STEP_BUFFERS = ("_tok", "_pos", "_pad", "_wpos", "_ncol", "_limit", "_ar", "_row_of", "_finished", "_temp",
                     "_out_u", "_scaled", "_lse", "_out_tok", "_out_lp", "_out_mask", "_slots", "_cos", "_sin",
                     "_out_route", "_route_step", "_rec_row", "_rec_col")

    def release(self) -> None:
        """Free the KV cache, the step's buffers and the CUDA graphs (their memory pool)."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs, self._pool, self.cache, self.ring, self._eos = {}, None, None, None, None
        for name in self._STEP_BUFFERS:
            setattr(self, name, None)

    def restore(self) -> None:
        """Reallocate the cache of the last shape (after :meth:`release`); graphs are recaptured on use."""
        if self.cache is None and self._shape is not None:
            self._check_memory(*self._shape)
            self._allocate(*self._shape)

    def _ensure_cache(self, rows: int, slots: int, out_rows: int) -> None:
        """A cache of at least ``rows`` sequence slots of ``slots`` positions and outputs for ``out_rows``
        rows; grows only (a new size frees the old cache and graphs first)."""
        if self.cache is not None and all(a >= b for a, b in zip(self._shape, (rows, slots, out_rows))):
            return
        if self.cache is not None:
            rows, slots, out_rows = (max(a, b) for a, b in zip(self._shape, (rows, slots, out_rows)))
        self.release()
        slots = -(-slots // 64) * 64
        self._check_memory(rows, slots, out_rows)
        self._allocate(rows, slots, out_rows)

    def memory_needed(self, rows: int, slots: int, out_rows: int) -> dict[str, int]:
        """Bytes :meth:`_allocate` takes for ``rows`` sequence slots of ``slots`` positions and ``out_rows``
        output rows (``kv``: the K/V cache and rings; ``buffers``: logits and outputs), and ``transient``,
        an estimate of the largest prefill's activations (``prefill_tokens`` tokens at once)."""
        item = self.inner.embed_tokens.weight.element_size()
        windowed = sum(w is not None for w in self.windows)
        per_slot = 2 * self.kv_heads * self.head_dim * item  # K and V of one position, one layer
        kv = per_slot * rows * ((len(self.layers) - windowed) * slots + windowed * min(self.window or 0, slots))
        buffers = rows * self.vocab * 4 * 2 + (out_rows + 1) * slots * (8 + 4 + 4 + 4) + rows * 64
        if self.record_routes:  # int16 experts per output cell and MoE layer (router replay)
            buffers += ((out_rows + 1) * slots + rows) * len(self.moe_layers) * self.top_k * 2 + rows * 16
        hidden = self.inner.embed_tokens.weight.shape[1]
        width = max([f.weight.shape[0] for f in self.fused] + [hidden])  # the widest GEMM output (gate/up: 2 x MLP)
        transient = min(self.prefill_tokens, rows * slots) * (4 * hidden + 2 * width) * item
        return {"kv": kv, "buffers": buffers, "transient": transient}

    def _available(self) -> int | None:
        return self.memory_budget if self.memory_budget is not None else free_bytes(self.device)

    def _check_memory(self, rows: int, slots: int, out_rows: int) -> None:
        """Fail before allocating when the cache would not fit, with the numbers and the flags to change."""
        available = self._available()
        need = self.memory_needed(rows, slots, out_rows)
        total = sum(need.values())
        if available is None or total <= available:
            return
        per_row = need["kv"] / rows
        fit = max(0, int((available - total + need["kv"]) // per_row))
        raise MemoryError(
            f"FastDecoder: the KV cache of {rows} sequence slots x {slots} positions (rollout.batch_size x (longest "
            f"prompt + rollout.max_new_tokens), rounded up to 64) needs {size(total)} on {self.device} "
            f"({size(need['kv'])} K/V, {size(per_row)} per slot; {size(need['buffers'])} logits and outputs; "
            f"{size(need['transient'])} prefill activations), but {size(available)} is available. Lower "
            f"--rollout.batch-size (about {fit} slots fit; queued rows wait for a free slot, so fewer slots cost "
            "speed, not results), --rollout.max-new-tokens or --data.max-prompt-length, or leave more memory to "
            "the rollout (--rollout.sleep-level 2 for a colocated actor, --rollout.gpu-memory-fraction with "
            "pools.colocate)")

    def _allocate(self, rows: int, slots: int, out_rows: int) -> None:
        """The cache and every buffer a captured step reads or writes (fixed addresses for the graphs)."""
        dtype, dev = self.inner.embed_tokens.weight.dtype, self.device
        windowed = sum(w is not None for w in self.windows)
        # [layers, K/V, rows, slots, kv_heads, head_dim]: a row's entries are one run of (slot, head) pairs,
        # the layout flash varlen reads; SDPA reads the same memory as [rows, kv_heads, slots, head_dim]
        self.cache = torch.zeros(len(self.layers) - windowed, 2, rows, slots, self.kv_heads, self.head_dim,
                                 dtype=dtype, device=dev)
        self.ring = torch.zeros(windowed, 2, rows, self.kv_heads, min(self.window or 0, slots), self.head_dim,
                                dtype=dtype, device=dev)
        self._shape = (rows, slots, out_rows)
        long = dict(dtype=torch.long, device=dev)
        self._tok = torch.zeros(rows, **long)       # the token each row feeds the next forward
        self._pos = torch.zeros(rows, **long)       # its position
        self._pad = torch.zeros(rows, **long)       # left-padding slots of each row
        self._wpos = torch.zeros(rows, **long)      # the slot each row's next forward writes
        self._ncol = torch.zeros(rows, **long)      # the output column each row's next sample writes
        self._limit = torch.ones(rows, **long)      # each row's most new tokens
        self._ar = torch.arange(rows + 1, **long)
        self._row_of = torch.zeros(rows, **long)    # output row of each cache row (the spare row for spares)
        self._finished = torch.ones(rows, dtype=torch.bool, device=dev)
        self._temp = torch.ones(1, dtype=torch.float32, device=dev)  # logits are divided by it
        self._scaled = torch.zeros(rows, self.vocab, dtype=torch.float32, device=dev)  # logits / T
        self._lse = torch.zeros(rows, dtype=torch.float32, device=dev)
        self._out_tok = torch.zeros(out_rows + 1, slots, **long)  # + a spare row
        self._out_lp = torch.zeros(out_rows + 1, slots, dtype=torch.float32, device=dev)
        self._out_mask = torch.zeros_like(self._out_lp)
        self._out_u = torch.zeros_like(self._out_lp)  # the uniform each output cell's token is sampled with
        if self.record_routes:  # router replay: each output cell's experts per MoE layer, and the step's
            routes = dict(dtype=torch.int16, device=dev)
            self._out_route = torch.full((out_rows + 1, slots, len(self.moe_layers), self.top_k), -1, **routes)
            self._route_step = torch.zeros(len(self.moe_layers), rows, self.top_k, **routes)
            self._rec_row, self._rec_col = torch.zeros(rows, **long), torch.zeros(rows, **long)
        self._slots = torch.arange(slots, device=dev)
        # RoPE tables by position, one per rope key (see rope_types)
        self._cos = torch.zeros(len(self.rope_keys), slots, self.head_dim, dtype=dtype, device=dev)
        self._sin = torch.zeros_like(self._cos)  # sin with the first half negated (see rope())
        self._eos = None

    def _start_call(self, *, temperature: float, eos: torch.Tensor) -> int:
        """Set up a call on the allocated cache: the EOS ids, the RoPE tables, every slot a spare
        (finished, slot 0, so its attention row is never empty; flat logits); returns the spare output row."""
        self._set_eos(eos)
        half = self.head_dim // 2
        for t, key in enumerate(self.rope_keys):  # the same tables as HF's forward
            extra = () if key is None else (key,)
            cos, sin = self.inner.rotary_emb(self._cos[t][None], self._slots[None], *extra)
            self._cos[t].copy_(cos[0])
            self._sin[t].copy_(torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1))  # rotate_half's sign
        spare = self._out_tok.shape[0] - 1
        for buf in (self._pad, self._pos, self._wpos, self._ncol):
            buf.zero_()
        self._row_of.fill_(spare)
        self._finished.fill_(True)
        self._scaled.zero_()
        self._lse.zero_()
        self._temp.fill_(temperature if temperature > 0 else 1.0)
        return spare

    def _seed_rows(self, rows: list[int], seeds: list[int], counts: list[int]) -> None:
        """Output rows ``rows`` get their uniforms: ``counts[i]`` (the row's most new tokens) from a
        generator seeded with ``seeds[i]`` (:func:`~spmd_rl.rollout.sampling.row_uniforms`), one copy."""
        if rows:
            u = row_uniforms(seeds, counts)
            self._out_u[torch.tensor(rows, device=self.device), :u.shape[1]] = u.to(self.device)

    def _clear_outputs(self, rows: torch.Tensor) -> None:
        """Empty the output rows ``rows`` (before rows start writing there)."""
        self._out_tok[rows] = self.pad_token_id
        self._out_lp[rows] = 0.0
        self._out_mask[rows] = 0.0
        if self.record_routes:
            self._out_route[rows] = -1

    def _fill(self, slots: list[int], queue: list[int], rows: list[list[int]], limits: list[int]) -> int:
        """Prefill the next queued rows into the cache rows ``slots`` (as many as both have), in groups of
        at most ``prefill_tokens`` tokens, each group left-padded to its longest prompt; returns the
        highest slot a filled row writes next."""
        taken = [queue.pop() for _ in range(min(len(slots), len(queue)))]
        dev, top, start = self.device, 0, 0
        while start < len(taken):
            longest = max(len(rows[r]) for r in taken[start:start + 1])
            group = taken[start:start + max(1, self.prefill_tokens // longest)]
            longest = max(len(rows[r]) for r in group)
            ids = torch.full((len(group), longest), self.pad_token_id, dtype=torch.long)
            for i, r in enumerate(group):
                ids[i, longest - len(rows[r]):] = torch.tensor(rows[r], dtype=torch.long)
            pad = torch.tensor([longest - len(rows[r]) for r in group], dtype=torch.long, device=dev)
            dest = torch.tensor(slots[start:start + len(group)], dtype=torch.long, device=dev)
            self._prefill(ids.to(dev), pad, dest)
            self._pad[dest] = pad
            self._pos[dest] = longest - pad
            self._wpos[dest] = longest
            self._ncol[dest] = 0
            self._limit[dest] = torch.tensor([limits[r] for r in group], dtype=torch.long, device=dev)
            self._row_of[dest] = torch.tensor(group, dtype=torch.long, device=dev)
            self._finished[dest] = False
            top, start = max(top, longest), start + len(group)
        return top

    def _set_eos(self, eos: torch.Tensor) -> None:
        """The EOS ids the captured steps compare against (a buffer of its own; a new count recaptures)."""
        if self._eos is not None and self._eos.shape == eos.shape:
            self._eos.copy_(eos)
            return
        for graph in self._graphs.values():
            graph.reset()
        self._graphs = {}
        self._eos = eos.to(self.device, copy=True)

    def _move_rows(self, rows: torch.Tensor) -> None:
        """Cache rows ``rows`` (their K/V, logits and counters) to rows ``0..len(rows)-1``, in that order."""
        n = rows.numel()
        for cache in (self.cache, self.ring):
            for i in range(cache.shape[0]):  # one layer at a time: the gather copy stays small
                cache[i, :, :n] = cache[i][:, rows]
        for buf in (self._tok, self._pos, self._pad, self._wpos, self._ncol, self._limit, self._row_of, self._scaled,
                    self._lse):
            buf[:n] = buf[rows]

    def _compact(self, cur: int, *, spare: int) -> int:
        """Move the live cache rows (and their logits and counters) to the front, order kept; shrink to their
        bucket. Rows past the live ones become spares: finished, writing to the spare output row."""
        keep = torch.nonzero(~self._finished[:cur]).squeeze(-1)
        n, new = keep.numel(), self.bucket(keep.numel())
        self._move_rows(keep)
        self._row_of[n:new] = spare
        self._finished[:new] = torch.arange(new, device=self.device) >= n
        self.compactions += 1
        return new




class SlotStream:
    """The output rows (handles) of one fast-path stream over a decoder's slots: free, queued for a
    slot, or live, with each one's key, prompt and limit; what
    :func:`~spmd_rl.rollout.stream.stream_decode` pulls from the feed and hands back. It works the
    slot state of this module's :class:`SlotCache`, which the decoder is."""

    def __init__(self, fast: SlotCache, *, feed: Callable[[int], list[tuple[Hashable, list[int], int]]],
                 finish: Callable[[Hashable, torch.Tensor, torch.Tensor, bool], None], max_new_tokens: int,
                 slots: int, eos: torch.Tensor, seed: int, keep_prefixes: bool = False) -> None:
        self.fast, self.feed, self.finish, self.max_new_tokens, self.eos = fast, feed, finish, max_new_tokens, eos
        self.seed, self.sampled = seed, True  # each row's uniforms: row_seed(seed, its key, its prompt's length)
        # finished rows parked by key, and rows that extend them resumed (spmd_rl.rollout.prefixes)
        self.keep = keep_prefixes and getattr(fast, "can_park", False)
        self.cap = fast.buckets[-1]
        handles = 2 * self.cap  # output rows: a finished row's is free once finish() copied it
        fast._ensure_cache(self.cap, slots, handles)
        self.keys: list[Any] = [None] * handles
        self.prompts: list[list[int]] = [[] for _ in range(handles)]
        self.limits = [1] * handles
        self.free = list(range(handles))[::-1]
        self.queue: list[int] = []  # handles waiting for a slot, popped from the end

    def start(self, *, temperature: float) -> int:
        """The stream's call starts: its spare slot (where finished slots point)."""
        self.sampled = temperature > 0  # greedy rows need no uniforms
        return self.fast._start_call(temperature=temperature, eos=self.eos)

    def compact(self, cur: int, *, spare: int) -> int:
        """The live rows moved to the front of the ``cur`` slots; the smaller bucket that holds them."""
        return self.fast._compact(cur, spare=spare)

    def pull(self, k: int) -> None:
        """Up to ``k`` new rows from the feed (as many as there are free handles), queued for a slot."""
        new = self.feed(min(k, len(self.free)))
        taken = [self.free.pop() for _ in new]
        for h, (key, ids, limit) in zip(taken, new):
            if not 1 <= limit <= self.max_new_tokens:
                raise ValueError(f"stream: a row's limit {limit} is outside [1, {self.max_new_tokens}]")
            self.keys[h], self.prompts[h], self.limits[h] = key, ids, limit
        if taken:
            self.fast._clear_outputs(torch.tensor(taken, device=self.fast.device))
            if self.sampled:
                self.fast._seed_rows(taken, [row_seed(self.seed, key, len(ids)) for key, ids, _ in new],
                                     [limit for *_, limit in new])
            self.queue[:0] = taken[::-1]

    def fill(self, free_slots: list[int]) -> int:
        """Queued rows prefilled into ``free_slots`` (as many as both have, the queue's first); returns
        the highest write slot. Keeping prefixes, a row that extends its parked prefix goes back to its
        slot and prefills only its new tokens; the others take empty slots first."""
        if not self.keep:
            return self.fast._fill(free_slots, self.queue, self.prompts, self.limits)
        fast, free = self.fast, set(free_slots)
        taken = [self.queue.pop() for _ in range(min(len(free_slots), len(self.queue)))]
        resumed, fresh = [], []
        for h in taken:
            r = fast.resumable(self.keys[h], h, self.prompts[h], free)
            if r is None:
                fresh.append(h)
            else:
                resumed.append(r)
                free.discard(r.parked.slot)
        top = fast._extend(resumed, self.limits) if resumed else 0
        if fresh:
            slots = fast.slot_order([s for s in free_slots if s in free])
            top = max(top, fast._fill(slots, fresh[::-1], self.prompts, self.limits))
        return top

    def _outputs(self, handles: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The tokens and log-probs so far of the rows in ``handles``, on the host."""
        fast = self.fast
        idx = torch.tensor(handles, device=fast.device)
        tok, lp, mask = (t[idx].cpu() for t in (fast._out_tok, fast._out_lp, fast._out_mask))
        lengths = [int(mask[i].sum()) for i in range(len(handles))]
        return [(tok[i, :n].clone(), lp[i, :n].clone()) for i, n in enumerate(lengths)]

    def harvest(self, handles: list[int], slots: list[tuple[int, int, int]] | None = None) -> None:
        """Finished rows to ``finish``; their handles become free. ``slots``: each row's ``(slot, pad,
        write slot)``, to park it (keeping prefixes): its K/V holds its prompt and all its tokens but the
        last."""
        eos_ids = set(self.eos.tolist())
        for i, (h, (tokens, logprobs)) in enumerate(zip(handles, self._outputs(handles))):
            if slots is not None and len(tokens):
                slot, pad, wpos = slots[i]
                ids = self.prompts[h] + tokens[:-1].tolist()
                assert wpos - pad == len(ids), (wpos, pad, len(ids))  # a row's K/V: its prompt, its tokens but the last
                self.fast.park(self.keys[h], slot, pad, ids)
            self.finish(self.keys[h], tokens, logprobs, len(tokens) == 0 or int(tokens[-1]) not in eos_ids)
            self.keys[h] = None
        self.free.extend(handles)

    def check(self, cur: int, spare: int) -> tuple[list[int], list[int], int]:
        """One host sync: which of the ``cur`` slots finished, whose rows they hold, the highest write
        slot. The rows that ended since the last check are harvested and their slots point at ``spare``."""
        fast = self.fast
        parts = [fast._finished[:cur].long(), fast._row_of[:cur], fast._wpos[:cur].max()[None]]
        if self.keep:  # where a finished row's K/V lies, to park it: in the same read
            parts += [fast._pad[:cur], fast._wpos[:cur]]
        state = torch.cat(parts).tolist()
        finished, row_of, top = state[:cur], state[cur:2 * cur], state[2 * cur]
        ended = [s for s in range(cur) if finished[s] and row_of[s] != spare]
        if ended:
            where = None
            if self.keep:
                pads, ends = state[2 * cur + 1:3 * cur + 1], state[3 * cur + 1:]
                where = [(s, pads[s], ends[s]) for s in ended]
            self.harvest([row_of[s] for s in ended], where)
            fast._row_of[torch.tensor(ended, device=fast.device)] = spare
        return finished, row_of, top

    def wanted(self, n_live: int) -> int:
        """Slots the ``n_live`` live rows, the queued ones and the parked prefixes they do not resume
        need: a queued row takes an empty slot before a parked one, so the bucket grows for it."""
        held = 0
        if self.keep and self.fast.parked:
            resumed = {self.keys[h] for h in self.queue} & self.fast.parked.keys()
            held = len(self.fast.parked) - len(resumed)
        return n_live + len(self.queue) + held

    def grow(self, cur: int, n_live: int, finished: list[int], spare: int) -> int:
        """Rows came after a compaction: the bucket that holds them and the parked prefixes
        (:meth:`wanted`); its new slots start finished (appended to ``finished``) and pointing at
        ``spare``. Returns the new bucket."""
        fast = self.fast
        grown = fast.bucket(min(self.cap, self.wanted(n_live)))
        fast._finished[cur:grown] = True
        fast._row_of[cur:grown] = spare
        finished += [1] * (grown - cur)
        return grown

    def unfinished(self, live: list[int]) -> list[tuple[Hashable, torch.Tensor, torch.Tensor]]:
        """``(key, tokens so far, logprobs)`` of the ``live`` handles, then of the queued ones (none)."""
        out = [(self.keys[h], *row) for h, row in zip(live, self._outputs(live))] if live else []
        return out + [(self.keys[h], torch.zeros(0, dtype=torch.long), torch.zeros(0)) for h in self.queue[::-1]]


__all__ = ["SlotCache", "SlotStream", "free_bytes", "size"]
