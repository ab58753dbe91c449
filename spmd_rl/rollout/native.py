"""The built-in rollout engine: batched sampling with a Hugging Face model, on CPU or GPU.

    engine = NativeRollout(folder, device=torch.device("cuda", 0), dtype=torch.bfloat16,
                           batch_size=64, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    out = engine.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256, seed=7)

It keeps its OWN copy of the model (eval mode, no grad), separate from the actor's; the trainer
streams the actor's weights into it with :meth:`NativeRollout.load_weights` before each rollout. On
the CPU a level-2 sleep drops that copy until the next load (the CPU runs' default, docs/PERF.md).

How a call runs: the ``len(prompts) * n`` rows are sorted by prompt length (less padding). The fast
path takes them all at once and keeps ``batch_size`` of them decoding: a finished row's slot takes
the next queued row (continuous batching, :mod:`spmd_rl.rollout.fast`). The Hugging Face loop cuts
them into chunks of ``batch_size``; each chunk is LEFT-padded and prefilled once with an attention
mask and ``position_ids = cumsum(mask) - 1``, so a prompt gets the same positions as it would alone;
then one token at a time is decoded over a KV cache. Sampling happens on the device with one
``torch.Generator`` seeded by ``seed``; the same seed, rows and ``batch_size`` give the same
responses (on one device type). A row stops at its first EOS id and gets pad tokens afterwards (with no EOS ids, as
``rollout.ignore_eos`` gives, every row runs to ``max_new_tokens``); the chunk stops when every row
has stopped.

Partial rollouts (``swap``, see :meth:`NativeRollout.generate`): every ``swap_every`` decode steps
the engine asks its caller whether new weights were loaded; if so, the rows of the chunk that are
still going stop there, keep their tokens and log-probs, and continue from their prefix (prompt +
tokens so far, prefilled again under the new weights, so every later log-prob is the new policy's
exactly); ``GenerationOutput.weight_swaps`` says how many swaps preceded each token. Chunks that
start after a swap use the new weights from their first token.

Benchmark workloads: ``length_dist`` stops each response at a length drawn for it
(:mod:`spmd_rl.rollout.lengths`, seeded by the call's seed) and ``token_delay_s`` sleeps after every
decode step (a slow rollout on CPU, for tests of the overlap).

Two decode loops, the same outputs (greedy: token for token; tests/test_rollout_fast.py):

* the fast path (:mod:`spmd_rl.rollout.fast`, on by default for the families of
  :data:`spmd_rl.models.families.FAMILIES`: Llama 3.x, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3 text; CPU
  and GPU): slot-based KV cache, continuous batching, the decode step as a CUDA graph per batch
  bucket and attention span (its layers compiled on CUDA), finished rows compacted into smaller
  buckets once the queue is empty. ``sleep`` frees its cache and graphs, ``wake_up`` reallocates;
* the Hugging Face loop (``fast_decode=False``, or another model type; one warning names what made
  the model fall back): ``DynamicCache`` and :meth:`NativeRollout._decode_step`.

Log-probs (must match the trainer's recomputation): ``log_softmax(logits / T)`` at the chosen token,
``T = temperature`` or 1.0 when greedy (temperature 0), over the FULL vocabulary, i.e. BEFORE top-k /
top-p filtering, in float32.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Callable, Hashable

import torch
from transformers import DynamicCache

from ..compiled import triton_available
from ..models import load_causal_lm
from .base import GenerationOutput, check_sampling_args
from .fast import FastDecoder
from .fp8 import fp8_works
from .layers import Fp8Fused, Fused, unsupported_reason
from .lengths import LengthDist, draw_lengths
from .sampling import filter_logits, sample_next
from .stream import Done, Feed, StreamEngine, run_stream
from .weights import OwnTensor, RolloutWeights

log = logging.getLogger("spmd_rl")


class NativeRollout(RolloutWeights):
    """Rollout engine built on a plain Hugging Face causal LM (see the module docstring)."""

    def __init__(
        self,
        model_folder: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        batch_size: int,
        pad_token_id: int,
        eos_token_ids: list[int],
        trust_remote_code: bool = False,
        fast_decode: bool = True,
        compile_decode: bool | None = None,
        length_dist: LengthDist = "model",
        min_new_tokens: int = 1,
        token_delay_s: float = 0.0,
        record_routes: bool = False,
        fp8: bool = False,
    ) -> None:
        """``compile_decode``: the fast path's decode layers through ``torch.compile`` (see
        :class:`FastDecoder`); None = where inductor makes triton kernels (CUDA), True also elsewhere.
        ``length_dist`` / ``min_new_tokens`` / ``token_delay_s``: benchmark workloads (module docstring).
        ``record_routes``: ``generate`` returns each generated token's experts in every MoE layer
        (``GenerationOutput.routed_experts``, router replay); it needs the fast path. ``fp8``
        (``--rollout.dtype fp8``): the fast path's projections hold FP8 weights, re-quantised at each
        :meth:`load_weights` (:class:`~spmd_rl.rollout.layers.Fp8Fused`); it needs the fast path."""
        if batch_size < 1:
            raise ValueError(f"rollout.batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.dtype = dtype
        why = fp8_works(self.device, dtype) if fp8 else None
        if why is not None:
            raise ValueError(f"--rollout.dtype fp8: {why}; leave --rollout.dtype auto")
        self.batch_size = batch_size
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.length_dist, self.min_new_tokens, self.token_delay_s = length_dist, min_new_tokens, token_delay_s
        model = load_causal_lm(model_folder, dtype=dtype, trust_remote_code=trust_remote_code)
        model.requires_grad_(False)
        self.model = model.to(self.device)
        self.max_positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        # Prefill needs only the last position's logits; older/remote-code models may lack the switch.
        takes_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if takes_keep else {}
        # HF name -> the tensor to copy into; tied weights appear under every name they have.
        self._targets: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        self._targets.update(self.model.named_buffers(remove_duplicate=False))
        self._host_copies: list[list[torch.Tensor]] | None = None  # per storage unit, kept across sleeps
        self._sleep_level = 0
        # On the CPU a level-2 sleep drops the parameters (the host is the device: a host copy would be a
        # second copy): the ids of those not loaded since, and the storage units that gave their memory back
        self._dropped: set[int] = set()
        self._dropped_units: list[Fused | OwnTensor] = []
        # The fast path (spmd_rl/rollout/fast.py) reads the same parameters, so hot-swap reaches it too.
        self._fast = self._build_fast(fast_decode, compile_decode, record_routes=record_routes, fp8=fp8)
        self.record_routes = record_routes
        self._index_storage()

    def _build_fast(self, fast_decode: bool, compile_decode: bool | None, *, record_routes: bool,
                    fp8: bool) -> FastDecoder | None:
        """The fast decoder over this engine's model, or None (the Hugging Face loop) where it does not run;
        router replay and FP8 weights need it."""
        fast, reason = None, "fast_decode is off"
        if fast_decode:
            reason = unsupported_reason(self.model)
            if reason is None:
                compile_layers = triton_available(self.device) if compile_decode is None else compile_decode
                fast = FastDecoder(self.model, device=self.device, max_batch=self.batch_size,
                                   pad_token_id=self.pad_token_id, compile_layers=compile_layers,
                                   record_routes=record_routes, fp8=fp8)
            else:
                log.warning("NativeRollout: fast decode is off (%s); using the Hugging Face decode loop", reason)
        if record_routes and fast is None:
            raise ValueError("--actor.router-replay records the experts in the built-in rollout's fast decode, which "
                             f"does not run this model ({reason})")
        if fp8 and fast is None:
            raise ValueError("--rollout.dtype fp8 runs the built-in rollout's fast decode, which does not run this "
                             f"model ({reason}); leave --rollout.dtype auto")
        if fp8 and not fast.fp8_units:
            raise ValueError("--rollout.dtype fp8: none of this model's projections has widths that are multiples of "
                             "16, which the scaled FP8 GEMM needs; leave --rollout.dtype auto")
        return fast

    def _index_storage(self) -> None:
        """``_quantized`` (an HF weight name -> the FP8 unit that quantises it into its rows, and its module)
        and ``_storage``, what sleep(2) moves: the fast path's fused tensors (its parameters are views of
        them), then every other parameter / buffer once (tied weights are one tensor)."""
        fused = self._fast.fused if self._fast is not None else []
        of = {id(m.weight): (u, m) for u in fused if isinstance(u, Fp8Fused) for m in u.modules}
        self._quantized: dict[str, tuple[Fp8Fused, torch.nn.Module]] = {
            name: of[id(t)] for name, t in self._targets.items() if id(t) in of}
        in_fused = {id(p) for unit in fused for p in unit.parameters()}
        unique = {id(t): t for t in self._targets.values() if id(t) not in in_fused}
        self._storage: list[Fused | OwnTensor] = [*fused, *(OwnTensor(t) for t in unique.values())]

    # ------------------------------------------------------------------ generation

    @torch.no_grad()  # not inference_mode: the trainer multiplies these outputs into its autograd graph
    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_tokens: int,
        seed: int,
        swap: Callable[[], bool] | None = None,
        swap_every: int = 32,
        look: Callable[[], None] | None = None,
    ) -> GenerationOutput:
        """``swap``: partial rollouts; called between pieces of ``batch_size`` rows and every
        ``swap_every`` decode steps, it loads new weights into this engine when there are some and
        returns True then (see the module docstring). ``look``: called every ``swap_every`` decode
        steps, never interrupts (``rollout.stage_weights``: the server receives weights meanwhile)."""
        check_sampling_args(prompt_ids, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new_tokens)
        self._check_awake("generate")
        longest = max(len(p) for p in prompt_ids)
        if self.max_positions is not None and longest + max_new_tokens > self.max_positions:
            raise ValueError(
                f"longest prompt ({longest} tokens) + rollout.max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's max_position_embeddings ({self.max_positions}); lower data.max_prompt_length or "
                "rollout.max_new_tokens"
            )
        rows = [list(p) for p in prompt_ids for _ in range(n)]
        order = sorted(range(len(rows)), key=lambda r: -len(rows[r]))  # stable: equal prompts stay together
        generator = torch.Generator(device=self.device).manual_seed(seed)
        limits = (draw_lengths(self.length_dist, count=len(rows), low=min(self.min_new_tokens, max_new_tokens),
                               high=max_new_tokens, seed=seed) if self.length_dist != "model" else None)
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "generator": generator}
        self._swaps = 0  # weight swaps so far in this call
        # the fast path takes every row at once and keeps batch_size of them decoding (continuous batching);
        # the Hugging Face loop, and partial rollouts (whose interrupted rows must all hold the same number
        # of tokens), run pieces of batch_size rows
        whole = self._fast is not None and swap is None and not self.token_delay_s
        piece = len(rows) if whole else self.batch_size
        pieces = []
        for start in range(0, len(rows), piece):
            if swap is not None and start and swap():  # new weights between pieces: no prefix to prefill again
                self._swaps += 1
            idx = order[start:start + piece]
            pieces.append((idx, self._generate_piece([rows[r] for r in idx], limits=limits and [limits[r] for r in idx],
                                                     max_new_tokens=max_new_tokens, swap=swap, swap_every=swap_every,
                                                     look=look, **sampling)))
        width = max(max(int(out[1].sum(1).max()), 1) for _, out in pieces)
        out_tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        out_mask = torch.zeros(len(rows), width, dtype=torch.float32)
        out_logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
        out_swaps = torch.zeros(len(rows), width, dtype=torch.long)
        out_truncated = torch.zeros(len(rows), dtype=torch.bool)
        out_routes = self._no_routes(len(rows), width)
        for idx, (tokens, mask, logprobs, swaps, truncated, routes) in pieces:
            where = torch.tensor(idx, dtype=torch.long)
            t = min(tokens.shape[1], width)
            out_tokens[where, :t] = tokens[:, :t]
            out_mask[where, :t] = mask[:, :t]
            out_logprobs[where, :t] = logprobs[:, :t]
            out_swaps[where, :t] = swaps[:, :t]
            out_truncated[where] = truncated
            if routes is not None:
                out_routes[where, :t] = routes[:, :t]
        return GenerationOutput(prompt_ids=rows, response_ids=out_tokens, response_mask=out_mask,
                                logprobs=out_logprobs, truncated=out_truncated,
                                weight_swaps=out_swaps if swap is not None else None, routed_experts=out_routes)

    def _no_routes(self, rows: int, width: int) -> torch.Tensor | None:
        """``[rows, width, MoE layers, top_k]`` of -1 (no token) when recording routes, else None."""
        if not self.record_routes:
            return None
        return torch.full((rows, width, len(self._fast.moe_layers), self._fast.top_k), -1, dtype=torch.int16)

    @torch.no_grad()
    def stream(self, *, feed: Feed, done: Done, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
               max_prompt_length: int, seed: int, swap: Callable[[], bool] | None = None, swap_every: int = 32,
               look: Callable[[], None] | None = None, keep_prefixes: bool = False) -> int:
        """Generate rows as ``feed`` gives them and hand each to ``done`` as it finishes, until the feed
        is dry and no row is live (:mod:`spmd_rl.rollout.stream`); returns the weight swaps made.
        ``swap`` and ``look`` as in :meth:`generate`. ``keep_prefixes``: on the fast path a finished
        row's K/V stays parked under its key until its slot is needed, and a row fed again under that
        key that extends it prefills only its new tokens (:mod:`spmd_rl.rollout.prefixes`; multi-turn
        episodes, whose keys are episodes); :meth:`forget_prefixes` when the keys are done. On the fast
        path a sampled row draws from its own uniforms, seeded by ``seed``, its key and its prompt's
        length: the same rows sample the same tokens whenever the feed gives them."""
        check_sampling_args([[0]], n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
        self._check_awake("stream")
        if self.max_positions is not None and max_prompt_length + max_new_tokens > self.max_positions:
            raise ValueError(
                f"data.max_prompt_length ({max_prompt_length}) + rollout.max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's max_position_embeddings ({self.max_positions}); lower one of them")
        engine = StreamEngine(device=self.device, batch_size=self.batch_size, eos=self._eos, fast=self._fast,
                              generate_hf=self._generate_chunk_hf, length_dist=self.length_dist,
                              min_new_tokens=self.min_new_tokens, token_delay_s=self.token_delay_s)
        return run_stream(engine, feed=feed, done=done, temperature=temperature, top_p=top_p, top_k=top_k,
                          max_new_tokens=max_new_tokens, max_prompt_length=max_prompt_length, seed=seed, swap=swap,
                          swap_every=swap_every, look=look, keep_prefixes=keep_prefixes)

    def forget_prefixes(self, *keys: Hashable) -> None:
        """Drop what ``keep_prefixes`` streams left parked under ``keys`` (not fed again), or all of it."""
        if self._fast is not None:
            self._fast.forget_prefixes(*keys)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens that ``keep_prefixes`` streams did not prefill again (0 without the fast path)."""
        return self._fast.reused_tokens if self._fast is not None else 0

    def take_reused_tokens(self, key: Hashable) -> int:
        """Of those, ``key``'s since the last take (an episode's: ``env/prefill_reused_frac``)."""
        return self._fast.take_reused(key) if self._fast is not None else 0

    def _generate_piece(
        self, rows: list[list[int]], *, limits: list[int] | None, max_new_tokens: int,
        swap: Callable[[], bool] | None, swap_every: int, look: Callable[[], None] | None, **sampling,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One piece of at most ``batch_size`` rows: ``tokens, mask, logprobs, swaps [b, max_new_tokens]``,
        ``truncated [b]`` and the recorded experts (``[b, max_new_tokens, MoE layers, k]``, or None) on the
        CPU. Interrupted by a weight swap, the rows still going continue from their prefix (they all
        hold the same number of tokens: they started together and none has stopped); the experts of
        the tokens before the swap stay those that sampled them."""
        b = len(rows)
        tokens = torch.full((b, max_new_tokens), self.pad_token_id, dtype=torch.long)
        mask, logprobs = torch.zeros(b, max_new_tokens), torch.zeros(b, max_new_tokens)
        swaps, truncated = torch.zeros(b, max_new_tokens, dtype=torch.long), torch.ones(b, dtype=torch.bool)
        routes = self._no_routes(b, max_new_tokens)
        live, done = list(range(b)), 0  # the rows still going, and the tokens each of them holds

        def looked(steps: int) -> None:
            if steps % swap_every == 0:
                look()

        while True:
            budget = max_new_tokens - done
            swapped: list[int] = []

            def interrupt(steps: int, budget: int = budget, swapped: list[int] = swapped) -> bool:
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)  # the benchmark's slow rollout, not a wait for anything
                if swap is None or steps % swap_every or steps >= budget or not swap():
                    return False
                swapped.append(steps)
                return True

            chunk = self._generate_chunk(
                [rows[i] + tokens[i, :done].tolist() for i in live], max_new_tokens=budget,
                limits=None if limits is None else torch.tensor([limits[i] - done for i in live]),
                interrupt=interrupt if swap is not None or self.token_delay_s else None,
                look=None if look is None else looked, **sampling)
            t_tok, t_mask, t_lp, t_trunc = (x.cpu() for x in chunk)
            where, width = torch.tensor(live, dtype=torch.long), t_tok.shape[1]
            tokens[where, done:done + width] = t_tok
            mask[where, done:done + width] = t_mask
            logprobs[where, done:done + width] = t_lp
            swaps[where, done:done + width] = self._swaps
            truncated[where] = t_trunc
            if routes is not None:  # the chunk's rows are its first output rows, in the order given
                routes[where, done:done + width] = self._fast.routes(len(live), width).cpu()
            if not swapped:
                return tokens, mask, logprobs, swaps, truncated, routes
            self._swaps += 1
            lengths = t_mask.sum(1).long().tolist()
            done += width
            live = [i for k, i in enumerate(live) if t_trunc[k] and lengths[k] == width
                    and done < (max_new_tokens if limits is None else limits[i])]
            if not live:
                return tokens, mask, logprobs, swaps, truncated, routes

    def _generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, limits: torch.Tensor | None = None, interrupt: Callable[[int], bool] | None = None,
        look: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generate for one chunk; returns ``tokens, mask, logprobs [b, t]`` and ``truncated [b]`` (on device).
        ``limits [b]``: most tokens per row; ``interrupt(steps)`` True ends the chunk after that step;
        ``look(steps)`` is called after every decode step and ends nothing."""
        if self._fast is not None:
            return self._fast.generate_chunk(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                             max_new_tokens=max_new_tokens, generator=generator, eos=self._eos,
                                             max_new_per_row=None if limits is None else limits.tolist(),
                                             interrupt=interrupt, look=look)
        return self._generate_chunk_hf(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                       max_new_tokens=max_new_tokens, generator=generator, limits=limits,
                                       interrupt=interrupt, look=look)

    def _generate_chunk_hf(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator, limits: torch.Tensor | None = None, interrupt: Callable[[int], bool] | None = None,
        look: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Hugging Face loop: left-padded prefill, then :meth:`_decode_step` over a ``DynamicCache``."""
        b, longest = len(rows), max(len(r) for r in rows)
        input_ids = torch.full((b, longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(b, longest, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, longest - len(r):] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, longest - len(r):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)

        cache = DynamicCache(config=self.model.config)
        logits = self._prefill(input_ids, attention_mask, position_ids, cache)
        next_pos = position_ids[:, -1:] + 1  # [b, 1] position of the first generated token

        tokens = torch.full((b, max_new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=self.device)
        mask = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=self.device)
        finished = torch.zeros(b, dtype=torch.bool, device=self.device)
        ended = torch.zeros(b, dtype=torch.bool, device=self.device)  # by an EOS
        limits = None if limits is None else limits.to(self.device)
        steps = 0
        for step in range(max_new_tokens):
            tok, lp = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            live = ~finished
            tokens[:, step] = torch.where(live, tok, self.pad_token_id)
            logprobs[:, step] = torch.where(live, lp, 0.0)
            mask[:, step] = live.float()
            ended |= live & torch.isin(tok, self._eos)
            finished |= torch.isin(tok, self._eos)
            if limits is not None:
                finished |= limits <= step + 1
            steps = step + 1
            if look is not None:
                look(steps)
            if step == max_new_tokens - 1 or bool(finished.all()) or (interrupt is not None and interrupt(steps)):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(b, 1)], dim=1)
            logits = self._decode_step(tokens[:, step:step + 1], attention_mask, next_pos, cache)
            next_pos = next_pos + 1
        return tokens[:, :steps], mask[:, :steps], logprobs[:, :steps], ~ended

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: DynamicCache) -> torch.Tensor:
        """Run the prompts through the model, filling ``cache``; return last-position logits ``[b, V]``."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, **self._last_logits_only)
        return out.logits[:, -1].float()

    def _decode_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     cache: DynamicCache) -> torch.Tensor:
        """One decode step: ``input_ids [b, 1]`` at ``position_ids [b, 1]`` -> next-token logits ``[b, V]``.

        ``attention_mask [b, cached + 1]`` masks the left padding. The Hugging Face loop only; the fast
        path has its own step (:meth:`spmd_rl.rollout.fast.FastDecoder._step_body`).
        """
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()


__all__ = ["NativeRollout", "filter_logits", "sample_next"]
