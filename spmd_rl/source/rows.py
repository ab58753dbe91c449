"""From a round's rows to a scored batch: the step's prompts, the response metrics, the score.

    prompts = StepPrompts(sampler, train_ids, group=g, src=0, is_controller=rank == 0, rollout=cfg.rollout, seed=s)
    indices = prompts.draw()                        # collective over the actor pool: rank 0 draws
    batch = to_batch(rows, prompts.ids, place=place, n=n, acc=acc)   # with response_length/*, perf/gen_tokens
    scorer(batch, acc, weight=w)                     # batch["scores"], critic/score/*, reward/*
    staleness(batch, rows.out, version=v, max_staleness=S, weight=w, acc=acc)   # asynchronous rows

Each function reads what it needs as arguments; none of them knows whether the rows came from a
colocated rollout, a round issued ahead or streamed groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from spmd_rl.data.batch import RolloutBatch
from spmd_rl.models.tokenizer import decode_tokens, response_tokens
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.distributed.comm import broadcast_object
from spmd_rl.metrics import MetricAccumulator
from spmd_rl.reward import overlong_penalty
from spmd_rl.reward.registry import ScoreResult
from spmd_rl.seeds import call_seed
from spmd_rl.source.rollout import Rows, episode_prompts
from spmd_rl.step import Placement


class StepPrompts:
    """The training prompts and the resumable sampler that draws each round's (every rank keeps its
    sampler in step, so any rank's state is the checkpoint's), and each round's sampling settings."""

    def __init__(self, sampler: PromptSampler, ids: list[list[int]], *, group: dist.ProcessGroup | None, src: int,
                 is_controller: bool, rollout: Any, seed: int) -> None:
        """``ids``: every training prompt's token ids; ``src``: the controller's global rank;
        ``rollout``: the ``rollout`` config section (n, temperature, top_p, top_k, max_new_tokens)."""
        self.sampler, self.ids, self.group, self.src = sampler, ids, group, src
        self.is_controller, self.rollout, self.seed = is_controller, rollout, seed

    def draw(self) -> list[int]:
        """The next batch's prompt indices, drawn on the controller and broadcast over the pool."""
        indices = broadcast_object(self.sampler.next_batch() if self.is_controller else None,
                                   src=self.src, group=self.group)
        if not self.is_controller:
            self.sampler.next_batch()  # every rank's sampler stays in step, for checkpoints
        return indices

    def sampling(self, step: int, round_: int = 0) -> dict:
        """Round ``round_`` of ``step``'s sampling settings (``round_`` > 0: DAPO's extra rounds)."""
        r = self.rollout
        return dict(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                    seed=call_seed(self.seed, step, round_))  # + the replica's part, where it generates


