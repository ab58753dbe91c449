"""Fast decode for the families of :data:`spmd_rl.models.families.FAMILIES` (Llama 3.x, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Gemma 3 text): static KV cache, graph-captured step, compaction.

    fast = FastDecoder(hf_model, device=device, max_batch=64, pad_token_id=0)    # see unsupported_reason()
    tokens, mask, logprobs, truncated = fast.generate_chunk(rows, temperature=1.0, top_k=0, top_p=1.0,
                                                            max_new_tokens=256, generator=gen, eos=eos_ids)
    fast.release()   # frees the KV cache and the CUDA graphs (rollout sleep); fast.restore() reallocates

:class:`~spmd_rl.rollout.native.NativeRollout` uses this automatically when the model qualifies and
falls back to its Hugging Face loop otherwise. The decoder reads the HF modules' own parameters, with
one change made at construction: the q/k/v projections, and the MLP's gate/up projections, become
one GEMM each (:class:`Fused`): their weights are rows of one tensor and the HF parameters are views
of it, so ``load_weights`` (in-place copies by HF name) and the HF loop keep working unchanged.

How a chunk of ``b`` left-padded rows runs:

* the KV cache is ONE tensor ``[layers, 2, rows, kv_heads, slots, head_dim]``, allocated for the
  largest batch bucket used so far and ``slots = longest prompt + max_new_tokens`` rounded up to 64
  (both grow only); sleep frees it. Slot ``s`` holds position ``s - pad`` of a row that has ``pad``
  left-padding slots, so every row writes the same slot at each step;
* prefill: the prompts go through in row groups of at most ``prefill_tokens`` tokens, causal +
  padding mask (a padding query also sees itself, so no softmax row is empty), K/V written to slots
  ``0..P-1``; only the last position's logits are computed;
* a step (:meth:`FastDecoder._step_body`) first SAMPLES from the logits the previous step left in
  a static buffer and records the token, its log-prob and the live mask in static output buffers at
  the step's column, then runs the decode FORWARD of that token: embed, per layer fused RMSNorm /
  one q,k,v GEMM / RoPE on q and k together (a table gathered by each row's position) / write slot /
  SDPA over all slots with the row's valid-slot mask (query heads grouped by their KV head, so GQA
  needs no K/V copy) / o_proj / RMSNorm / one gate,up GEMM / down_proj, then norm, ``lm_head``,
  ``/ T`` and ``logsumexp`` into the logits buffer. Family differences (:mod:`spmd_rl.rollout.layers`):
  Qwen3 / Gemma 3 normalise each q and k head; Gemma 3 scales norms by ``1 + w``, normalises the
  attention and MLP outputs too, embeds times ``sqrt(hidden)`` (its embedding module), soft-caps the
  final logits when configured and reads a RoPE table per layer type (local and global bases);
  Qwen3-MoE layers route each token to its top-k experts through grouped GEMMs (:func:`moe_mlp`);
* sliding-window layers (Gemma 3's local layers, Mistral, Qwen2 with ``use_sliding_window``) keep a
  window-sized ring cache of their own (``ring [windowed layers, 2, rows, kv_heads, min(window, slots),
  head_dim]``): slot ``s`` lives at ring index ``s % R``, so a step overwrites the entry that just left
  the window, and the mask keeps the entries whose slot is inside the row and the window. The other
  layers' cache (``cache``, full length) holds the global layers only; a prefill longer than the window
  writes its last ``R`` slots to the ring; On CUDA the whole step, sampling included, is one
  CUDA graph per batch bucket and sampling setting; the host only draws the step's uniforms and
  replays it;
* sampling is by inverse CDF: one uniform ``u`` per row (drawn from the caller's ``torch.Generator``,
  outside the graph) picks the first token whose cumulative probability exceeds ``u``; top-k / top-p
  filter ``z = logits / T`` first. Greedy is argmax. The log-prob is ``z[tok] - logsumexp(z)``, i.e.
  ``log_softmax(logits / T)`` before filtering, float32;
* every ``check_every`` steps (1 on CPU, 4 on CUDA: it costs a host sync) the live rows are counted:
  all finished ends the chunk; if they fit a smaller bucket, the live rows' K/V, logits and counters
  move to the front (order kept) and the smaller bucket's graph runs from then on. Slots past the
  live rows write their outputs to a spare row that is dropped.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..compiled import CompileGroup
from ..models.families import FAMILIES, layer_windows
from .layers import (
    ACTIVATIONS, Fused, dense_mlp, grouped_mm_works, layer_functions, moe_mlp, norm_eps, rms_norm, rope_types,
    unsupported_reason,
)
from .sampling import filter_logits

# SDPA kernels the path may use: masked attention runs the memory-efficient kernel on CUDA (flash takes
# no mask) and the fused CPU kernel on CPU; a known, graph-capturable choice on every torch version.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_DECODE = CompileGroup("the rollout's compiled decode layers")  # CUDA; eager layer code if compiling fails


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two below ``max_batch``, then ``max_batch``."""
    buckets = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return buckets + [max_batch]


