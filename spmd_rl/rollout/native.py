"""The built-in rollout engine: batched sampling with a Hugging Face model, on CPU or GPU.

    engine = NativeRollout(folder, device=torch.device("cuda", 0), dtype=torch.bfloat16,
                           batch_size=64, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    out = engine.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256, seed=7)

It keeps its OWN copy of the model (eval mode, no grad), separate from the actor's; the trainer
streams the actor's weights into it with :meth:`NativeRollout.load_weights` before each rollout.

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

import gc
import inspect
import logging
from typing import Iterable

import torch
from transformers import DynamicCache

from ..compiled import triton_available
from ..models import load_causal_lm
from .base import GenerationOutput, check_sampling_args
from .fast import FastDecoder
from .layers import Fused, unsupported_reason
from .sampling import filter_logits, sample_next

log = logging.getLogger("spmd_rl")


class _Own:
    """A parameter or buffer that owns its storage, as :class:`~spmd_rl.rollout.fast.Fused` presents its
    tensors to ``sleep(2)`` / ``wake_up``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor.data]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        self.tensor.data = tensors[0]


class NativeRollout:
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
    ) -> None:
        """``compile_decode``: the fast path's decode layers through ``torch.compile`` (see
        :class:`FastDecoder`); None = where inductor makes triton kernels (CUDA), True also elsewhere."""
        if batch_size < 1:
            raise ValueError(f"rollout.batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
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
        # The fast path (spmd_rl/rollout/fast.py) reads the same parameters, so hot-swap reaches it too.
        self._fast: FastDecoder | None = None
        if fast_decode:
            reason = unsupported_reason(self.model)
            if reason is None:
                compile_layers = triton_available(self.device) if compile_decode is None else compile_decode
                self._fast = FastDecoder(self.model, device=self.device, max_batch=batch_size,
                                         pad_token_id=self.pad_token_id, compile_layers=compile_layers)
            else:
                log.warning("NativeRollout: fast decode is off (%s); using the Hugging Face decode loop", reason)
        # What sleep(2) moves: the fast path's fused tensors (its parameters are views of them), then every
        # other parameter / buffer once (tied weights are one tensor).
        fused = self._fast.fused if self._fast is not None else []
        in_fused = {id(p) for unit in fused for p in unit.parameters()}
        unique = {id(t): t for t in self._targets.values() if id(t) not in in_fused}
        self._storage: list[Fused | _Own] = [*fused, *(_Own(t) for t in unique.values())]

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
    ) -> GenerationOutput:
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
        # the fast path takes every row at once and keeps batch_size of them decoding (continuous batching);
        # the Hugging Face loop runs chunks of batch_size rows
        chunk = len(rows) if self._fast is not None else self.batch_size
        pieces = []
        for start in range(0, len(rows), chunk):
            idx = order[start:start + chunk]
            pieces.append((idx, self._generate_chunk([rows[r] for r in idx], temperature=temperature,
                                                     top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
                                                     generator=generator)))
        width = max(tokens.shape[1] for _, (tokens, _, _, _) in pieces)
        out_tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        out_mask = torch.zeros(len(rows), width, dtype=torch.float32)
        out_logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
        out_truncated = torch.zeros(len(rows), dtype=torch.bool)
        for idx, (tokens, mask, logprobs, truncated) in pieces:
            where = torch.tensor(idx, dtype=torch.long)
            t = tokens.shape[1]
            out_tokens[where, :t] = tokens.cpu()
            out_mask[where, :t] = mask.cpu()
            out_logprobs[where, :t] = logprobs.cpu()
            out_truncated[where] = truncated.cpu()
        return GenerationOutput(prompt_ids=rows, response_ids=out_tokens, response_mask=out_mask,
                                logprobs=out_logprobs, truncated=out_truncated)

    def _generate_chunk(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generate for one chunk; returns ``tokens, mask, logprobs [b, t]`` and ``truncated [b]`` (on device)."""
        if self._fast is not None:
            return self._fast.generate_chunk(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                             max_new_tokens=max_new_tokens, generator=generator, eos=self._eos)
        return self._generate_chunk_hf(rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                       max_new_tokens=max_new_tokens, generator=generator)

    def _generate_chunk_hf(
        self, rows: list[list[int]], *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
        generator: torch.Generator,
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
        steps = 0
        for step in range(max_new_tokens):
            tok, lp = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            live = ~finished
            tokens[:, step] = torch.where(live, tok, self.pad_token_id)
            logprobs[:, step] = torch.where(live, lp, 0.0)
            mask[:, step] = live.float()
            finished |= torch.isin(tok, self._eos)
            steps = step + 1
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(b, 1)], dim=1)
            logits = self._decode_step(tokens[:, step:step + 1], attention_mask, next_pos, cache)
            next_pos = next_pos + 1
        return tokens[:, :steps], mask[:, :steps], logprobs[:, :steps], ~finished

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

    # ------------------------------------------------------------------ weights and memory

    @property
    def needs_weights(self) -> bool:
        """Never: a level-2 sleep keeps the weights in host memory."""
        return False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, full_tensor)`` pairs into the model, casting dtype and device.

        For tied embeddings either ``lm_head.weight`` or ``model.embed_tokens.weight`` may be sent
        (or both); they are the same tensor here.
        """
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._targets.get(name)
                if target is None:
                    valid = list(self._targets)
                    raise KeyError(f"NativeRollout.load_weights: unknown weight {name!r}; the model has "
                                   f"{len(valid)} names such as {valid[:4]}")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"NativeRollout.load_weights: {name} has shape {tuple(tensor.shape)}, "
                                     f"the rollout model expects {tuple(target.shape)}")
                target.copy_(tensor)

    def sleep(self, level: int) -> None:
        """0: keep everything on the device (a no-op: the next rollout reuses the KV cache and the
        captured CUDA graphs); 1: free the KV cache and the CUDA graphs; 2: also move the weights to
        (pinned) host memory.

        The freed memory goes back to torch's caching allocator, where the colocated actor's passes
        reuse it; the cache is not emptied to the driver, so the next rollout does not allocate afresh
        (on the H200 that was ~0.3 s of a SmolLM2 step, docs/PERF.md). The released graphs' private
        pool stays reserved until torch empties its cache (it does so by itself before failing an
        allocation)."""
        if level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level must be 0, 1 or 2, got {level}")
        if level == 0:
            return
        if self._fast is not None:
            self._fast.release()
        if level == 2 and self._sleep_level < 2:
            if self._host_copies is None:
                pin = self.device.type == "cuda"
                self._host_copies = [[torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                                      for t in unit.tensors()] for unit in self._storage]
            for unit, hosts in zip(self._storage, self._host_copies):
                for t, host in zip(unit.tensors(), hosts):
                    host.copy_(t, non_blocking=True)
            self._synchronize()
            for unit, hosts in zip(self._storage, self._host_copies):
                unit.replace(hosts)
        self._sleep_level = max(self._sleep_level, level)

    def wake_up(self) -> None:
        """Bring the weights back to the device (after ``sleep(2)``) and reallocate the fast path's KV
        cache (its CUDA graphs are recaptured on first use); a no-op when awake."""
        if self._sleep_level == 2:
            for unit in self._storage:
                unit.replace([t.to(self.device, non_blocking=True) for t in unit.tensors()])
            self._synchronize()
        if self._sleep_level and self._fast is not None:
            self._fast.restore()
        self._sleep_level = 0

    def close(self) -> None:
        if self._fast is not None:
            self._fast.release()
        self._targets, self._storage, self._host_copies, self._fast = {}, [], None, None
        self.model = None  # type: ignore[assignment]
        self._free_cached_memory()

    def _check_awake(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"NativeRollout.{what}: the engine was closed")
        if self._sleep_level:
            raise RuntimeError(f"NativeRollout.{what}: the engine is asleep (level {self._sleep_level}); "
                               "call wake_up() first")

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_cached_memory(self) -> None:
        if self.device.type == "cuda":
            gc.collect()  # tensors held only by reference cycles go before the cache is emptied
            torch.cuda.empty_cache()


__all__ = ["NativeRollout", "filter_logits", "sample_next"]
