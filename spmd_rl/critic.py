"""PPO's critic: a value model trained next to the actor, the token-level rewards and GAE advantages.

    critic = build_critic(critic=cfg.critic, algo=cfg.algo, ...)  # None unless algo.adv_estimator=gae
    critic.values(batch)                         # stage `values`: batch["values"], V of every response token
    rewards = token_rewards(batch, algo=cfg.algo, acc=acc)   # score on the last token (- KL per token)
    batch["advantages"] = critic.advantages(batch, rewards, acc)   # stage `adv`: GAE, batch["returns"]
    critic.update(batch, acc)                    # stage `critic_update`: the clipped value loss

The critic is its own training engine (``build_engine("critic", ...)``, FSDP: a one-output token
classifier, :mod:`spmd_rl.engine.value`) on the actor's ranks, mesh and micro-batching, so a step's
rows are already where it needs them: values, advantages and the update are local to each rank up to
the same few collectives as the actor's (counts, metrics, two statistics of the advantages).

Token-level rewards (:func:`token_rewards`, verl's ``token_level_rewards``): each response's score on
its last token; with ``algo.kl_in_reward`` every token also gets ``-algo.kl_coef`` x the
``algo.kl_kind`` estimate of KL(actor || reference) from the old and the reference log-probs
(verl's ``apply_kl_penalty`` with a fixed coefficient), logged as ``actor/reward_kl_penalty``.

Advantages: :func:`spmd_rl.algo.advantages.gae` per row gives the returns; its advantages
(returns - values) are then whitened over the valid tokens of the whole step, every rank of the
actor's data-parallel group together (one all-reduce of five sums), so N ranks compute what one
process computes on the whole batch, as verl's driver does. The same sums give
``critic/vf_explained_var`` = 1 - Var(returns - values) / (Var(returns) + 1e-5) (verl's metric; it
rises towards 1 as the values come to predict the returns).

Update: ``actor.ppo_mini_batch_size`` mini-batches x ``critic.ppo_epochs`` (default the actor's)
optimizer steps of :func:`spmd_rl.algo.losses.value_loss` (clip ``critic.cliprange_value``, the
actor's ``algo.loss_agg_mode``), each micro-batch's loss divided by the mini-batch's global token and
sequence counts, as the actor's. Logged: ``critic/vf_loss`` (mean over the optimizer steps of the
mini-batch loss), ``critic/vf_clipfrac``, ``critic/vpreds/mean``, ``critic/grad_norm``,
``critic/lr``; at the advantages ``critic/values/mean``, ``critic/returns/mean`` and the explained
variance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from spmd_rl.actor import global_counts
from spmd_rl.algo import losses
from spmd_rl.algo.advantages import gae
from spmd_rl.algo.objective import CRITIC_ESTIMATORS
from spmd_rl.config import AlgoConfig, CriticConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.engine import LossFn, TrainEngine, build_engine
from spmd_rl.metrics import MetricAccumulator
from spmd_rl.models import load_tokenizer, resolve_model_path


def needs_critic(algo: AlgoConfig) -> bool:
    """Whether ``algo.adv_estimator`` takes a value model's values (the run then trains a critic)."""
    return algo.adv_estimator in CRITIC_ESTIMATORS


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each row's score on its last valid token, 0 elsewhere (and on rows with none)."""
    valid = mask.bool()
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)  # index of the last True
    out = torch.zeros(valid.shape, dtype=torch.float32)
    rows = valid.any(1)
    out[rows.nonzero().squeeze(1), last[rows]] = scores.float()[rows]
    return out


def token_rewards(batch: RolloutBatch, *, algo: AlgoConfig, acc: MetricAccumulator) -> torch.Tensor:
    """Token-level rewards ``[B, T]`` of the step (module docstring): the score on the last response
    token, minus ``algo.kl_coef`` x KL(actor || reference) per token when ``algo.kl_in_reward``."""
    mask = batch["response_mask"]
    rewards = last_token_rewards(batch["scores"], mask)
    if algo.kl_in_reward:
        kl = losses.kl_penalty(batch["old_logprobs"].float(), batch["ref_logprobs"].float(), algo.kl_kind) * mask
        rewards = rewards - algo.kl_coef * kl
        tokens = mask.sum().item()
        acc.add("actor/reward_kl_penalty", kl.sum().item() / max(tokens, 1), tokens)
    return rewards