def to_batch(rows: Rows, prompt_ids: list[list[int]], *, place: Placement, n: int,
             acc: MetricAccumulator) -> RolloutBatch:
    """``rows`` as a batch (prompt-major, ``n`` per prompt), with the response metrics."""
    positions = [row // n for row in range(*rows.span)]
    out = rows.out
    batch = RolloutBatch(
        prompts=episode_prompts(out) or [prompt_ids[rows.indices[i]] for i in positions],
        tensors={
            "response_ids": out["response_ids"].cpu(),
            "response_mask": out["response_mask"].float().cpu(),
            "rollout_logprobs": out["logprobs"].float().cpu(),
            "group_index": torch.tensor(positions, dtype=torch.long),
            "truncated": out["truncated"].bool().cpu(),
        },
        extras={"sample": [rows.indices[i] for i in positions]},
    )
    if "routed_experts" in out:  # router replay: the experts the rollout chose, for the actor's forwards
        batch["routed_experts"] = out["routed_experts"].to(torch.int16).cpu()
        acc.add_sum("perf/router_replay_mb", batch["routed_experts"].numel() * 2 / 2 ** 20)
    if "context_mask" in out:  # episodes: the environment's tokens between the model's turns, and its reward
        batch["context_mask"] = out["context_mask"].float().cpu()
        batch["env_reward"] = out["env_reward"].float().cpu()
        episode_metrics(out, acc)
    if not rows.actor_layout and place.rollout_mp_size > 1:  # every rank of the replica holds these rows
        share = len(batch) // place.rollout_mp_size
        batch = batch.select(range(place.rollout_mp * share, (place.rollout_mp + 1) * share))
    lengths = batch["response_mask"].sum(1)
    for length in lengths.tolist():
        acc.add("response_length/mean", length)
    acc.add_max("response_length/max", lengths.max().item())
    acc.add_min("response_length/min", lengths.min().item())
    for flag in batch["truncated"].tolist():
        acc.add("response_length/clip_ratio", float(flag))
    acc.add_sum("perf/gen_tokens", lengths.sum().item() * row_weight(rows, place))
    return batch


def episode_metrics(out: dict[str, torch.Tensor], acc: MetricAccumulator) -> None:
    """``env/*``: turns, truncation, reward and tool calls per episode, ``env/prefill_reused_frac`` (of the
    tokens the episodes' turns were fed with, the share whose K/V was still parked: not prefilled
    again), and ``timing_s/env``, the seconds this rank's episodes spent in their environments and
    tools (the most over the ranks)."""
    for turns, cut, reward, calls, errors in zip(out["env_turns"].tolist(), out["truncated"].tolist(),
                                                 out["env_reward"].tolist(), out["env_tool_calls"].tolist(),
                                                 out["env_tool_errors"].tolist()):
        acc.add("env/turns/mean", float(turns))
        acc.add("env/truncated_frac", float(cut))
        acc.add("env/reward/mean", reward)
        acc.add("env/tool_calls/mean", float(calls))
        acc.add("env/tool_errors/mean", float(errors))
    fed, reused = out["env_fed_tokens"].sum().item(), out["env_reused_tokens"].sum().item()
    if fed:
        acc.add("env/prefill_reused_frac", reused / fed, fed)
    acc.add_max("env/turns/max", float(out["env_turns"].max()))
    acc.add_sum("env/failed", float(out["env_failed"].sum()))
    acc.add_max("timing_s/env", float(out["env_seconds"].sum()))


def row_weight(rows: Rows, place: Placement) -> float:
    """What a row this rank holds counts in sums over the pool (< 1 where rows repeat over ranks)."""
    return place.sum_weight if rows.weight is None else rows.weight


def staleness(batch: RolloutBatch, out: dict[str, torch.Tensor], *, version: int, max_staleness: int,
              weight: float, acc: MetricAccumulator) -> None:
    """Per-token staleness (policy versions behind the weights this step updates) and its metrics."""
    mask = batch["response_mask"].bool()
    stale = (version - out["versions"][mask]).float()
    if stale.numel():
        acc.add("async/staleness/mean", stale.mean().item(), stale.numel())
        acc.add_max("async/staleness/max", stale.max().item())
    for k in range(max_staleness + 1):  # tokens per policy version, by how far behind it is
        acc.add_sum(f"async/tokens_staleness_{k}", float((stale == k).sum()) * weight)
    batch["staleness"] = (version - out["versions"]).masked_fill(~mask, -1)
    versions = out["versions"].masked_fill(~mask, -1)
    first = out["versions"].masked_fill(~mask, 1 << 62).min(1).values
    for spans in (versions.max(1).values > first).tolist():  # rollout.partial: a row continued under newer weights
        acc.add("async/partial_frac", float(spans))


class Scorer:
    """Scores a batch's responses on the rank that holds them: the run's reward (rules, reward model
    or reward pool) plus DAPO's overlong penalty (``reward.overlong_buffer``)."""

    def __init__(self, reward: Any, *, samples: list, tokenizer: Any, reward_cfg: Any, max_new_tokens: int) -> None:
        """``reward``: the run's reward (:func:`spmd_rl.reward.run.build_run_reward`); ``samples``:
        the training samples the batch's ``sample`` extras index."""
        self.reward, self.samples, self.tokenizer = reward, samples, tokenizer
        self.cfg, self.max_new_tokens = reward_cfg, max_new_tokens

    def __call__(self, batch: RolloutBatch, acc: MetricAccumulator, *, weight: float) -> None:
        """``batch["scores"]`` and the reward metrics; ``weight``: what a row counts in sums."""
        samples = [self.samples[i] for i in batch.extras["sample"]]
        mask = batch["response_mask"]
        responses = response_tokens(batch["response_ids"], mask)
        completions = decode_tokens(self.tokenizer, responses)
        if "env_reward" in batch:  # an episode's score: the sum of its environment's rewards
            rewards = batch["env_reward"].tolist()
            result = ScoreResult(scores=rewards, num_errors=0, format_scores=[0.0] * len(rewards), main_scores=rewards)
        else:
            result = self.reward(samples, completions, batch.prompts, responses)
        scores = torch.tensor(result.scores, dtype=torch.float32)
        if self.cfg.overlong_buffer:  # DAPO's soft overlong punishment, part of the score the advantages see
            penalty = overlong_penalty(mask.sum(1), max_len=self.max_new_tokens,
                                       buffer=self.cfg.overlong_buffer, factor=self.cfg.overlong_factor)
            scores = scores + penalty
            for p in penalty.tolist():
                acc.add("reward/overlong_penalty/mean", p)
        batch["scores"] = scores
        batch.extras["completion"] = completions
        for s in scores.tolist():
            acc.add("critic/score/mean", s)
        acc.add_max("critic/score/max", scores.max().item())
        acc.add_min("critic/score/min", scores.min().item())
        acc.add_sum("reward/errors", result.num_errors * weight)
        if result.model_scores is not None:  # the two parts of critic/score: rule + weight * model
            for total, model in zip(result.scores, result.model_scores):
                acc.add("reward/model_score/mean", model)
                acc.add("reward/rule_score/mean", total - self.cfg.model.weight * model)


__all__ = ["Scorer", "StepPrompts", "row_weight", "staleness", "to_batch"]
