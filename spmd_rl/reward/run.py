"""The run's reward on the global pool: rule score + ``reward.model.weight`` x reward-model score.

    reward = build_run_reward(reward=cfg.reward, task=cfg.data.task, system_prompt=cfg.data.system_prompt,
                              actor_tokenizer=tok, group=pool.group, mesh=actor_mesh,
                              exchange=groups.exchange, device=env.device, cache_dir=cfg.model.cache_dir)
    result = reward(samples, completions, prompt_ids, response_ids)   # ScoreResult, on every global rank

Without ``reward.model.path`` this is the rule scorer alone (``reward.fn``). With it, the reward
model scores every response: on the reward pool (``pools.reward_ranks`` > 0, through the run's
:class:`~spmd_rl.reward.server.RewardLink`) or colocated on the global pool (FSDP over the actor's
mesh). Scoring is collective over the global pool, so every rank calls it, with its own rows
(possibly none); an error on any rank, or on the reward pool, stops every global rank.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmd_rl.config import RewardConfig
from spmd_rl.data.tasks import columns_of
from spmd_rl.distributed.comm import fail_together
from spmd_rl.models import load_tokenizer
from spmd_rl.reward.model import ColocatedModelReward, RewardInputs, RewardModel, resolve_reward_model
from spmd_rl.reward.registry import Scorer, ScoreResult, build_scorer
from spmd_rl.reward.server import RemoteModelReward, RewardLink


class ModelReward(Protocol):
    def check(self, rows: Sequence[Sequence[int]]) -> None: ...

    def score(self, rows: Sequence[Sequence[int]]) -> list[float]: ...


class RunReward:
    """Callable scorer of a batch of responses on the global pool (see the module docstring)."""

    def __init__(self, *, scorer: Scorer, model: ModelReward | None = None, inputs: RewardInputs | None = None,
                 weight: float = 1.0, group: dist.ProcessGroup | None = None) -> None:
        if (model is None) != (inputs is None):
            raise ValueError("RunReward needs both the reward model and its inputs, or neither")
        self.scorer = scorer
        self.model = model
        self.inputs = inputs
        self.weight = weight
        self.group = group

    def __call__(self, samples: Sequence[Any], completions: Sequence[str], prompt_ids: Sequence[Sequence[int]],
                 response_ids: Sequence[Sequence[int]]) -> ScoreResult:
        """Scores of this rank's responses. ``response_ids``: the generated tokens only (no padding)."""
        rows: list[list[int]] = []
        if self.model is not None:
            assert self.inputs is not None
            with fail_together(group=self.group, what="reward model inputs"):
                rows = self.inputs.rows(samples, prompt_ids, response_ids, completions)
                self.model.check(rows)
        model_scores = None
        with fail_together(group=self.group, what="reward scoring"):
            if self.model is not None:  # collective (reward pool round or colocated FSDP): first, on every rank
                model_scores = self.model.score(rows)
            result = self.scorer([s.prompt for s in samples], list(completions), columns_of(samples))
        if model_scores is not None:
            result.scores = [s + self.weight * m for s, m in zip(result.scores, model_scores)]
            result.model_scores = model_scores
        return result


def build_run_reward(*, reward: RewardConfig, task: str, system_prompt: str | None, actor_tokenizer: Any,
                     group: dist.ProcessGroup | None, mesh: DeviceMesh | None, exchange: RewardLink | None,
                     device: torch.device, cache_dir: str | None) -> RunReward:
    """The run's reward for a global-pool rank: remote when ``exchange`` is given (a reward pool
    exists), else colocated over ``mesh`` when ``reward.model.path`` is set, else rules only."""
    scorer = build_scorer(fn=reward.fn, task=task, format_weight=reward.format_weight, on_error=reward.on_error,
                          timeout_s=reward.timeout_s)
    rm = reward.model
    if rm.path is None:
        return RunReward(scorer=scorer, group=group)
    folder = resolve_reward_model(rm, cache_dir=cache_dir)
    inputs = RewardInputs.choose(
        input=rm.input, actor_tokenizer=actor_tokenizer,
        rm_tokenizer=load_tokenizer(folder, trust_remote_code=rm.trust_remote_code),
        system_prompt=system_prompt, max_length=rm.max_length)
    model: ModelReward
    if exchange is not None:
        model = RemoteModelReward(exchange)
    else:
        if mesh is None:
            raise ValueError("a colocated reward model needs the global pool's FSDP mesh")
        model = ColocatedModelReward(
            RewardModel(folder=folder, mesh=mesh, device=device, micro_batch_size=rm.micro_batch_size,
                        param_offload=rm.param_offload, trust_remote_code=rm.trust_remote_code),
            group=group)
    return RunReward(scorer=scorer, model=model, inputs=inputs, weight=rm.weight, group=group)


__all__ = ["ModelReward", "RunReward", "build_run_reward"]