class Critic:
    """The value model and its three stages (module docstring); every method is collective over
    ``group`` (the actor's pool)."""

    def __init__(self, engine: TrainEngine, *, critic: CriticConfig, algo: AlgoConfig, epochs: int, mini_batches: int,
                 sum_weight: float, group: dist.ProcessGroup | None) -> None:
        """``sum_weight``: what this rank's rows count in sums over ``group`` (0 where an actor dp
        group's rows repeat on another rank, see :class:`spmd_rl.step.Placement`)."""
        self.engine, self.cfg, self.algo = engine, critic, algo
        self.epochs, self.mini_batches = epochs, mini_batches
        self.sum_weight, self.group = sum_weight, group

    def values(self, batch: RolloutBatch) -> None:
        """``batch["values"]``: the value of every response token (0 on padding)."""
        # a value model's engine scores values where an actor's scores log-probs (spmd_rl.engine.value)
        values, _ = self.engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=self.cfg.micro_batch_size)
        batch["values"] = values.float().cpu()

    def advantages(self, batch: RolloutBatch, rewards: torch.Tensor, acc: MetricAccumulator) -> torch.Tensor:
        """GAE's advantages ``[B, T]``, whitened over the whole step; sets ``batch["returns"]``."""
        mask, values = batch["response_mask"].float(), batch["values"]
        _, returns = gae(rewards, values, mask, self.algo.gamma, self.algo.lam)
        raw = (returns - values) * mask  # GAE's advantages before whitening
        sums = torch.tensor([mask.sum(), raw.sum(), raw.square().sum(), returns.sum(), returns.square().sum()],
                            dtype=torch.float64) * self.sum_weight
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(sums, group=self.group)
        n, adv_sum, adv_sq, ret_sum, ret_sq = sums.tolist()
        adv_mean, adv_var = _mean_var(n, adv_sum, adv_sq)
        ret_mean, ret_var = _mean_var(n, ret_sum, ret_sq)
        whitened = (raw.double() - adv_mean) * (adv_var + 1e-8) ** -0.5 * mask
        batch["returns"] = returns.float()
        tokens = mask.sum().item()
        acc.add("critic/values/mean", (values * mask).sum().item() / max(tokens, 1), tokens)
        acc.add("critic/returns/mean", ret_mean)  # the same on every rank: already the step's
        acc.add("critic/vf_explained_var", 1.0 - adv_var / (ret_var + 1e-5))
        return whitened.float()

    def update(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        """``critic.ppo_epochs`` passes of mini-batch optimizer steps on the clipped value loss."""
        updates = self.epochs * self.mini_batches
        for _epoch in range(self.epochs):
            for mini in batch.chunks(self.mini_batches):
                global_tokens, global_seqs = global_counts(mini, sum_weight=self.sum_weight, group=self.group)
                pending: list[torch.Tensor] = []  # (loss, clipfrac, vpred sum, tokens) per micro-batch: no sync
                stats = self.engine.train_mini_batch(
                    self.engine.micro_batches(mini, micro_batch_size=self.cfg.micro_batch_size),
                    self._loss_fn(global_tokens, global_seqs, pending), temperature=1.0, need_entropy_grad=False)
                for loss, clipfrac, vpred_sum, tokens in torch.stack(pending).double().tolist() if pending else []:
                    acc.add_sum("critic/vf_loss", loss * self.sum_weight / updates)
                    acc.add("critic/vf_clipfrac", clipfrac, tokens)
                    acc.add("critic/vpreds/mean", vpred_sum / max(tokens, 1.0), tokens)
                if not stats.get("skipped", 0.0):
                    acc.add("critic/grad_norm", stats["grad_norm"])
                acc.add("critic/lr", stats["lr"])
        self.engine.offload()

    def _loss_fn(self, global_tokens: float, global_seqs: float, pending: list[torch.Tensor]) -> LossFn:
        """The clipped value loss of a micro-batch over the mini-batch's global counts; its metrics go to
        ``pending`` as device tensors."""

        def loss_fn(vpreds: torch.Tensor, _entropy: Any, micro: RolloutBatch) -> tuple[torch.Tensor, dict]:
            mask = micro["response_mask"]
            loss, clipfrac = losses.value_loss(
                vpreds, micro["returns"], micro["values"], mask, clip=self.cfg.cliprange_value,
                agg_mode=self.algo.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
            pending.append(torch.stack([loss.detach(), clipfrac, (vpreds.detach() * mask).sum(), mask.sum()]))
            return loss, {}

        return loss_fn


def _mean_var(n: float, total: float, squares: float) -> tuple[float, float]:
    """Mean and unbiased variance from a count, a sum and a sum of squares (0 for fewer than 2)."""
    mean = total / max(n, 1.0)
    return mean, max(squares - n * mean * mean, 0.0) / max(n - 1.0, 1.0)


def build_critic(*, critic: CriticConfig, algo: AlgoConfig, actor_tokenizer: Any, engines: dict[str, Any],
                 total_steps: int, mini_batches: int, sum_weight: float,
                 group: dist.ProcessGroup | None) -> Critic | None:
    """The run's critic, or None when ``algo.adv_estimator`` needs none. ``engines``: the keyword
    arguments the trainer builds its actor with (:func:`spmd_rl.engine.build_engine`); the critic's
    own folder (``critic.model.path``, else the actor's) and update count replace theirs."""
    if not needs_critic(algo):
        return None
    folder, path = engines["model_folder"], critic.model.path
    if path is not None:
        folder = resolve_model_path(path, cache_dir=engines["model"].cache_dir)
        vocab = load_tokenizer(folder, trust_remote_code=critic.model.trust_remote_code).get_vocab()
        if vocab != actor_tokenizer.get_vocab():
            raise ValueError(f"the critic ({path}, {len(vocab)} tokens) and the actor ({engines['model'].path}, "
                             f"{len(actor_tokenizer.get_vocab())} tokens) have different tokenizers: the critic "
                             "scores the actor's token ids, so both must share one (--critic.model.path)")
    epochs = critic.ppo_epochs or engines["actor"].ppo_epochs
    engine = build_engine("critic", **{**engines, "model_folder": folder,
                                       "total_updates": total_steps * mini_batches * epochs}, critic=critic)
    return Critic(engine, critic=critic, algo=algo, epochs=epochs, mini_batches=mini_batches, sum_weight=sum_weight,
                  group=group)


__all__ = ["Critic", "build_critic", "last_token_rewards", "needs_critic", "token_rewards"]
