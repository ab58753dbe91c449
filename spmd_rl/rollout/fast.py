"""Fast decode for Llama / Qwen2 / Mistral-shaped models: static KV cache, graph-captured step, compaction.

    fast = FastDecoder(hf_model, device=device, max_batch=64, pad_token_id=0)    # see unsupported_reason()
    tokens, mask, logprobs, truncated = fast.generate_chunk(rows, temperature=1.0, top_k=0, top_p=1.0,
                                                            max_new_tokens=256, generator=gen, eos=eos_ids)
    fast.release()   # frees the KV cache and the CUDA graphs (rollout sleep); fast.restore() reallocates

:class:`~spmd_rl.rollout.native.NativeRollout` uses this automatically when the model qualifies and
falls back to its Hugging Face loop otherwise. The decoder owns no weights: every forward reads the
HF modules' parameters (embedding, q/k/v/o projections, norms, MLP, ``lm_head``), so ``load_weights``
(in-place copies) keeps working and the norm / MLP / projection math is HF's own.

How a chunk of ``b`` left-padded rows runs:

* the KV cache is ONE tensor ``[layers, 2, rows, kv_heads, slots, head_dim]``, allocated for the
  largest batch bucket used so far and ``slots = longest prompt + max_new_tokens`` rounded up to 64
  (both grow only); sleep frees it. Slot ``s`` holds position ``s - pad`` of a row that has ``pad``
  left-padding slots, so every row writes the same slot at each step;
* prefill: the prompts go through in row groups of at most ``prefill_tokens`` tokens, causal +
  padding mask (a padding query also sees itself, so no softmax row is empty), K/V written to slots
  ``0..P-1``; only the last position's logits are computed;
* decode: one step = embed, per layer RMSNorm / q,k,v / RoPE (a table gathered by each row's
  position) / write slot / SDPA over all slots with the row's valid-slot mask (query heads are grouped
  by their KV head, so GQA needs no K/V copy) / o_proj / MLP, then norm, ``lm_head``, ``/ T`` and
  ``logsumexp``; the step also advances the position and slot counters, so on CUDA the whole step is
  one CUDA graph per batch bucket (powers of two below ``max_batch``, and ``max_batch``);
* sampling on device after each step (outside the graph, so the caller's ``torch.Generator`` drives
  it): greedy argmax, or the exponential race ``argmax(z - log E)`` over the top-k / top-p filtered
  ``z = logits / T`` (the same distribution as ``sample_next``); the log-prob is ``z[tok] - lse``,
  i.e. ``log_softmax(logits / T)`` before filtering, float32;
* every ``check_every`` steps (1 on CPU, 4 on CUDA: it costs a host sync) the live rows are counted:
  all finished ends the chunk; if they fit a smaller bucket, the live rows' K/V and counters move to
  the front (order kept) and the smaller bucket's graph runs from then on. Slots past the live rows
  write their outputs to a spare row that is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .sampling import filter_logits

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# RoPE types whose cos/sin depend on the position only (dynamic / longrope rescale with the length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# SDPA kernels the path may use: masked attention runs the memory-efficient kernel on CUDA (flash takes
# no mask) and the fused CPU kernel on CPU; a known, graph-capturable choice on every torch version.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot run ``model`` (a HF causal LM), or ``None`` when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        return "the model has no lm_head Linear"
    rope_type = getattr(inner.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} is not one of {STATIC_ROPE_TYPES}"
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
            if not hasattr(attn, name):
                return f"layer {i} attention has no {name}"
        for name in ("q_norm", "k_norm"):
            if hasattr(attn, name):
                return f"layer {i} attention has {name} (not a Llama / Qwen2 / Mistral attention)"
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                return f"layer {i} has no {name}"
        for name in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(getattr(layer, name), "variance_epsilon"):
                return f"layer {i} {name} is not an RMSNorm with variance_epsilon"
    if not hasattr(inner.norm, "variance_epsilon"):
        return "model.norm is not an RMSNorm with variance_epsilon"
    return None


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two below ``max_batch``, then ``max_batch``."""
    buckets = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return buckets + [max_batch]