class FastDecoder:
    """Static-cache, graph-captured decoding over a HF model of a supported family (module docstring)."""

    _STEP_BUFFERS = ("_tok", "_pos", "_pad", "_slot", "_col", "_row_of", "_finished", "_limit", "_temp", "_u", "_scaled",
                     "_lse", "_out_tok", "_out_lp", "_out_mask", "_slots", "_cos", "_sin")

    def __init__(self, model: torch.nn.Module, *, device: torch.device, max_batch: int, pad_token_id: int,
                 prefill_tokens: int = 16384, compile_layers: bool = False) -> None:
        """``compile_layers``: run the decode step's layer halves (:func:`layer_functions`) through
        ``torch.compile`` (one fused kernel for each norm, for RoPE and for the activation); the prefill
        runs them eagerly. Compiling fails over to the eager code, logged once."""
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
        self.vocab = int(model.lm_head.out_features)
        self.family = FAMILIES[config.model_type]
        self.windows = layer_windows(config)  # per layer: sliding window or None
        # per layer: (in the ring, index in its cache); windowed layers keep a window-sized ring cache
        counts = [0, 0]
        self._kv_of = []
        for w in self.windows:
            self._kv_of.append((w is not None, counts[w is not None]))
            counts[w is not None] += 1
        self.window = max((w for w in self.windows if w), default=None)
        keys = rope_types(model)  # per layer: its RoPE table (Gemma 3: one per layer type)
        self.rope_keys = list(dict.fromkeys(keys))
        self.rope_of = [self.rope_keys.index(k) for k in keys]
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.qkv = [Fused((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)) for l in self.layers]
        self.experts = [getattr(l.mlp, "experts", None) for l in self.layers]  # Qwen3-MoE layers; None: dense
        self.gate_up = [None if e is not None else Fused((l.mlp.gate_proj, l.mlp.up_proj))
                        for l, e in zip(self.layers, self.experts)]
        self.fused: list[Fused] = self.qkv + [f for f in self.gate_up if f is not None]
        # the function for the config's activation (the same one every layer's act_fn applies), else that module
        first = next(e if e is not None else l.mlp for l, e in zip(self.layers, self.experts))
        act = ACTIVATIONS.get(getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)) \
            or first.act_fn
        mlps = {}
        dense = [f for f in self.gate_up if f is not None]
        if dense:
            mlps["dense"] = dense_mlp(intermediate=dense[0].sizes[0], act=act)
        moe = next((l.mlp for l, e in zip(self.layers, self.experts) if e is not None), None)
        # grouped GEMMs where the kernel runs on these experts' dtype and device; else a loop over the hit
        # experts, whose host sync rules out CUDA graphs
        self.grouped_experts = moe is not None and grouped_mm_works(moe.experts.gate_up_proj)
        if moe is not None:
            mlps["moe"] = moe_mlp(experts=moe.experts.num_experts, top_k=moe.gate.top_k,
                                  normalise=bool(moe.gate.norm_topk_prob), act=act, grouped=self.grouped_experts)
        self.kind = ["dense" if e is None else "moe" for e in self.experts]
        self.attn_in, outs = None, {}
        for kind, mlp in mlps.items():
            self.attn_in, outs[kind] = layer_functions(
                qk_heads=self.heads + self.kv_heads, q_heads=self.heads, head_dim=self.head_dim, mlp=mlp,
                norm_offset=self.family.norm_offset)
        self.attn_out = outs
        self.compile_layers = compile_layers
        # the decode step's halves: compiled (dynamic in the rows, so one artifact for every bucket) or not
        self._step_in = _DECODE.wrap(self.attn_in) if compile_layers else self.attn_in
        # torch.compile traces grouped_mm for bf16 only (torch 2.13), and the experts loop syncs with the host:
        # other MoE layers run their second half eagerly
        compile_moe = self.grouped_experts and moe.experts.gate_up_proj.dtype == torch.bfloat16
        self._step_out = {k: _DECODE.wrap(f) if compile_layers and (k != "moe" or compile_moe) else f
                          for k, f in outs.items()}
        self.buckets = batch_buckets(max_batch)
        self.pad_token_id = int(pad_token_id)
        self.prefill_tokens = prefill_tokens
        # grouped_mm's kernel is capturable in bf16 only: other dtypes run a fallback that reads the
        # offsets on the host (measured: torch 2.11, H200), as the experts loop does
        self.use_graphs = self.device.type == "cuda" and (moe is None or compile_moe)
        self.check_every = 4 if self.use_graphs else 1
        self.cache: torch.Tensor | None = None  # the full-length layers' K/V
        self.ring: torch.Tensor | None = None  # the windowed layers' K/V (window-sized)
        self._shape: tuple[int, int] | None = None  # (rows, slots) of the last cache, for restore()
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (rows, greedy, top_k, top_p) -> the step
        self._pool = None
        self.compactions = 0  # how many times live rows moved to a smaller bucket (tests read it)

    # ------------------------------------------------------------------ memory

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
            self._allocate(*self._shape)

    def _ensure_cache(self, rows: int, slots: int) -> None:
        if self.cache is not None and self._shape[0] >= rows and self._shape[1] >= slots:
            return
        if self.cache is not None:
            rows, slots = max(rows, self._shape[0]), max(slots, self._shape[1])
        self.release()
        self._allocate(rows, -(-slots // 64) * 64)

    def _allocate(self, rows: int, slots: int) -> None:
        """The cache and every buffer a captured step reads or writes (fixed addresses for the graphs)."""
        dtype, dev = self.inner.embed_tokens.weight.dtype, self.device
        windowed = sum(w is not None for w in self.windows)
        self.cache = torch.zeros(len(self.layers) - windowed, 2, rows, self.kv_heads, slots, self.head_dim,
                                 dtype=dtype, device=dev)
        self.ring = torch.zeros(windowed, 2, rows, self.kv_heads, min(self.window or 0, slots), self.head_dim,
                                dtype=dtype, device=dev)
        self._shape = (rows, slots)
        long = dict(dtype=torch.long, device=dev)
        self._tok = torch.zeros(rows, **long)       # the token each row feeds the next forward
        self._pos = torch.zeros(rows, **long)       # its position
        self._pad = torch.zeros(rows, **long)       # left-padding slots of each row
        self._slot = torch.zeros(1, **long)         # the slot the next forward writes
        self._col = torch.zeros(1, **long)          # the output column the next sample writes
        self._row_of = torch.zeros(rows, **long)    # output row of each cache row (the spare row for spares)
        self._finished = torch.zeros(rows, dtype=torch.bool, device=dev)
        self._limit = torch.zeros(rows, **long)     # tokens a row may have (rollout.length_dist; else the budget)
        self._temp = torch.ones(1, dtype=torch.float32, device=dev)  # logits are divided by it
        self._u = torch.zeros(rows, dtype=torch.float32, device=dev)  # this step's uniforms
        self._scaled = torch.zeros(rows, self.vocab, dtype=torch.float32, device=dev)  # logits / T
        self._lse = torch.zeros(rows, dtype=torch.float32, device=dev)
        self._out_tok = torch.zeros(rows + 1, slots, **long)  # + a spare row
        self._out_lp = torch.zeros(rows + 1, slots, dtype=torch.float32, device=dev)
        self._out_mask = torch.zeros_like(self._out_lp)
        self._slots = torch.arange(slots, device=dev)
        # RoPE tables by position, one per rope key (see rope_types)
        self._cos = torch.zeros(len(self.rope_keys), slots, self.head_dim, dtype=dtype, device=dev)
        self._sin = torch.zeros_like(self._cos)  # sin with the first half negated (see rope())
        self._eos = None

    # ------------------------------------------------------------------ forward pieces

    def _rms(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm with float32 statistics in one fused kernel (rounded once)."""
        return rms_norm(x, norm.weight, norm_eps(norm), self.family.norm_offset)

    def _in(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn: Callable) -> tuple:
        norm, attn = self.layers[i].input_layernorm, self.layers[i].self_attn
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3, Gemma 3
        if qn is None:
            return fn(x, norm.weight, norm_eps(norm), self.qkv[i].weight, self.qkv[i].bias, cos, sin)
        return fn(x, norm.weight, norm_eps(norm), self.qkv[i].weight, self.qkv[i].bias, cos, sin,
                  qn.weight, kn.weight, norm_eps(qn))

    def _out(self, i: int, x: torch.Tensor, o: torch.Tensor, fns: dict[str, Callable]) -> torch.Tensor:
        layer, kind = self.layers[i], self.kind[i]
        o_proj = layer.self_attn.o_proj
        if self.family.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output
            norms = (layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                     layer.post_feedforward_layernorm.weight)
        else:  # Llama-like: post_attention_layernorm is the MLP's input norm
            norms = (None, layer.post_attention_layernorm.weight, None)
        if kind == "moe":
            weights = (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)
        else:
            down = layer.mlp.down_proj
            weights = (self.gate_up[i].weight, self.gate_up[i].bias, down.weight, down.bias)
        return fns[kind](x, o, o_proj.weight, o_proj.bias, norm_eps(layer.post_attention_layernorm), *norms, weights)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, ``lm_head`` and the final soft-cap (Gemma, when configured) of ``x [rows, h]``."""
        logits = self.model.lm_head(self._rms(self.inner.norm, x))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _head(self, x: torch.Tensor, rows: int) -> None:
        """:meth:`_logits` of ``x [rows, h]`` -> ``logits / T`` (float32) and its logsumexp, into the
        buffers the next sample reads."""
        scaled = self._scaled[:rows]
        scaled.copy_(self._logits(x)).div_(self._temp)
        torch.logsumexp(scaled, dim=-1, out=self._lse[:rows])

    def _kv(self, i: int) -> torch.Tensor:
        """Layer ``i``'s K/V, ``[2, rows, kv_heads, slots or ring size, head_dim]``."""
        in_ring, j = self._kv_of[i]
        return self.ring[j] if in_ring else self.cache[j]

    @staticmethod
    def _biases(allowed: torch.Tensor, windows: dict[int | None, torch.Tensor], dtype: torch.dtype,
                ) -> dict[int | None, torch.Tensor]:
        """Additive masks per window: ``allowed`` and, for a window ``w``, ``windows[w]`` (the keys fewer
        than ``w`` positions back); None = full causal."""
        out = {}
        for w, near in windows.items():
            ok = allowed if w is None else allowed & near
            out[w] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))
        return out

    def _prefill(self, ids: torch.Tensor, pad: torch.Tensor, row0: int) -> None:
        """Prompts ``ids [b, P]`` (left-padded by ``pad [b]``) into cache rows ``row0..row0+b``, slots
        ``0..P-1``; the last position's logits go to the logits buffer's rows ``row0..row0+b``."""
        b, length = ids.shape
        ar = self._slots[:length]
        pos = (ar[None, :] - pad[:, None]).clamp(min=0)
        allowed = (ar[:, None] >= ar[None, :])[None] & (ar[None, :] >= pad[:, None])[:, None, :]
        allowed = (allowed | torch.eye(length, dtype=torch.bool, device=ids.device))[:, None]  # [b, 1, P, P]
        distance = ar[:, None] - ar[None, :]  # query slot - key slot = position difference inside a row
        x = self.inner.embed_tokens(ids)
        bias = self._biases(allowed, {w: distance < w if w else None for w in set(self.windows)}, x.dtype)
        tables = [(self._cos[t][pos][:, :, None], self._sin[t][pos][:, :, None]) for t in range(len(self.rope_keys))]
        ring = self.ring.shape[4]
        last = ar[max(0, length - ring):]  # the prompt's slots a ring keeps, at ring index slot % size
        for i in range(len(self.layers)):
            cos, sin = tables[self.rope_of[i]]  # [b, P, 1, D]
            qk, v = self._in(i, x, cos, sin, self.attn_in)
            qk, v = qk.transpose(1, 2), v.transpose(1, 2)  # [b, H + Hkv, P, D], [b, Hkv, P, D]
            q, k = qk[:, :self.heads], qk[:, self.heads:]
            kv = self._kv(i)
            if self._kv_of[i][0]:
                kv[0, row0:row0 + b, :, last % ring] = k[:, :, last]
                kv[1, row0:row0 + b, :, last % ring] = v[:, :, last]
            else:
                kv[0, row0:row0 + b, :, :length] = k
                kv[1, row0:row0 + b, :, :length] = v
            if self.group > 1:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[self.windows[i]], scale=self.scaling)
            x = self._out(i, x, o.transpose(1, 2).reshape(b, length, self.heads * self.head_dim), self.attn_out)
        scaled = self._scaled[row0:row0 + b]
        scaled.copy_(self._logits(x[:, -1])).div_(self._temp)
        torch.logsumexp(scaled, dim=-1, out=self._lse[row0:row0 + b])

    def _forward(self, rows: int) -> None:
        """The decode forward of ``_tok`` for cache rows ``0..rows-1``; advances the position and slot."""
        pos = self._pos[:rows]
        valid = (self._slots[None, :] >= self._pad[:rows, None]) & (self._slots[None, :] <= self._slot)
        x = self.inner.embed_tokens(self._tok[:rows])
        # Additive masks [rows, 1, 1, slots or ring size], built once per step, broadcast over KV heads and
        # query groups. Ring entry j holds the latest slot s <= this step's with s % R == j; it counts when
        # that slot is one of the row's (not left padding) and fewer than the layer's window back.
        bias = {None: self._biases(valid, {None: None}, x.dtype)[None][:, None, None, :]}
        if self.window is not None:
            ring = self.ring.shape[4]
            held = self._slot - (self._slot - self._slots[:ring]) % ring  # [R] the slot at each ring index
            live = (held[None, :] >= self._pad[:rows, None]) & (held >= 0)[None]
            near = {w: (held > self._slot - w)[None] for w in set(self.windows) if w}
            bias.update({w: m[:, None, None, :] for w, m in self._biases(live, near, x.dtype).items()})
            ring_slot = self._slot % ring
        tables = [(self._cos[t][pos][:, None], self._sin[t][pos][:, None]) for t in range(len(self.rope_keys))]
        for i in range(len(self.layers)):
            cos, sin = tables[self.rope_of[i]]  # [rows, 1, D]
            qk, v = self._in(i, x, cos, sin, self._step_in)
            kv = self._kv(i)
            k_cache, v_cache = kv[0, :rows], kv[1, :rows]
            at = ring_slot if self._kv_of[i][0] else self._slot
            k_cache.index_copy_(2, at, qk[:, self.heads:, None])
            v_cache.index_copy_(2, at, v[:, :, None])
            q = qk[:, :self.heads].unflatten(1, (self.kv_heads, self.group))  # query heads of one KV head together
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=bias[self.windows[i]], scale=self.scaling)
            x = self._out(i, x, o.reshape(rows, self.heads * self.head_dim), self._step_out)
        self._head(x, rows)
        self._pos[:rows] += 1
        self._slot += 1

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
            cdf = torch.exp(z - (torch.logsumexp(z, -1) if filtered else lse)[:, None]).cumsum_(-1)
            total = cdf[:, -1:].contiguous()
            tokens = torch.searchsorted(cdf, u[:, None] * total, right=True)
            # u * total can round up to total: the last token with mass is the first to reach the total
            tokens = torch.minimum(tokens, torch.searchsorted(cdf, total)).squeeze(-1)
        return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse

    def _record(self, rows: int, *, greedy: bool, top_k: int, top_p: float) -> None:
        """Sample rows ``0..rows-1`` from the logits buffer and write token, log-prob and live mask at the
        output column; finished rows write pad / 0 / 0. The sampled tokens feed the next forward."""
        tok, lp = self._pick(self._scaled[:rows], self._lse[:rows], None if greedy else self._u[:rows],
                             top_k=top_k, top_p=top_p)
        live = ~self._finished[:rows]
        where = (self._row_of[:rows], self._col.expand(rows))
        self._out_tok.index_put_(where, torch.where(live, tok, self.pad_token_id))
        self._out_lp.index_put_(where, torch.where(live, lp, 0.0))
        self._out_mask.index_put_(where, live.float())
        self._finished[:rows].logical_or_(torch.isin(tok, self._eos) | (self._col >= self._limit[:rows] - 1))
        self._tok[:rows] = tok
        self._col += 1

    def _step_body(self, rows: int, mode: tuple[bool, int, float]) -> None:
        """One step: sample from the last logits, then the forward of the sampled tokens."""
        greedy, top_k, top_p = mode
        self._record(rows, greedy=greedy, top_k=top_k, top_p=top_p)
        self._forward(rows)

    def _step(self, rows: int, mode: tuple[bool, int, float]) -> None:
        if not self.use_graphs:
            self._step_body(rows, mode)
            return
        graph = self._graphs.get((rows, *mode))
        if graph is None:
            graph = self._capture(rows, mode)
        graph.replay()

    def _capture(self, rows: int, mode: tuple[bool, int, float]) -> torch.cuda.CUDAGraph:
        """Capture the step of ``rows`` rows. The warm-up really runs the step, so the state it changed is
        put back first (the K/V it wrote are those the replay writes again)."""
        state = [self._tok[:rows], self._pos[:rows], self._slot, self._col, self._finished[:rows],
                 self._scaled[:rows], self._lse[:rows]]
        saved = [t.clone() for t in state]
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step_body(rows, mode)  # lazy library workspaces are set up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            for t, old in zip(state, saved):
                t.copy_(old)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (NCCL watchdog, pinned-memory copies) cannot spoil it
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._step_body(rows, mode)
        self._graphs[(rows, *mode)] = graph
        return graph

    # ------------------------------------------------------------------ generation

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, eos: torch.Tensor, limits: torch.Tensor | None = None,
        interrupt: Callable[[int], bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``NativeRollout._generate_chunk_hf``: ``tokens, mask, logprobs [b, t]`` and ``truncated [b]``.
        ``limits [b]``: a row stops after that many tokens (no EOS: truncated); ``interrupt(steps)``,
        called on the host after each decode step with the tokens sampled so far, ends the chunk there
        when it returns True (partial rollouts: the caller swaps weights and prefills the prefixes again)."""
        with sdpa_kernel(ATTENTION_BACKENDS):
            return self._generate_chunk(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                        max_new_tokens=max_new_tokens, generator=generator, eos=eos, limits=limits,
                                        interrupt=interrupt)

    def _generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, eos: torch.Tensor, limits: torch.Tensor | None = None,
        interrupt: Callable[[int], bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, longest, dev = len(rows), max(len(r) for r in rows), self.device
        if b > self.buckets[-1]:
            raise ValueError(f"FastDecoder: {b} rows exceed rollout.batch_size ({self.buckets[-1]})")
        cur = self.bucket(b)
        self._ensure_cache(cur, longest + max_new_tokens)
        self._set_eos(eos)
        half = self.head_dim // 2
        for t, key in enumerate(self.rope_keys):  # the same tables as HF's forward
            extra = () if key is None else (key,)
            cos, sin = self.inner.rotary_emb(self._cos[t][None], self._slots[None], *extra)
            self._cos[t].copy_(cos[0])
            self._sin[t].copy_(torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1))  # rotate_half's sign

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
        self._col.zero_()
        self._temp.fill_(temperature if temperature > 0 else 1.0)
        self._scaled[b:cur].zero_()  # spare rows sample from flat logits; their outputs go to the spare row
        self._lse[b:cur].zero_()
        self._row_of[:cur] = torch.arange(cur, device=dev).clamp_(max=b)
        self._finished[:cur] = torch.arange(cur, device=dev) >= b
        self._limit[:cur] = max_new_tokens
        if limits is not None:
            self._limit[:b] = limits
        # every column: a longer call before this one left its outputs past max_new_tokens
        self._out_tok[:b + 1].fill_(self.pad_token_id)
        self._out_lp[:b + 1].zero_()
        self._out_mask[:b + 1].zero_()
        group = max(1, self.prefill_tokens // longest)
        for s in range(0, b, group):
            self._prefill(ids[s:s + group], pad[s:s + group], s)

        greedy = temperature == 0
        mode = (True, 0, 1.0) if greedy else (False, top_k, top_p)  # one graph per mode and bucket
        for step in range(max_new_tokens):
            if not greedy:
                self._u[:cur].uniform_(generator=generator)
            if step == max_new_tokens - 1:  # the last token: sampled, never fed back
                self._record(cur, greedy=greedy, top_k=top_k, top_p=top_p)
                break
            self._step(cur, mode)
            if interrupt is not None and interrupt(step + 1):
                break
            if (step + 1) % self.check_every == 0:
                n_live = int((~self._finished[:cur]).sum())
                if n_live == 0:
                    break
                if self.bucket(n_live) < cur:
                    cur = self._compact(cur, spare=b)
        mask = self._out_mask[:b]
        width = max(int(mask.sum(-1).max()), 1)
        tokens = self._out_tok[:b, :width].clone()
        last = tokens.gather(1, mask.sum(-1, keepdim=True).long().clamp_(min=1) - 1).squeeze(1)
        truncated = ~torch.isin(last, self._eos)  # a row ends at its first EOS, so no EOS last = no EOS at all
        return tokens, mask[:, :width].clone(), self._out_lp[:b, :width].clone(), truncated

    def _set_eos(self, eos: torch.Tensor) -> None:
        """The EOS ids the captured steps compare against (a buffer of its own; a new count recaptures)."""
        if self._eos is not None and self._eos.shape == eos.shape:
            self._eos.copy_(eos)
            return
        for graph in self._graphs.values():
            graph.reset()
        self._graphs = {}
        self._eos = eos.to(self.device, copy=True)

    def _compact(self, cur: int, *, spare: int) -> int:
        """Move the live cache rows (and their logits and counters) to the front, order kept; shrink to their
        bucket. Rows past the live ones become spares: finished, writing to the spare output row."""
        keep = torch.nonzero(~self._finished[:cur]).squeeze(-1)
        n, new = keep.numel(), self.bucket(keep.numel())
        for cache in (self.cache, self.ring):
            for i in range(cache.shape[0]):  # one layer at a time: the gather copy stays small
                cache[i, :, :n] = cache[i][:, keep]
        for buf in (self._tok, self._pos, self._pad, self._row_of, self._scaled, self._lse, self._limit):
            buf[:n] = buf[keep]
        self._row_of[n:new] = spare
        self._finished[:new] = torch.arange(new, device=self.device) >= n
        self.compactions += 1
        return new


__all__ = ["FastDecoder", "Fused", "batch_buckets", "unsupported_reason"]
