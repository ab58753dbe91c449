"""The rollout as the batch sources and validation see it: the actor's weights in, this rank's rows out.

    rollout = LocalRollout(engine, place=place, sleep_level=1, dtype=None)   # colocated: the engine is here
    rollout = PoolRollout(link, dtype=torch.bfloat16)                        # pools.rollout_ranks > 0
    rollout.sync(actor, version)                  # the actor's full tensors, when the rollout's are older
    rows = rollout.generate(indices, prompt_ids, sampling)   # one round: this rank's rows (:class:`Rows`)
    answers = rollout.answers(val_ids, sampling)   # validation: this rank's share (prompts, responses, scores)

Colocated, each rollout data-parallel replica generates a contiguous share of the round's prompts
(its tp x pp ranks the same rows), with the replica's seed; the rows are in the rollout's layout and
a relayout moves them to the actor's; with episodes (``--env.*``) each response is a multi-turn
episode (:mod:`spmd_rl.episodes.runner`). On a rollout pool the controller sends every prompt (with
episodes, the round's data rows too: the pool's ranks play the episodes) and the rows come back
already in the actor's layout (:mod:`spmd_rl.rollout.pool`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from spmd_rl.models.tokenizer import response_tokens
from spmd_rl.seeds import replica_seed
from spmd_rl.step import Placement


@dataclass
class Rows:
    """A round's rows on this rank: the prompt index of each of the round's prompts, this rank's
    ``[start, end)`` of the round's rows (prompt-major, ``n`` per prompt), their tensors, what each
    row counts in sums over the pool (None: the rank's actor-layout weight), and whether they are
    in the actor's data-parallel layout already."""

    indices: list[int]
    span: tuple[int, int]
    out: dict[str, torch.Tensor]
    weight: float | None
    actor_layout: bool


@dataclass
class Episodes:
    """Multi-turn episodes instead of single responses (``--env.*``): the runner and the data rows
    (as dicts) its environments start from, training and held-out."""

    runner: Any  # spmd_rl.episodes.runner.EpisodeRunner (None on a rollout pool's actor side: it plays there)
    train_rows: list[dict]
    val_rows: list[dict]


class Answers(NamedTuple):
    """A rank's validation answers: each one's prompt (its index and ids), the response's tokens, and
    with episodes the episode's reward (None: scored by the run's reward)."""

    prompts: list[int]
    prompt_ids: list[list[int]]
    responses: list[list[int]]
    scores: list[float] | None = None


def episode_prompts(out: dict[str, torch.Tensor]) -> list[list[int]] | None:
    """Each row's own prompt when the rows are episodes (an environment's first messages); else None."""
    if "prompt_ids" not in out:
        return None
    return [row[:length].tolist() for row, length in zip(out["prompt_ids"], out["prompt_lengths"].tolist())]


def episode_rewards(out: dict[str, torch.Tensor]) -> list[float] | None:
    """Each episode's reward (the sum of its environment's step rewards); None for single responses."""
    return out["env_reward"].tolist() if "env_reward" in out else None


class LocalRollout:
    """The rollout engine in this process, taking turns on the device with the actor (hot-swap);
    with ``episodes``, each response is a multi-turn episode played on it."""

    def __init__(self, engine: Any, *, place: Placement, sleep_level: int, dtype: torch.dtype | None,
                 episodes: Episodes | None = None) -> None:
        self.engine, self.place, self.sleep_level, self.dtype = engine, place, sleep_level, dtype
        self.episodes = episodes
        self.version = 0  # the policy version its weights are

    def sync(self, actor: Any, version: int) -> None:
        """Hot-swap: stream the actor's full tensors into the engine (all ranks together) when it holds
        an older version or dropped its weights (a level-2 sleep)."""
        if version == self.version and not self.engine.needs_weights:
            return
        self.engine.load_weights(actor.named_full_tensors(dtype=self.dtype))
        self.version = version

    def generate(self, indices: list[int], prompt_ids: list[list[int]], sampling: dict) -> Rows:
        """This replica's contiguous share of the round's prompts, ``sampling["n"]`` responses (or
        episodes) each."""
        dp, dp_size = self.place.rollout_dp, self.place.rollout_dp_size
        per_rank = len(indices) // dp_size
        mine = list(range(dp * per_rank, (dp + 1) * per_rank))
        self.engine.wake_up()
        out = self._play(indices, mine, prompt_ids, {**sampling, "seed": replica_seed(sampling["seed"], dp)},
                         rows=None if self.episodes is None else self.episodes.train_rows)
        self.engine.sleep(self.sleep_level)
        n = sampling["n"]
        return Rows(indices, (mine[0] * n, (mine[-1] + 1) * n), out, weight=1.0, actor_layout=False)

    def _play(self, indices: list[int], mine: list[int], prompt_ids: list[list[int]], sampling: dict,
              rows: list[dict] | None) -> dict[str, torch.Tensor]:
        """``sampling["n"]`` responses to each of the prompts ``indices[i]`` for i in ``mine``, or with
        episodes that many episodes of each of those data ``rows``, on the woken engine."""
        if self.episodes is not None:
            n, rest = sampling["n"], {k: v for k, v in sampling.items() if k != "n"}
            out = self.episodes.runner.run(self.engine, [rows[indices[i]] for i in mine], n=n, sampling=rest)
        else:
            g = self.engine.generate([prompt_ids[indices[i]] for i in mine], **sampling)
            out = {"response_ids": g.response_ids, "response_mask": g.response_mask, "logprobs": g.logprobs,
                   "truncated": g.truncated}
            if g.routed_experts is not None:  # router replay: each generated token's experts
                out["routed_experts"] = g.routed_experts
        return out

    def answers(self, prompt_ids: list[list[int]], sampling: dict) -> Answers:
        """This rank's validation answers, with each one's prompt (index, ids), prompt-major; with
        episodes, each one's reward too."""
        place = self.place
        share = math.ceil(len(prompt_ids) / place.rollout_dp_size)
        mine = list(range(place.rollout_dp * share, min((place.rollout_dp + 1) * share, len(prompt_ids))))
        responses: list[list[int]] = []
        prompts, scores = [prompt_ids[i] for i in mine], None
        self.engine.wake_up()
        if mine:
            everything = list(range(len(prompt_ids)))
            out = self._play(everything, mine, prompt_ids, sampling,
                             rows=None if self.episodes is None else self.episodes.val_rows)
            responses = response_tokens(out["response_ids"], out["response_mask"])
            mine = [i for i in mine for _ in range(sampling["n"])]  # prompt-major: n answers per prompt
            prompts, scores = episode_prompts(out) or [prompt_ids[i] for i in mine], episode_rewards(out)
        self.engine.sleep(self.sleep_level)
        if place.rollout_mp_size > 1:  # the replica's ranks got the same answers: each scores a share
            part = math.ceil(len(mine) / place.rollout_mp_size)
            keep = range(place.rollout_mp * part, min((place.rollout_mp + 1) * part, len(mine)))
            mine, responses, prompts = [mine[i] for i in keep], [responses[i] for i in keep], [prompts[i] for i in keep]
            scores = None if scores is None else [scores[i] for i in keep]
        return Answers(mine, prompts, responses, scores if self.episodes is not None else None)

    def close(self, error: str | None = None) -> None:
        self.engine.close()


class PoolRollout:
    """The rollout pool, through this rank's end of its link (:class:`~spmd_rl.rollout.pool.RolloutLink`)."""

    def __init__(self, link: Any, *, dtype: torch.dtype | None, is_controller: bool, pad_token_id: int,
                 episodes: Episodes | None = None) -> None:
        """``episodes``: the data rows the pool's ranks play episodes from (its runner is theirs)."""
        self.link, self.dtype, self.is_controller, self.pad = link, dtype, is_controller, pad_token_id
        self.episodes = episodes
        self.version = 0

    def sync(self, actor: Any, version: int) -> None:
        """The actor's full tensors to the rollout pool (collective over the actor pool), which loads
        them after the rounds issued before."""
        if version == self.version:
            return
        self.link.sync_weights(actor.named_full_tensors(dtype=self.dtype), version)
        self.version = version

    def issue(self, prompt_ids: list[list[int]], indices: list[int], sampling: dict, *, kind: str = "train") -> None:
        """Start a round of ``indices`` without waiting for it (the controller sends the prompts, and
        with episodes their data rows)."""
        rows = None
        if self.episodes is not None:
            table = self.episodes.train_rows if kind == "train" else self.episodes.val_rows
            rows = [table[i] for i in indices] if self.is_controller else []
        self.link.issue([prompt_ids[i] for i in indices] if self.is_controller else None, sampling, kind=kind,
                        num_prompts=len(indices), pad_token_id=self.pad, rows=rows)

    def generate(self, indices: list[int], prompt_ids: list[list[int]], sampling: dict) -> Rows:
        """One round, issued and taken: this actor rank's rows, in the actor's layout."""
        self.issue(prompt_ids, indices, sampling)
        span, out = self.link.take()
        return Rows(indices, span, out, weight=None, actor_layout=True)

    def answers(self, prompt_ids: list[list[int]], sampling: dict) -> Answers:
        """Validation: each actor rank an even share of the answers (each scored once), taken after
        the training rounds in flight."""
        self.issue(prompt_ids, list(range(len(prompt_ids))), sampling, kind="val")
        (start, end), out = self.link.take(last=True)
        mine = [row // sampling["n"] for row in range(start, end)]  # prompt-major, n per prompt
        prompts = episode_prompts(out) if mine else None  # episodes: each its own prompt, its reward the score
        return Answers(mine, prompts or [prompt_ids[i] for i in mine],
                       response_tokens(out["response_ids"], out["response_mask"]),
                       episode_rewards(out) if self.episodes is not None else None)

    def close(self, error: str | None = None) -> None:
        self.link.close(error)


__all__ = ["Answers", "Episodes", "LocalRollout", "PoolRollout", "Rows", "episode_prompts", "episode_rewards"]
