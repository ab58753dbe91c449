"""Fast decode for the families of :data:`spmd_rl.models.families.FAMILIES` (Llama 3.x, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Gemma 3 text): slot-based KV cache, continuous batching, graph-captured step, compaction.

    fast = FastDecoder(hf_model, device=device, max_batch=64, pad_token_id=0)    # see unsupported_reason()
    tokens, mask, logprobs, truncated = fast.generate_chunk(rows, temperature=1.0, top_k=0, top_p=1.0,
                                                            max_new_tokens=256, generator=gen, eos=eos_ids)
    fast.release()   # frees the KV cache and the CUDA graphs (rollout sleep); fast.restore() reallocates

:class:`~spmd_rl.rollout.native.NativeRollout` uses this automatically when the model qualifies and
falls back to its Hugging Face loop otherwise. The decoder reads the HF modules' own parameters, with
one change made at construction: the q/k/v projections, and the MLP's gate/up projections, become
one GEMM each (:class:`Fused`): their weights are rows of one tensor and the HF parameters are views
of it, so ``load_weights`` (in-place copies by HF name) and the HF loop keep working unchanged.

How a call of ``b`` rows runs (any ``b``; ``max_batch``, i.e. ``rollout.batch_size``, decode at once):

* the KV cache is slot-based (:mod:`spmd_rl.rollout.slots`, the decoder's base class): one cache row (a
  sequence slot) per decoding row, sized for the longest prompt + ``max_new_tokens``, each row with its
  own write slot and position; its bytes are checked against the device's free memory before it is
  allocated (:meth:`FastDecoder.memory_needed`), failing with the numbers and the flags to change;
* continuous batching: the first ``max_batch`` rows are prefilled; the others queue in the order
  given. Whenever at least ``refill_fraction`` of the slots (or all) are finished, the next queued rows
  are prefilled into those slots, while the other rows keep decoding. Once the queue is empty, the
  live rows move to the front when they fit a smaller bucket (compaction: their K/V, logits and
  counters, order kept; slots past them are spares writing to a spare output row);
* prefill: rows go through in groups of at most ``prefill_tokens`` tokens, each left-padded to its
  longest prompt, causal + padding mask (a padding query also sees itself, so no softmax row is
  empty), K/V written to the group's cache rows; only the last position's logits are computed;
* a step (:meth:`FastDecoder._step_body`) first SAMPLES from the logits the previous step left in
  a static buffer and records the token, its log-prob and the live mask at each live row's own
  output column (a row finishes at an EOS id or its own length limit), then runs the decode
  FORWARD of that token: embed, per layer fused RMSNorm / one q,k,v GEMM / RoPE on q and k together
  (a table gathered by each row's position) and each row's K/V written at its slot (one kernel when
  compiled, :func:`~spmd_rl.rollout.layers.storing`) / attention / o_proj / RMSNorm /
  one gate,up GEMM / down_proj, then norm, ``lm_head``, ``/ T`` and ``logsumexp`` into the logits
  buffer. Attention of the full-length layers (:attr:`FastDecoder.attention`, the first that runs
  here): ``varlen``, torch's flash varlen kernel over each row's own entries (from past its padding to
  its write slot: a long row costs only itself; CUDA, bf16 / fp16, a torch whose ``varlen_attn``
  takes ``seqused_k`` and ``enable_gqa``); ``triton``, the same reads through a split-K Triton kernel
  (:mod:`spmd_rl.rollout.decode_attention`; CUDA, bf16 / fp16, e.g. torch 2.11); else ``sdpa``, over
  the step's SPAN (slots ``0..span-1``, a power of two above every write slot) with the row's
  valid-slot mask (query heads grouped by their KV head, so GQA needs no K/V copy). The two
  row-wise kernels read a single entry for a finished row (its forward is never used). Family
  differences (:mod:`spmd_rl.rollout.layers`): Qwen3 / Gemma 3 normalise each q and k head; Gemma 3
  scales norms by ``1 + w``, normalises the attention and MLP outputs too, embeds times
  ``sqrt(hidden)`` (its embedding module), soft-caps the final logits when configured and reads a
  RoPE table per layer type (local and global bases); Qwen3-MoE layers route each token to its
  top-k experts through grouped GEMMs (:func:`moe_mlp`);
* sliding-window layers (Gemma 3's local layers, Mistral, Qwen2 with ``use_sliding_window``) keep a
  window-sized ring cache of their own (``ring [windowed layers, 2, rows, kv_heads, min(window, slots),
  head_dim]``): slot ``s`` lives at ring index ``s % R``, so a step overwrites the entry that just left
  the window, and the mask keeps the entries whose slot is inside the row and the window. A prefill
  longer than the window writes its last ``R`` slots to the ring;
* on CUDA the whole step, sampling included, is one CUDA graph per (batch bucket, span, sampling
  setting): refills and compactions only rewrite the buffers the graphs read, so they recapture
  nothing; the host only replays. :meth:`FastDecoder.capture_graphs` captures every bucket and span
  ahead of a call;
* sampling is by inverse CDF: one uniform ``u`` per row and token, the row's own (written to its
  output row when it is fed, from a generator seeded by the call's seed, the row's key (its index in a
  ``generate_chunk`` call) and its prompt's length: :mod:`spmd_rl.rollout.sampling`), picks the
  first token whose cumulative probability exceeds ``u``, in two levels
  (:func:`~spmd_rl.rollout.sampling.inverse_cdf`: block sums, then one block, instead of a scan over the
  vocabulary); top-k / top-p filter ``z = logits / T`` first. Greedy is argmax. The log-prob is
  ``z[tok] - logsumexp(z)``, i.e. ``log_softmax(logits / T)`` before filtering, float32;
* with ``record_routes`` (router replay) each MoE layer of the step's forward also writes its tokens'
  experts into a static buffer, which the step scatters to the output cell of the token it fed
  (:meth:`FastDecoder.routes`): recorded inside the graph, no host sync;
* every ``check_every`` steps (1 on CPU, 4 on CUDA: it costs a host sync) the live rows and the
  highest write slot are read: the queue refills, the live rows compact, or the call ends when no
  row is live and none queues.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..compiled import CompileGroup
from ..models.families import FAMILIES, layer_windows
from .decode_attention import attention_kind
from .decode_step import DecodeStep
from .fp8 import fp8_shape_ok
from .layers import (
    ACTIVATIONS, Fp8Fused, Fused, dense_mlp, grouped_mm_works, layer_functions, moe_mlp, norm_eps, rms_norm, rope_types, storing,
    unsupported_reason,
)
from .prefixes import PrefixCache
from .sampling import row_seed

# SDPA kernels the path may use: masked attention runs the memory-efficient kernel on CUDA (flash takes
# no mask) and the fused CPU kernel on CPU; a known, graph-capturable choice on every torch version.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# CUDA; eager layer code if compiling fails
_DECODE = CompileGroup("the rollout's compiled decode layers", duck_shapes=False)


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two below ``max_batch``, then ``max_batch``."""
    buckets = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return buckets + [max_batch]


