"""The pieces the episode tests share: the tiny random model's rollout engine and tokenizer, and the
actor's fp32 log-probs of a round of episodes (what the trainer computes of them)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_rollout(batch_size: int = 4) -> tuple[str, Any, list[int], int, Any]:
    """``(folder, tokenizer, eos ids, pad id, native engine)`` of ``tiny-random``, fp32 on the CPU."""
    from spmd_rl.models import eos_token_ids, load_tokenizer, resolve_model_path
    from spmd_rl.rollout import build_rollout

    folder = str(resolve_model_path("tiny-random", cache_dir=None))
    tok = load_tokenizer(folder, trust_remote_code=False)
    eos, pad = eos_token_ids(tok), int(tok.pad_token_id)
    engine = build_rollout("native", model_folder=folder, device=torch.device("cpu"), dtype=torch.float32,
                           batch_size=batch_size, pad_token_id=pad, eos_token_ids=eos, trust_remote_code=False)
    return folder, tok, eos, pad, engine


def actor_logprobs(out: dict[str, torch.Tensor], folder: str, pad: int, *, packed: bool = True) -> torch.Tensor:
    """The actor's (FSDP engine, one rank, fp32) log-probs ``[B, T]`` of a round of episodes' rows."""
    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.source.rollout import episode_prompts

    batch = RolloutBatch(prompts=episode_prompts(out), tensors={
        "response_ids": out["response_ids"], "response_mask": out["response_mask"],
        "context_mask": out["context_mask"], "rollout_logprobs": out["logprobs"]})
    actor = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                       fsdp=FsdpConfig(), actor=ActorConfig(use_packing=packed), total_updates=1, trainable=False,
                       pad_token_id=pad, compute_dtype=None)
    return actor.compute_logprobs(batch, temperature=1.0, micro_batch_size=2)[0]
