"""The fast decoder's step, mixed into :class:`~spmd_rl.rollout.fast.FastDecoder` (as
:mod:`spmd_rl.rollout.weights` is into the rollout engine): what one decode step computes, sampling
included, and its CUDA graph per (batch bucket, span, sampling setting).

    fast.decode_slots(cur, span, mode)               # one step of the first ``cur`` slots
    fast.capture_graphs(temperature=1.0, top_k=0, top_p=1.0)   # (fast.py) every bucket and span, ahead

A step (:meth:`DecodeStep._step_body`) first SAMPLES from the logits the previous step left in a static
buffer and records the token, its log-prob and the live mask at each live row's output column, then
runs the decode FORWARD of that token (:meth:`DecodeStep._forward`) into the logits buffer the next
step samples from; the module docstring of :mod:`spmd_rl.rollout.fast` describes both in full. Nothing
in a step syncs with the host or draws a random number, so on CUDA the whole of it replays as one
graph: a sampled row reads its uniform from its output cell, where its own uniforms were written when it
was fed (:func:`~spmd_rl.rollout.sampling.row_uniforms`).

It reads the decoder's buffers (``_tok``, ``_pos``, ``_wpos``, ``_ncol``, ``_finished``, ``_limit``,
``_scaled``, ``_lse``, the output buffers and their uniforms ``_out_u``, the caches) and calls its
layer pieces (``_in``, ``_out``, ``_head``, ``_kv``, ``_biases``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_attention import decode_attention, varlen_attn
from .sampling import filter_logits, inverse_cdf


class DecodeStep:
    """One decode step, eager or graph-captured (module docstring)."""

    def _forward(self, rows: int, span: int) -> None:
        """The decode forward of ``_tok`` for cache rows ``0..rows-1``, attending over slots ``0..span-1``
        (``span`` > every row's write slot); advances the live rows' positions and write slots."""
        pos, wpos = self._pos[:rows], self._wpos[:rows]
        x = self.inner.embed_tokens(self._tok[:rows])
        # Additive masks [rows, 1, 1, span or ring size], built once per step, broadcast over KV heads and
        # query groups. Ring entry j holds the latest slot s <= the row's write slot with s % R == j; it counts
        # when that slot is one of the row's (not left padding) and fewer than the layer's window back.
        bias = {}
        if self.attention == "sdpa":  # the full-length layers' mask: the row's slots from past its padding to its write slot
            slots = self._slots[:span]
            valid = (slots[None, :] >= self._pad[:rows, None]) & (slots[None, :] <= wpos[:, None])
            bias[None] = self._biases(valid, {None: None}, x.dtype)[None][:, None, None, :]
        if self.window is not None:
            ring = self.ring.shape[4]
            seen = min(span, ring)  # span <= R: every written slot s < span sits at ring index s
            held = wpos[:, None] - (wpos[:, None] - self._slots[None, :seen]) % ring  # [rows, seen]
            live = (held >= self._pad[:rows, None]) & (held >= 0)
            near = {w: held > wpos[:, None] - w for w in set(self.windows) if w}
            bias.update({w: m[:, None, None, :] for w, m in self._biases(live, near, x.dtype).items()})
            ring_at = wpos % ring
        tables = [(self._cos[t][pos][:, None], self._sin[t][pos][:, None]) for t in range(len(self.rope_keys))]
        rows_at = self._ar[:rows]
        entry = rows_at * self.cache.shape[3] + wpos  # each row's write slot in a layer's [rows * slots] cache
        if self.attention != "sdpa":  # each row's keys: its slots pad..wpos; a finished row's: wpos alone
            first = torch.where(self._finished[:rows], wpos, self._pad[:rows])
            used = (wpos - first + 1).int()
        if self.attention == "varlen":  # in the flattened [rows * slots] cache
            starts = self._ar[:rows + 1] * self.cache.shape[3]
            starts[:rows] += first
            starts, queries = starts.int(), self._ar[:rows + 1].int()  # one query per row
        elif self.attention == "triton":
            first, end = first.int(), (wpos + 1).int()

        def record(i: int) -> torch.Tensor | None:  # MoE layer i's rows of the step's routes
            j = self._moe_of.get(i)
            return None if j is None or not self.record_routes else self._route_step[j, :rows]
        for i in range(len(self.layers)):
            cos, sin = tables[self.rope_of[i]]  # [rows, 1, D]
            kv = self._kv(i)
            if self._kv_of[i][0]:  # the ring: [rows, kv_heads, R, head_dim]
                qk, v = self._in(i, x, cos, sin, self._step_in)
                q, k_cache, v_cache = qk[:, :self.heads], kv[0, :rows], kv[1, :rows]
                k_cache[rows_at, :, ring_at] = qk[:, self.heads:]  # each row writes its own slot: [rows, Hkv, D]
                v_cache[rows_at, :, ring_at] = v
                k_cache, v_cache = k_cache[:, :, :seen], v_cache[:, :, :seen]
            else:  # [rows, slots, kv_heads, head_dim]; each row's K/V written at its own slot
                q = self._in(i, x, cos, sin, self._step_store, kv.flatten(1, 2), entry)
                k_cache, v_cache = kv[0, :rows], kv[1, :rows]
                if self.attention != "sdpa":
                    if self.attention == "varlen":
                        o = varlen_attn(q.contiguous(), k_cache.flatten(0, 1), v_cache.flatten(0, 1),
                                        queries, starts, 1, span, scale=self.scaling, enable_gqa=True, seqused_k=used)
                    else:
                        o = decode_attention(q, k_cache, v_cache, first, end, scale=self.scaling, span=span)
                    x = self._out(i, x, o.reshape(rows, self.heads * self.head_dim), self._step_out, record(i))
                    continue
                k_cache, v_cache = k_cache[:, :span].transpose(1, 2), v_cache[:, :span].transpose(1, 2)
            q = q.unflatten(1, (self.kv_heads, self.group))  # query heads of one KV head together
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=bias[self.windows[i]], scale=self.scaling)
            x = self._out(i, x, o.reshape(rows, self.heads * self.head_dim), self._step_out, record(i))
        self._head(x, rows)
        if self.record_routes:  # each row's token's experts, at the output cell its sample was written to
            self._out_route.index_put_((self._rec_row[:rows], self._rec_col[:rows]),
                                       self._route_step[:, :rows].transpose(0, 1))
        live = (~self._finished[:rows]).long()  # finished rows keep their slot: writes stay inside the cache
        pos += live
        wpos += live

    # ------------------------------------------------------------------ sampling

    def _pick(self, scaled: torch.Tensor, lse: torch.Tensor, u: torch.Tensor | None, *, top_k: int,
              top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[b]`` from ``scaled = logits / T [b, V]``: argmax when ``u`` is None, else the first token
        whose cumulative (top-k / top-p filtered) probability exceeds ``u [b]`` of the total; and their
        log-probs ``scaled[tok] - lse`` (before filtering). No host sync, no RNG: graph-capturable."""
        if u is None:
            tokens = torch.argmax(scaled, dim=-1)
        else:
            filtered = top_k > 0 or top_p < 1.0
            z = filter_logits(scaled, top_k=top_k, top_p=top_p) if filtered else scaled
            tokens = inverse_cdf(z, torch.logsumexp(z, -1) if filtered else lse, u)
        return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse

    def _record(self, rows: int, *, greedy: bool, top_k: int, top_p: float) -> None:
        """Sample rows ``0..rows-1`` from the logits buffer and write token, log-prob and live mask at each
        live row's output column; finished rows write nothing. A row finishes at an EOS id or at its
        ``_limit``-th token. The sampled tokens feed the next forward."""
        finished, ncol = self._finished[:rows], self._ncol[:rows]
        live = ~finished
        # finished rows and spares write to the spare output row, whose contents are dropped
        where = (torch.where(live, self._row_of[:rows], self._out_tok.shape[0] - 1), ncol)
        u = None if greedy else self._out_u[where]  # each row's own uniform for this token
        tok, lp = self._pick(self._scaled[:rows], self._lse[:rows], u, top_k=top_k, top_p=top_p)
        if self.record_routes:  # where the forward of this token records its experts
            self._rec_row[:rows] = where[0]
            self._rec_col[:rows] = ncol
        self._out_tok.index_put_(where, torch.where(live, tok, self.pad_token_id))
        self._out_lp.index_put_(where, torch.where(live, lp, 0.0))
        self._out_mask.index_put_(where, live.float())
        ncol += live.long()
        finished.logical_or_(torch.isin(tok, self._eos) | (ncol >= self._limit[:rows]))
        self._tok[:rows] = tok

    def _step_body(self, rows: int, span: int, mode: tuple[bool, int, float]) -> None:
        """One step: sample from the last logits, then the forward of the sampled tokens."""
        greedy, top_k, top_p = mode
        self._record(rows, greedy=greedy, top_k=top_k, top_p=top_p)
        self._forward(rows, span)

    def _step(self, rows: int, span: int, mode: tuple[bool, int, float]) -> None:
        if not self.use_graphs:
            self._step_body(rows, span, mode)
            return
        graph = self._graphs.get((rows, span, *mode))
        if graph is None:
            graph = self._capture(rows, span, mode)
        graph.replay()

    def _capture(self, rows: int, span: int, mode: tuple[bool, int, float]) -> torch.cuda.CUDAGraph:
        """Capture the step of ``rows`` rows over ``span`` slots. The warm-up really runs the step, so the
        state it changed is put back first (the K/V and outputs it wrote are those the replay writes again)."""
        state = [self._tok[:rows], self._pos[:rows], self._wpos[:rows], self._ncol[:rows], self._finished[:rows],
                 self._scaled[:rows], self._lse[:rows]]
        saved = [t.clone() for t in state]
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step_body(rows, span, mode)  # lazy library workspaces are set up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            for t, old in zip(state, saved):
                t.copy_(old)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (NCCL watchdog, pinned-memory copies) cannot spoil it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step_body(rows, span, mode)
        self._graphs[(rows, span, *mode)] = graph
        return graph

    @staticmethod
    def mode(*, temperature: float, top_k: int, top_p: float) -> tuple[bool, int, float]:
        """A sampling setting as the step's graphs key it: one graph per mode, bucket and span."""
        return (True, 0, 1.0) if temperature == 0 else (False, top_k, top_p)

    def decode_slots(self, cur: int, span: int, mode: tuple[bool, int, float]) -> None:
        """One decode step of the first ``cur`` slots (its replay, on CUDA)."""
        self._step(cur, span, mode)
        self.steps += 1


__all__ = ["DecodeStep"]