class FastDecoder:
    """Static-cache, graph-captured decoding over a HF Llama / Qwen2 / Mistral model (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, max_batch: int, pad_token_id: int,
                 prefill_tokens: int = 16384) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastDecoder: {reason}")
        config = model.config
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.device = torch.device(device)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.group = self.heads // self.kv_heads
        self.head_dim = int(self.layers[0].self_attn.head_dim)
        self.scaling = float(self.layers[0].self_attn.scaling)
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in self.layers]
        if config.model_type == "mistral":
            windows.append(getattr(config, "sliding_window", None))
        windows = [w for w in windows if w]
        self.sliding_window: int | None = min(windows) if windows else None
        self.buckets = batch_buckets(max_batch)
        self.pad_token_id = int(pad_token_id)
        self.prefill_tokens = prefill_tokens
        self.use_graphs = self.device.type == "cuda"
        self.check_every = 4 if self.use_graphs else 1
        self.cache: torch.Tensor | None = None
        self._shape: tuple[int, int] | None = None  # (rows, slots) of the last cache, for restore()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self.compactions = 0  # how many times live rows moved to a smaller bucket (tests read it)

    # ------------------------------------------------------------------ memory

    def call_unsupported(self, total_length: int) -> str | None:
        """Why one call of ``prompt + new tokens = total_length`` cannot use this path, or ``None``."""
        if self.sliding_window is not None and total_length > self.sliding_window:
            return (f"the sequence length {total_length} exceeds the model's sliding window "
                    f"({self.sliding_window}), which this path does not implement")
        return None

    def release(self) -> None:
        """Free the KV cache, the step's buffers and the CUDA graphs (their memory pool)."""
        for graph, _, _ in self._graphs.values():
            graph.reset()
        self._graphs, self._pool, self.cache = {}, None, None
        self._tok = self._pos = self._pad = self._slot = self._temp = self._slots = self._cos = self._sin = None

    def restore(self) -> None:
        """Reallocate the cache of the last shape (after :meth:`release`); graphs are recaptured on use."""
        if self.cache is None and self._shape is not None:
            self._allocate(*self._shape)

    def _ensure_cache(self, rows: int, slots: int) -> None:
        if self.cache is not None and self.cache.shape[2] >= rows and self.cache.shape[4] >= slots:
            return
        if self.cache is not None:
            rows, slots = max(rows, self.cache.shape[2]), max(slots, self.cache.shape[4])
        self.release()
        self._allocate(rows, -(-slots // 64) * 64)

    def _allocate(self, rows: int, slots: int) -> None:
        dtype, dev = self.inner.embed_tokens.weight.dtype, self.device
        self.cache = torch.zeros(len(self.layers), 2, rows, self.kv_heads, slots, self.head_dim, dtype=dtype,
                                 device=dev)
        self._shape = (rows, slots)
        self._tok = torch.zeros(rows, dtype=torch.long, device=dev)   # the token each row feeds this step
        self._pos = torch.zeros(rows, dtype=torch.long, device=dev)   # its position
        self._pad = torch.zeros(rows, dtype=torch.long, device=dev)   # left-padding slots of each row
        self._slot = torch.zeros(1, dtype=torch.long, device=dev)     # the slot this step writes
        self._temp = torch.ones(1, dtype=torch.float32, device=dev)   # logits are divided by it
        self._slots = torch.arange(slots, device=dev)
        self._cos = torch.zeros(slots, self.head_dim, dtype=dtype, device=dev)  # RoPE table by position
        self._sin = torch.zeros_like(self._cos)  # sin with the first half negated (see _rope)

    # ------------------------------------------------------------------ forward pieces

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """HF's ``x * cos + rotate_half(x) * sin`` in three kernels: ``rotate_half(x) = roll(x) * [-1, 1]``."""
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), signed_sin)

    @staticmethod
    def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm (float32 statistics, cast back, times the weight) with the fused ``F.rms_norm``."""
        return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)

    def _head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm and ``lm_head`` of ``x [b, h]`` -> ``logits / T`` (float32 ``[b, V]``) and its logsumexp."""
        scaled = self.model.lm_head(self._rms(self.inner.norm, x)).float() / self._temp
        return scaled, torch.logsumexp(scaled, dim=-1)

    def _prefill(self, ids: torch.Tensor, pad: torch.Tensor, row0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts ``ids [b, P]`` (left-padded by ``pad [b]``) into cache rows ``row0..row0+b``, slots ``0..P-1``."""
        b, length = ids.shape
        ar = self._slots[:length]
        pos = (ar[None, :] - pad[:, None]).clamp(min=0)
        allowed = (ar[:, None] >= ar[None, :])[None] & (ar[None, :] >= pad[:, None])[:, None, :]
        allowed = (allowed | torch.eye(length, dtype=torch.bool, device=ids.device))[:, None]  # [b, 1, P, P]
        x = self.inner.embed_tokens(ids)
        bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed, float("-inf"))
        cos, sin = self._cos[pos][:, None], self._sin[pos][:, None]  # [b, 1, P, D]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = self._rms(layer.input_layernorm, x)
            q = attn.q_proj(h).view(b, length, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.cache[i, 0, row0:row0 + b, :, :length] = k
            self.cache[i, 1, row0:row0 + b, :, :length] = v
            if self.group > 1:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scaling)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, length, self.heads * self.head_dim))
            x = x + layer.mlp(self._rms(layer.post_attention_layernorm, x))
        return self._head(x[:, -1])

    def _decode(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for cache rows ``0..rows-1``; advances the position and slot counters."""
        pos = self._pos[:rows]
        valid = (self._slots[None, :] >= self._pad[:rows, None]) & (self._slots[None, :] <= self._slot)
        x = self.inner.embed_tokens(self._tok[:rows])
        # Additive mask [rows, 1, 1, slots], built once per step, broadcast over KV heads and query groups.
        bias = torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_fill_(~valid, float("-inf"))
        bias = bias[:, None, None, :]
        cos, sin = self._cos[pos][:, None], self._sin[pos][:, None]  # [rows, 1, D]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = self._rms(layer.input_layernorm, x)
            q = self._rope(attn.q_proj(h).view(rows, self.heads, self.head_dim), cos, sin)
            k = self._rope(attn.k_proj(h).view(rows, self.kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(h).view(rows, self.kv_heads, self.head_dim)
            k_cache, v_cache = self.cache[i, 0, :rows], self.cache[i, 1, :rows]
            k_cache.index_copy_(2, self._slot, k[:, :, None])
            v_cache.index_copy_(2, self._slot, v[:, :, None])
            q = q.view(rows, self.kv_heads, self.group, self.head_dim)  # query heads of one KV head together
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=bias, scale=self.scaling)
            x = x + attn.o_proj(o.reshape(rows, self.heads * self.head_dim))
            x = x + layer.mlp(self._rms(layer.post_attention_layernorm, x))
        out = self._head(x)
        self._pos[:rows] += 1
        self._slot += 1
        return out

    def _step(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_graphs:
            return self._decode(rows)
        entry = self._graphs.get(rows)
        if entry is None:
            entry = self._capture(rows)
        entry[0].replay()
        return entry[1], entry[2]

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Capture the decode step of ``rows`` rows. The warm-up really runs the step (writing the same
        K/V the replay will write), so the counters it advanced are put back."""
        pos, slot = self._pos.clone(), self._slot.clone()
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode(rows)  # lazy library workspaces are set up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self._pos.copy_(pos)
            self._slot.copy_(slot)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (NCCL watchdog, pinned-memory copies) cannot spoil it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                scaled, lse = self._decode(rows)
        self._graphs[rows] = (graph, scaled, lse)
        return self._graphs[rows]

    # ------------------------------------------------------------------ generation

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _sample(self, scaled: torch.Tensor, lse: torch.Tensor, *, greedy: bool, top_k: int, top_p: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if greedy:
            tokens = torch.argmax(scaled, dim=-1)
        else:
            z = filter_logits(scaled, top_k=top_k, top_p=top_p) if (top_k > 0 or top_p < 1.0) else scaled
            race = torch.empty_like(z).exponential_(generator=generator)
            race.clamp_(min=torch.finfo(race.dtype).tiny).log_()  # an exact 0 would give -log 0 = inf
            tokens = torch.argmax(z - race, dim=-1)
        return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse

    def generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, eos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``NativeRollout._generate_chunk_hf``: ``tokens, mask, logprobs [b, t]`` and ``truncated [b]``."""
        with sdpa_kernel(ATTENTION_BACKENDS):
            return self._generate_chunk(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                        max_new_tokens=max_new_tokens, generator=generator, eos=eos)

    def _generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, eos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, longest, dev = len(rows), max(len(r) for r in rows), self.device
        if b > self.buckets[-1]:
            raise ValueError(f"FastDecoder: {b} rows exceed rollout.batch_size ({self.buckets[-1]})")
        cur = self.bucket(b)
        self._ensure_cache(cur, longest + max_new_tokens)
        cos, sin = self.inner.rotary_emb(self._cos[None], self._slots[None])  # same table as HF's forward
        half = self.head_dim // 2
        self._cos.copy_(cos[0])
        self._sin.copy_(torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1))  # rotate_half's sign folded in

        ids = torch.full((b, longest), self.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, longest - len(r):] = torch.tensor(r, dtype=torch.long)
        pad = torch.tensor([longest - len(r) for r in rows], dtype=torch.long)
        ids, pad = ids.to(dev), pad.to(dev)
        self._pad[:cur].zero_()
        self._pad[:b] = pad
        self._pos[:cur].zero_()  # spare rows: positions stay small, inside the RoPE table
        self._pos[:b] = longest - pad
        self._slot.fill_(longest)
        self._temp.fill_(temperature if temperature > 0 else 1.0)

        group = max(1, self.prefill_tokens // longest)
        parts = [self._prefill(ids[s:s + group], pad[s:s + group], s) for s in range(0, b, group)]
        scaled, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        if cur > b:  # spare rows sample from flat logits; their outputs go to the spare row
            scaled = torch.cat([scaled, scaled.new_zeros(cur - b, scaled.shape[1])])
            lse = torch.cat([lse, lse.new_zeros(cur - b)])

        out_tokens = torch.full((b + 1, max_new_tokens), self.pad_token_id, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros(b + 1, max_new_tokens, dtype=torch.float32, device=dev)
        out_mask = torch.zeros(b + 1, max_new_tokens, dtype=torch.float32, device=dev)
        row_of = torch.arange(cur, device=dev).clamp_(max=b)  # output row of each cache row; b = the spare
        finished = torch.arange(cur, device=dev) >= b
        for step in range(max_new_tokens):
            tok, lp = self._sample(scaled, lse, greedy=temperature == 0, top_k=top_k, top_p=top_p,
                                   generator=generator)
            live = ~finished
            out_tokens[row_of, step] = torch.where(live, tok, self.pad_token_id)
            out_logprobs[row_of, step] = torch.where(live, lp, 0.0)
            out_mask[row_of, step] = live.float()
            finished = finished | torch.isin(tok, eos)
            if step == max_new_tokens - 1:
                break
            self._tok[:cur] = tok
            if (step + 1) % self.check_every == 0:
                n_live = int((~finished).sum())
                if n_live == 0:
                    break
                if self.bucket(n_live) < cur:
                    cur, row_of, finished = self._compact(finished, row_of, spare=b)
            scaled, lse = self._step(cur)
        width = max(int(out_mask[:b].sum(-1).max()), 1)
        last = out_tokens[:b].gather(1, out_mask[:b].sum(-1, keepdim=True).long() - 1).squeeze(1)
        truncated = ~torch.isin(last, eos)  # a row ends at its first EOS, so no EOS last = no EOS at all
        return out_tokens[:b, :width], out_mask[:b, :width], out_logprobs[:b, :width], truncated

    def _compact(self, finished: torch.Tensor, row_of: torch.Tensor, *, spare: int
                 ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Move the live cache rows to the front (order kept) and shrink to their bucket."""
        keep = torch.nonzero(~finished).squeeze(-1)
        n, new = keep.numel(), self.bucket(keep.numel())
        for i in range(len(self.layers)):  # one layer at a time: the gather copy stays small
            self.cache[i, :, :n] = self.cache[i][:, keep]
        for buf in (self._tok, self._pos, self._pad):
            buf[:n] = buf[keep]
        new_row_of = torch.full((new,), spare, dtype=row_of.dtype, device=row_of.device)
        new_row_of[:n] = row_of[keep]
        new_finished = torch.arange(new, device=finished.device) >= n
        self.compactions += 1
        return new, new_row_of, new_finished


__all__ = ["FastDecoder", "batch_buckets", "unsupported_reason"]
