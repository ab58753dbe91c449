"""Prefix reuse across a stream's turns: a finished row's K/V stays in its cache row (parked) until
another row needs that slot, and a row fed again under the same key whose tokens extend what is
parked is prefilled from there on, not from its first token (multi-turn episodes,
:mod:`spmd_rl.episodes.runner`).

    fast.stream(..., keep_prefixes=True)  # via NativeRollout.stream: finished rows are parked by key
    fast.reused_tokens                     # prompt tokens not prefilled again (a parked prefix's)
    fast.forget_prefixes(key)              # that key's episode ended: its slot is empty again
    fast.forget_prefixes()                 # new weights, or the end of a round: nothing is reused

What a parked slot holds: a row that finished wrote the K/V of its prompt and of every token it
sampled but the last (the last one is never fed back), from its padding on: the prompt + all tokens
but the last, ``wpos - pad`` of them. A row fed with its own cap (``(key, ids, most new tokens)``)
stops there, so what it parks is exactly what its caller keeps of it.

What is parked stays until one of these, and nothing else, drops it; so a caller that keeps at most
as many keys under way as the stream has slots (the episode runner, the agent endpoint) finds every
prefix it did not drop itself, whatever the timing:

* :meth:`PrefixCache.forget_prefixes`: the caller says the key will not be fed again (its episode
  ended), or drops everything (new weights, the end of a round); :meth:`release` (sleep) too;
* the key is fed again with ids that do not extend the parked ones: prefilled whole, in an empty slot;
* memory is needed: a new row takes an empty slot of the largest batch bucket first (the bucket grows
  for it, counting parked rows as taken), and only when every slot there is live or parked the
  longest-parked one (least recently parked first); a ``generate`` call's rows take slots in order.

It survives the end of a stream call and the next call (its counters are restored at the call's
start), a compaction (parked rows move with their K/V and stay inside the bucket) and a cache that
grows for longer rows (the parked rows' K/V is copied into the new cache).

The extension (:meth:`PrefixCache._extend`) runs the new tokens of each resumed row at the slots after
its parked prefix, attending to the prefix and causally to themselves (right-padded to the group's
longest; padding writes no K/V), and leaves the last token's logits for the first sample, exactly
where a prefill of the whole row would have left them. Models with sliding-window layers (their ring
cache keeps only the window) always prefill whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch
import torch.nn.functional as F

from .slots import SlotCache


@dataclass
class Parked:
    """A finished row's K/V left in cache row ``slot``: ``ids`` from slot ``pad`` on."""

    slot: int
    pad: int
    ids: list[int]


@dataclass
class Resumed:
    """A row fed again that extends its parked prefix: ``suffix`` goes after it, in the same slot."""

    key: Hashable
    handle: int
    parked: Parked
    suffix: list[int]


