"""The ``rollout`` section of the run's config: the generation engine, sampling, the KV cache's batch,
what the rollout keeps between steps, partial rollouts, streamed groups, weight formats and the
benchmark workloads (as :mod:`.sections` is written: a docstring under every field, checks in
``__post_init__``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .checks import _check


@dataclass(kw_only=True)
class RolloutConfig:
    backend: Literal["native", "vllm"] = "native"
    """Generation engine: the built-in one (no extra dependency) or vLLM (the `vllm` extra)."""
    n: int = 4
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = 0.7
    """Sampling temperature; 0 means greedy. The trainer computes log-probs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = 24
    """Longest response in tokens; longer ones are cut and counted in response_length/clip_ratio."""
    ignore_eos: bool = False
    """Run every response to `rollout.max_new_tokens`, past any EOS token (fixed-length responses, for
    benchmarks; validation too)."""
    batch_size: int = 64
    """Sequences decoded at once per rank. Native backend: its KV-cache slots (each `longest prompt +
    rollout.max_new_tokens` long, checked against free memory before allocating); a rank's other rows
    queue and take the slot of the next finished row (continuous batching)."""
    dtype: Literal["auto", "fp8"] = "auto"
    """Weights of the rollout engine. `auto`: the model dtype (bf16 on CUDA, fp32 on CPU). `fp8` (built-in
    rollout): the attention and dense MLP projections' weights in FP8 e4m3 with one scale per output row,
    re-quantised at each weight sync, each token's activations quantised likewise, `torch._scaled_mm`
    (CUDA, compute capability 8.9+; on the CPU the same numbers, emulated); embeddings, norms, routed
    experts and `lm_head` stay in the model dtype. Halves the projections' memory; decode speed on an
    H200: docs/PERF.md. The log-prob gap to the trainer grows: see `algo.rollout_is`."""
    tp: int = 1
    """Tensor-parallel degree of the rollout engine (ranks of one tp group get the same prompts)."""
    pp: int = 1
    """Pipeline-parallel degree of the rollout engine."""
    compile_decode: bool = True
    """Native backend on CUDA: the decode step's layers through `torch.compile` inside its CUDA graph
    (one kernel for each norm, RoPE and the activation); the first rollout pays the compilation."""
    sleep_level: Literal[0, 1, 2] | None = None
    """After generation keep everything on the device (0: the next rollout neither reallocates its KV
    cache nor recaptures its CUDA graphs, and the update runs next to them), free the KV cache and
    graphs (1) or the KV cache and the weights (2: the native backend moves them to host memory on a
    GPU and drops them on the CPU, where the next weight sync writes them anyway). None = 2 on CPU runs,
    1 on GPUs. A rollout on its own pool never sleeps."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory it may take."""
    gpu_memory_fraction: float = 0.0
    """With `pools.colocate` > 1: the share of its GPU's memory a rollout-pool process may allocate
    (0 = an equal share, 1 / pools.colocate); the processes of the other pools on that GPU share the
    rest equally. Checked at start against the sum on each GPU."""
    max_model_len: int | None = None
    """vLLM: context length; None = max prompt length + max new tokens."""
    partial: bool = False
    """Partial rollouts (a rollout pool with `trainer.max_staleness` > 0): weights that arrive while
    the rollout pool generates are loaded between chunks of `rollout.partial_chunk` decode steps;
    unfinished responses keep their tokens and log-probs and continue under the new weights (their
    prefix prefilled again, so later log-probs are the new policy's), each token recording the policy
    version that sampled it. Off: new weights wait until the round being generated is done."""
    partial_chunk: int = 32
    """`rollout.partial` and `rollout.stage_weights`: decode steps between two looks for new weights
    (one store read each)."""
    stage_weights: bool = False
    """A rollout pool with `trainer.max_staleness` > 0, without `rollout.partial`: weights that arrive
    while the rollout generates are received at once into a staging copy (one more copy of the
    weights in each rollout rank's memory; skipped, with a warning, when it does not fit) and loaded
    when the round, or the stream's drain, ends. The actor goes on instead of waiting for the round
    in progress; what is generated with which weights does not change. Off: the transfer waits."""
    stream: bool = False
    """Stream groups (a rollout pool with `trainer.max_staleness` > 0, built-in rollout): the rollout
    pool generates every issued prompt in one continuous batch and sends each group (a prompt's
    `rollout.n` responses) to the actor pool as soon as it is complete; a step trains on the next
    `data.train_batch_size` complete groups, so a slow group does not hold up the others. Groups
    more than S versions old when taken are dropped and their prompts generated again. Off: a step
    trains on whole rounds, generated in order."""
    length_dist: Literal["model", "lognormal", "uniform"] = "model"
    """Benchmarks and tests: stop each response at a length drawn from this distribution between
    `rollout.min_new_tokens` and `rollout.max_new_tokens` (with `rollout.ignore_eos`, exactly that
    long; lognormal: median sqrt(min x max), 2 sigmas to either bound), a long-tailed workload with
    any model; `model`: the model ends its responses (built-in rollout only)."""
    min_new_tokens: int = 1
    """Shortest response `rollout.length_dist` draws."""
    token_delay_s: float = 0.0
    """Tests: seconds the built-in rollout sleeps after every decode step (a slow rollout on CPU)."""

    def __post_init__(self) -> None:
        _check(self.n >= 1, f"rollout.n must be >= 1, got {self.n}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               f"rollout.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"rollout.top_k must be >= 0, got {self.top_k}")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(self.batch_size >= 1, f"rollout.batch_size must be >= 1, got {self.batch_size}")
        _check(self.partial_chunk >= 1, f"rollout.partial_chunk must be >= 1, got {self.partial_chunk}")
        _check(1 <= self.min_new_tokens <= self.max_new_tokens, f"rollout.min_new_tokens ({self.min_new_tokens}) "
               f"must be in [1, rollout.max_new_tokens ({self.max_new_tokens})]")
        _check(self.token_delay_s >= 0, f"rollout.token_delay_s must be >= 0, got {self.token_delay_s}")
        _check(self.tp >= 1 and self.pp >= 1, f"rollout.tp ({self.tp}) and rollout.pp ({self.pp}) must be >= 1")
        _check(0 <= self.gpu_memory_fraction < 1,
               f"rollout.gpu_memory_fraction must be in [0, 1) (0 = automatic), got {self.gpu_memory_fraction}")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )

    def sleep_level_on(self, device_type: str) -> int:
        """The colocated rollout's `sleep_level` on this device type (None: 2 on the CPU, 1 on a GPU)."""
        return self.sleep_level if self.sleep_level is not None else (2 if device_type == "cpu" else 1)


__all__ = ["RolloutConfig"]