class FastDecoder(DecodeStep, PrefixCache):
    """Static-cache, graph-captured decoding over a HF model of a supported family (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, max_batch: int, pad_token_id: int,
                 prefill_tokens: int = 16384, compile_layers: bool = False, record_routes: bool = False,
                 fp8: bool = False) -> None:
        """``compile_layers``: run the decode step's layer halves (:func:`layer_functions`) through
        ``torch.compile`` (one fused kernel for each norm, for RoPE and for the activation); the prefill
        runs them eagerly. Compiling fails over to the eager code, logged once. ``record_routes`` (an MoE
        model): the decode step records each generated token's experts in every MoE layer (:meth:`routes`).
        ``fp8``: the attention and dense MLP projections hold FP8 weights (:class:`Fp8Fused`; one whose widths
        the scaled GEMM does not take keeps the model dtype); embeddings, norms, routers, routed experts and
        ``lm_head`` stay in the model dtype."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastDecoder: {reason}")
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.device = torch.device(device)
        self._read_shape(model)
        graphable = self._build_layer_functions(model.config, compile_layers, fp8)
        # router replay: MoE layer i records its experts at index moe_of[i] of the step's routes
        self.moe_layers = [i for i, kind in enumerate(self.kind) if kind == "moe"]
        if record_routes and not self.moe_layers:
            raise ValueError("FastDecoder: record_routes needs a mixture-of-experts model; this one has no MoE layer")
        self.record_routes = record_routes
        self.top_k = int(next(l.mlp.gate.top_k for l, e in zip(self.layers, self.experts) if e is not None)) \
            if self.moe_layers else 0
        self._moe_of = {i: j for j, i in enumerate(self.moe_layers)}
        self.buckets = batch_buckets(max_batch)
        self.pad_token_id = int(pad_token_id)
        self.prefill_tokens = prefill_tokens
        self.use_graphs = self.device.type == "cuda" and graphable
        self.check_every = 4 if self.use_graphs else 1
        # full-length layers attend over each row's own entries (left padding skipped, nothing past its write
        # slot read) with flash varlen or the Triton kernel where one runs; else masked SDPA over the step's span.
        # Settable before a call (the benchmark compares them): "varlen", "triton" or "sdpa"
        self.attention = attention_kind(dtype=self.inner.embed_tokens.weight.dtype, device=self.device,
                                        heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        self.cache: torch.Tensor | None = None  # the full-length layers' K/V
        self.ring: torch.Tensor | None = None  # the windowed layers' K/V (window-sized)
        self._shape: tuple[int, int, int] | None = None  # (rows, slots, output rows) of the last cache, for restore()
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (rows, span, greedy, top_k, top_p) -> the step
        self._pool = None
        self.compactions = 0  # how many times live rows moved to a smaller bucket (tests read it)
        self.refills = 0  # how many times queued rows were prefilled into freed slots (tests read it)
        self.steps = 0  # decode steps run (the benchmark reads it: tokens / (steps x slots) = occupancy)
        # refill once this share of the bucket's slots is free (or none is live): fewer, larger prefills
        self.refill_fraction = 1 / 16
        # bytes the cache and buffers may take; None = what the device has free (CUDA), no check on CPU
        self.memory_budget: int | None = None
        self._init_prefixes()  # what finished rows leave parked for their next turn (keep_prefixes streams)

    def _read_shape(self, model: torch.nn.Module) -> None:
        """The model's shape as the decode step needs it: heads, head size, vocabulary, family, each
        layer's window and cache, each layer's RoPE table."""
        config = model.config
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

    def _build_layer_functions(self, config, compile_layers: bool, fp8: bool) -> bool:
        """The fused projections (FP8 with ``fp8``) and the per-layer pure functions of the decode step (dense
        and / or MoE MLP), compiled or not; returns whether the step can be captured in a CUDA graph."""
        def fuse(*modules: torch.nn.Linear) -> Fused:
            ok = fp8 and fp8_shape_ok(sum(m.out_features for m in modules), modules[0].in_features)
            return Fp8Fused(modules) if ok else Fused(modules)
        self.qkv = [fuse(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in self.layers]
        self.o = [fuse(l.self_attn.o_proj) for l in self.layers]
        self.experts = [getattr(l.mlp, "experts", None) for l in self.layers]  # Qwen3-MoE layers; None: dense
        plain = [e is None for e in self.experts]
        self.gate_up = [fuse(l.mlp.gate_proj, l.mlp.up_proj) if d else None for l, d in zip(self.layers, plain)]
        self.down = [fuse(l.mlp.down_proj) if d else None for l, d in zip(self.layers, plain)]
        self.fused: list[Fused] = [f for f in self.qkv + self.o + self.gate_up + self.down if f is not None]
        self.fp8_units = sum(isinstance(f, Fp8Fused) for f in self.fused)  # how many GEMMs run on FP8 weights
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
        self._step_in = _DECODE.wrap(self.attn_in) if compile_layers else self.attn_in  # the ring layers
        # the full-length layers' first half also writes the step's K/V into the cache (one kernel with RoPE)
        self.attn_in_store = storing(self.attn_in, self.heads)
        self._step_store = _DECODE.wrap(self.attn_in_store) if compile_layers else self.attn_in_store
        # torch.compile traces grouped_mm for bf16 only (torch 2.13), and the experts loop syncs with the host:
        # other MoE layers run their second half eagerly
        compile_moe = self.grouped_experts and moe.experts.gate_up_proj.dtype == torch.bfloat16
        self._step_out = {k: _DECODE.wrap(f) if compile_layers and (k != "moe" or compile_moe) else f
                          for k, f in outs.items()}
        # grouped_mm's kernel is capturable in bf16 only: other dtypes run a fallback that reads the
        # offsets on the host (torch 2.11), as the experts loop does
        return moe is None or compile_moe

    @property
    def varlen(self) -> bool:
        """Whether the full-length layers attend with flash varlen; setting False selects masked SDPA."""
        return self.attention == "varlen"

    @varlen.setter
    def varlen(self, on: bool) -> None:
        if on and self.attention != "varlen":
            raise ValueError(f"FastDecoder: flash varlen does not run here (attention is {self.attention!r})")
        if not on:
            self.attention = "sdpa"

    # ------------------------------------------------------------------ forward pieces

    def _rms(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm with float32 statistics in one fused kernel (rounded once)."""
        return rms_norm(x, norm.weight, norm_eps(norm), self.family.norm_offset)

    def _in(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn: Callable, *lead) -> tuple:
        """Layer ``i``'s first half ``fn(*lead, x, ...)``: ``attn_in``, or ``attn_in_store`` (``lead``: the
        layer's flattened cache and the entries to write)."""
        norm, attn = self.layers[i].input_layernorm, self.layers[i].self_attn
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3, Gemma 3
        if qn is None:
            return fn(*lead, x, norm.weight, norm_eps(norm), self.qkv[i].operand(), self.qkv[i].bias, cos, sin)
        return fn(*lead, x, norm.weight, norm_eps(norm), self.qkv[i].operand(), self.qkv[i].bias, cos, sin,
                  qn.weight, kn.weight, norm_eps(qn))

    def _out(self, i: int, x: torch.Tensor, o: torch.Tensor, fns: dict[str, Callable],
             routes: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``i``'s second half; an MoE layer writes its tokens' experts into ``routes`` when given."""
        layer, kind, o_proj = self.layers[i], self.kind[i], self.o[i]
        if self.family.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output
            norms = (layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                     layer.post_feedforward_layernorm.weight)
        else:  # Llama-like: post_attention_layernorm is the MLP's input norm
            norms = (None, layer.post_attention_layernorm.weight, None)
        if kind == "moe":
            weights = (layer.mlp.gate.weight, layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)
            if routes is not None:
                weights += (routes,)
        else:
            weights = (self.gate_up[i].operand(), self.gate_up[i].bias, self.down[i].operand(), self.down[i].bias)
        return fns[kind](x, o, o_proj.operand(), o_proj.bias, norm_eps(layer.post_attention_layernorm), *norms, weights)

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
        """Layer ``i``'s K/V: ``[2, rows, slots, kv_heads, head_dim]`` (a ring: ``[2, rows, kv_heads, R, D]``)."""
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

    def _prefill(self, ids: torch.Tensor, pad: torch.Tensor, dest: torch.Tensor) -> None:
        """Prompts ``ids [b, P]`` (left-padded by ``pad [b]``) into cache rows ``dest [b]``, slots ``0..P-1``;
        the last position's logits go to the logits buffer's rows ``dest``."""
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
            if self._kv_of[i][0]:  # advanced indices [b, 1] x [1, n] first, then [Hkv, D]
                at = (dest[:, None], slice(None), (last % ring)[None, :])
                kv[0][at] = k[:, :, last].transpose(1, 2)
                kv[1][at] = v[:, :, last].transpose(1, 2)
            else:
                kv[0][dest, :length] = k.transpose(1, 2)
                kv[1][dest, :length] = v.transpose(1, 2)
            if self.group > 1:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[self.windows[i]], scale=self.scaling)
            x = self._out(i, x, o.transpose(1, 2).reshape(b, length, self.heads * self.head_dim), self.attn_out)
        scaled = self._logits(x[:, -1]).float().div_(self._temp)
        self._scaled[dest] = scaled
        self._lse[dest] = torch.logsumexp(scaled, dim=-1)

    # ------------------------------------------------------------------ generation

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def span(self, n: int) -> int:
        """The slots a step attends over when every write slot is below ``n``: a power of two from 128 on,
        at most the cache's length (one graph per bucket and span)."""
        return min(max(128, 1 << max(n - 1, 1).bit_length()), self._shape[1])

    def capture_graphs(self, *, temperature: float, top_k: int, top_p: float) -> int:
        """Capture the step of every batch bucket and attention span of the current cache for this sampling
        setting now (CUDA; after a call has sized the cache), so that no capture falls inside a later
        call; returns how many graphs were new."""
        if not self.use_graphs or self.cache is None:
            return 0
        mode = self.mode(temperature=temperature, top_k=top_k, top_p=top_p)
        spans, n = set(), 128
        while n < 2 * self._shape[1]:
            spans.add(self.span(n))
            n *= 2
        new = 0
        with sdpa_kernel(ATTENTION_BACKENDS):
            for rows in (b for b in self.buckets if b <= self._shape[0]):
                for span in sorted(spans):
                    if (rows, span, *mode) not in self._graphs:
                        self._capture(rows, span, mode)
                        new += 1
        return new

    def generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, eos: torch.Tensor, max_new_per_row: list[int] | None = None,
        interrupt: Callable[[int], bool] | None = None, look: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``NativeRollout._generate_chunk_hf``: ``tokens, mask, logprobs [b, t]`` and ``truncated [b]``,
        for any number of rows: at most ``max_batch`` decode at once and the others queue (in the order
        given) for the slots of finished rows. ``max_new_per_row``: each row's own most new tokens (each
        at most ``max_new_tokens``, which sizes the cache); a row that reaches it is truncated.
        ``interrupt(steps)``, called on the host after each decode step, ends the call there when it
        returns True (partial rollouts: the caller swaps weights and prefills the prefixes again); it
        needs every row in a slot from the start (at most ``max_batch`` rows), so that the rows still
        going all hold ``steps`` tokens. ``look(steps)``, called likewise, ends nothing (any number of rows)."""
        with sdpa_kernel(ATTENTION_BACKENDS):
            return self._generate_chunk(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                        max_new_tokens=max_new_tokens, generator=generator, eos=eos,
                                        max_new_per_row=max_new_per_row, interrupt=interrupt, look=look)

    def _generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, eos: torch.Tensor, max_new_per_row: list[int] | None,
        interrupt: Callable[[int], bool] | None = None, look: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, longest = len(rows), max(len(r) for r in rows)
        if interrupt is not None and b > self.buckets[-1]:
            raise ValueError(f"FastDecoder: an interruptible call takes at most {self.buckets[-1]} rows, not {b}")
        limits = [max_new_tokens] * b if max_new_per_row is None else [int(m) for m in max_new_per_row]
        if len(limits) != b or not all(1 <= m <= max_new_tokens for m in limits):
            raise ValueError(f"FastDecoder: max_new_per_row needs {b} values in [1, {max_new_tokens}]")
        cur = self.bucket(min(b, self.buckets[-1]))
        self._ensure_cache(cur, longest + max_new_tokens, b)
        spare = self._start_call(temperature=temperature, eos=eos)
        self._clear_outputs(torch.arange(b, device=self.device))
        if temperature > 0:  # each row's uniforms: the call's seed (one draw of the generator), its index, its prompt
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device))
            self._seed_rows(list(range(b)), [row_seed(seed, i, len(r)) for i, r in enumerate(rows)], limits)

        queue = list(range(b))[::-1]  # popped from the end: rows in the order given
        top = self._fill(list(range(min(cur, b))), queue, rows, limits)  # highest write slot so far
        mode = self.mode(temperature=temperature, top_k=top_k, top_p=top_p)
        span = self.span(top + self.check_every + 1)
        step = 0
        while True:
            self.decode_slots(cur, span, mode)
            step += 1
            if look is not None:
                look(step)
            if interrupt is not None and interrupt(step):
                break
            if step % self.check_every:
                continue
            finished = self._finished[:cur]
            n_live, top = torch.stack([(~finished).sum(), self._wpos[:cur].max()]).tolist()  # one host sync
            if n_live == 0 and not queue:
                break
            free = cur - n_live
            if queue and (n_live == 0 or free >= max(1, int(cur * self.refill_fraction))):
                slots = torch.nonzero(finished).squeeze(-1)[:len(queue)].tolist()
                top = max(top, self._fill(slots, queue, rows, limits))
                self.refills += 1
            elif not queue and self.bucket(n_live) < cur:
                cur = self._compact(cur, spare=spare)
            span = self.span(top + self.check_every + 1)
        mask = self._out_mask[:b]
        width = max(int(mask.sum(-1).max()), 1)
        tokens = self._out_tok[:b, :width].clone()
        last = tokens.gather(1, mask.sum(-1, keepdim=True).long().clamp_(min=1) - 1).squeeze(1)
        truncated = ~torch.isin(last, self._eos)  # a row ends at its first EOS, so no EOS last = no EOS at all
        return tokens, mask[:, :width].clone(), self._out_lp[:b, :width].clone(), truncated

    def routes(self, rows: int, width: int) -> torch.Tensor:
        """The last call's recorded experts ``[rows, width, MoE layers, top_k]`` (int16, -1 where no token):
        for output row ``r`` and column ``c``, the experts each MoE layer chose for the token sampled there
        (recorded by the forward that token fed; ``record_routes``)."""
        if not self.record_routes:
            raise RuntimeError("FastDecoder.routes: built without record_routes")
        return self._out_route[:rows, :width].clone()


__all__ = ["FastDecoder", "Fused", "batch_buckets", "unsupported_reason"]