class PrefixCache(SlotCache):
    """The decoder's slot cache with parked prefixes (module docstring); the base of
    :class:`~spmd_rl.rollout.fast.FastDecoder`, which provides the layer functions ``_extend`` runs."""

    parked: dict[Hashable, Parked]
    reused_tokens: int

    def _init_prefixes(self) -> None:
        self.parked = {}  # key -> its parked prefix, oldest first
        self.reused_tokens = 0
        self._reused_by_key: dict[Hashable, int] = {}  # not taken yet (take_reused)

    def take_reused(self, key: Hashable) -> int:
        """The tokens ``key``'s rows did not prefill again since the last take (its parked prefixes)."""
        return self._reused_by_key.pop(key, 0)

    @property
    def can_park(self) -> bool:
        """Whether prefixes can be kept: not with sliding-window layers (their ring keeps only the window)."""
        return self.window is None

    def forget_prefixes(self, *keys: Hashable) -> None:
        """``keys`` will not be fed again (their episodes ended): their slots are empty, not parked. No
        keys: nothing parked is reused (new weights, or the caller's rows are done)."""
        if not keys:
            self.parked = {}
        for key in keys:
            self.parked.pop(key, None)

    def park(self, key: Hashable, slot: int, pad: int, ids: list[int]) -> None:
        """Keep ``key``'s finished row in ``slot`` (the newest parked)."""
        self._drop_slots({slot})
        self.parked.pop(key, None)
        self.parked[key] = Parked(slot, pad, ids)

    def resumable(self, key: Hashable, handle: int, ids: list[int], free: set[int]) -> Resumed | None:
        """Output row ``handle`` (``key``, ``ids``) resumed from its parked prefix when ``ids`` extends it
        by at least one token and its slot is in ``free``; else None, and a parked prefix that ``ids``
        does not extend is dropped."""
        p = self.parked.get(key)
        if p is None or p.slot not in free:
            return None
        if len(p.ids) < len(ids) and ids[:len(p.ids)] == p.ids:
            return Resumed(key, handle, p, ids[len(p.ids):])
        del self.parked[key]
        return None

    def slot_order(self, slots: list[int]) -> list[int]:
        """``slots`` as a new row should take them: empty ones first (in the order given), then parked
        ones, the longest-parked first."""
        age = {p.slot: i for i, p in enumerate(self.parked.values())}
        return sorted(slots, key=lambda s: age.get(s, -1))

    def _drop_slots(self, slots: set[int]) -> None:
        if slots and self.parked:
            self.parked = {k: p for k, p in self.parked.items() if p.slot not in slots}

    # ------------------------------------------------------------------ SlotCache's hooks
    def release(self) -> None:
        super().release()
        self.forget_prefixes()

    def _allocate(self, rows: int, slots: int, out_rows: int) -> None:
        super()._allocate(rows, slots, out_rows)
        self.forget_prefixes()

    def _ensure_cache(self, rows: int, slots: int, out_rows: int) -> None:
        """As :meth:`SlotCache._ensure_cache`; a cache that grows keeps what is parked: the parked rows'
        K/V (up to their longest prefix) are copied aside, then into the same slots of the new cache."""
        fits = self.cache is not None and all(a >= b for a, b in zip(self._shape, (rows, slots, out_rows)))
        if fits or self.cache is None or not self.parked:
            return super()._ensure_cache(rows, slots, out_rows)
        parked = dict(self.parked)
        at = torch.tensor([p.slot for p in parked.values()], device=self.device)
        end = max(p.pad + len(p.ids) for p in parked.values())
        kept = self.cache[:, :, at, :end].clone()  # a copy: the old cache is freed before the new one
        super()._ensure_cache(rows, slots, out_rows)  # a new cache, and nothing parked
        self.cache[:, :, at, :end] = kept
        self.parked = parked

    def _start_call(self, *, temperature: float, eos: torch.Tensor) -> int:
        """As :meth:`SlotCache._start_call`; a parked slot keeps writing (as a spare) past its prefix."""
        spare = super()._start_call(temperature=temperature, eos=eos)
        if self.parked:
            slot, pad, length = (torch.tensor(v, device=self.device) for v in zip(
                *[(p.slot, p.pad, p.pad + len(p.ids)) for p in self.parked.values()]))
            self._pad[slot], self._wpos[slot], self._pos[slot] = pad, length, length - pad
        return spare

    def _fill(self, slots: list[int], queue: list[int], rows: list[list[int]], limits: list[int]) -> int:
        self._drop_slots(set(slots[:len(queue)]))
        return super()._fill(slots, queue, rows, limits)

    def _compact(self, cur: int, *, spare: int) -> int:
        """As :meth:`SlotCache._compact`, but with prefixes parked the ``cur`` slots are permuted, not
        overwritten: the live rows first, then the parked ones (their K/V and counters move with them),
        then the rest; the bucket holds the live and the parked rows (a queued row can only take a slot
        inside it), so no compaction happens while they fill the current one."""
        if not self.parked:
            return super()._compact(cur, spare=spare)
        live = torch.nonzero(~self._finished[:cur]).squeeze(-1).tolist()
        taken, held = set(live), {p.slot for p in self.parked.values()}
        rest = [s for s in range(cur) if s not in taken]
        parked = [s for s in rest if s in held]
        n, new = len(live), self.bucket(len(live) + len(parked))  # parked rows stay inside the bucket
        if new >= cur:
            return cur
        order = live + parked + [s for s in rest if s not in held]
        self._move_rows(torch.tensor(order, device=self.device))  # a permutation of the cur rows
        at = {old: new for new, old in enumerate(order)}
        for p in self.parked.values():
            p.slot = at.get(p.slot, p.slot)  # a parked slot at or past cur stays where it is
        self._row_of[n:new] = spare
        self._finished[:cur] = torch.arange(cur, device=self.device) >= n
        self.compactions += 1
        return new

    # ------------------------------------------------------------------ the extension
    @torch.no_grad()
    def _extend(self, resumed: list[Resumed], limits: list[int]) -> int:
        """Prefill each resumed row's suffix after its parked prefix (module docstring), in groups of at
        most ``prefill_tokens`` tokens; returns the highest slot a resumed row writes next."""
        top, start = 0, 0
        resumed = sorted(resumed, key=lambda r: len(r.suffix))
        while start < len(resumed):
            size = max(1, self.prefill_tokens // len(resumed[start].suffix))
            group = resumed[start:start + size]
            while len(group) > 1 and len(group) * len(group[-1].suffix) > self.prefill_tokens:
                group.pop()
            top = max(top, self._extend_group(group, limits))
            start += len(group)
        for r in resumed:  # live again: no longer parked
            del self.parked[r.key]
            self.reused_tokens += len(r.parked.ids)
            self._reused_by_key[r.key] = self._reused_by_key.get(r.key, 0) + len(r.parked.ids)
        return top

    def _extend_group(self, group: list[Resumed], limits: list[int]) -> int:
        """One group's extension. Its indices are built on the host, where the lengths are known, and
        copied over at once: nothing in it reads the device back (no boolean-mask indexing, no
        ``.item()``), so the host queues every layer while the device runs the first ones."""
        dev, b = self.device, len(group)
        lens = [len(r.suffix) for r in group]
        pads = [r.parked.pad for r in group]
        firsts = [r.parked.pad + len(r.parked.ids) for r in group]  # each row's first new slot
        width, span = max(lens), max(f + n for f, n in zip(firsts, lens))
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, :lens[i]] = torch.tensor(r.suffix, dtype=torch.long)
        # the real tokens, flattened: their (row in the group, position in the suffix) and (cache row, slot)
        at_b = [i for i, n in enumerate(lens) for _ in range(n)]
        at_j = [j for n in lens for j in range(n)]
        at_slot = [f + j for f, n in zip(firsts, lens) for j in range(n)]
        host = torch.tensor([lens, pads, firsts, [r.parked.slot for r in group], [limits[r.handle] for r in group],
                             [r.handle for r in group]], dtype=torch.long)
        n, pad, first, dest, limit, handle = host.to(dev).unbind(0)
        at_b, at_j, at_slot = torch.tensor([at_b, at_j, at_slot], dtype=torch.long).to(dev).unbind(0)
        ids = ids.to(dev)
        write = (dest[at_b], at_slot)  # the real tokens' (cache row, slot)
        j = self._slots[:width]
        at = first[:, None] + j[None]  # each query's slot [b, width]
        keys = self._slots[:span]
        allowed = (keys[None, None] >= pad[:, None, None]) & (keys[None, None] <= at[:, :, None])  # [b, width, span]
        x = self.inner.embed_tokens(ids)
        bias = torch.zeros(allowed.shape, dtype=x.dtype, device=dev).masked_fill_(~allowed, float("-inf"))[:, None]
        pos = (at - pad[:, None]).clamp(max=self._slots.numel() - 1)
        tables = [(self._cos[t][pos][:, :, None], self._sin[t][pos][:, :, None]) for t in range(len(self.rope_keys))]
        for i in range(len(self.layers)):
            cos, sin = tables[self.rope_of[i]]
            qk, v = self._in(i, x, cos, sin, self.attn_in)  # [b, width, H + Hkv, D], [b, width, Hkv, D]
            q, k = qk[:, :, :self.heads], qk[:, :, self.heads:]
            kv = self._kv(i)
            kv[0][write] = k[at_b, at_j]
            kv[1][write] = v[at_b, at_j]
            k, v = kv[0][dest, :span].transpose(1, 2), kv[1][dest, :span].transpose(1, 2)  # [b, Hkv, span, D]
            if self.group > 1:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=bias, scale=self.scaling)
            x = self._out(i, x, o.transpose(1, 2).reshape(b, width, self.heads * self.head_dim), self.attn_out)
        scaled = self._logits(x[torch.arange(b, device=dev), n - 1]).float().div_(self._temp)
        self._scaled[dest] = scaled
        self._lse[dest] = torch.logsumexp(scaled, dim=-1)
        self._pad[dest], self._wpos[dest], self._pos[dest], self._ncol[dest] = pad, first + n, first + n - pad, 0
        self._limit[dest] = limit
        self._row_of[dest] = handle
        self._finished[dest] = False
        return span


__all__ = ["Parked", "PrefixCache", "Resumed"]
