"""The GRPO trainer: the stages of one step, in lockstep on every rank of the actor's pool.

    trainer = Trainer(cfg, env, groups=build_run_groups(plan, env))   # engines, data, reward
    trainer.fit()

Rank 0 is the controller inside the same loop: it draws the step's prompts and logs. Everything
else is symmetric. Per step:

1. weight_sync  the rollout gets the actor's weights if it holds an older version: a hot-swap in
                the same process, or a transfer to the rollout pool (``pools.rollout_ranks`` > 0);
2. gen          rank 0 draws ``data.train_batch_size`` prompt indices and broadcasts them; each
                rollout data-parallel replica generates ``rollout.n`` responses for its contiguous
                share (colocated: on these ranks, then sleeps; else on the rollout pool, whose rows
                come back already in the actor's layout);
3. reward       each rank scores the responses it holds: rules, plus the reward model (colocated,
                or a round trip to the reward pool when ``pools.reward_ranks`` > 0), plus DAPO's
                overlong penalty (``reward.overlong_buffer``);
4. relayout     rows move from the rollout's layout to the actor's data-parallel layout; with
                ``algo.filter_groups`` (DAPO) stages 2-4 repeat with new prompts until the step holds
                ``data.train_batch_size`` groups whose scores differ (:mod:`spmd_rl.algo.filtering`);
5. old_logprob  actor log-probs before the update, when the policy moves inside the step (several
                optimizer steps per batch) or PPO's KL reward needs them; otherwise the update's own
                log-probs, detached, are the old ones (also for the IS correction and stale samples);
6. ref          frozen reference log-probs (when the KL loss or the KL reward is on);
7. teacher      the teacher's log-probs, colocated or on the teacher pool (``algo.distill_coef``);
8. values       the critic's values of every response token (``algo.adv_estimator=gae``, spmd_rl.critic);
9. adv          group advantages, local since all n responses of a prompt are on one rank, or GAE
                from token-level rewards and the values;
10. update      mini-batches x micro-batches with global token normalisation (spmd_rl.actor);
11. critic_update  the critic's value loss, the same mini-batches (PPO with a critic only).

With ``trainer.max_staleness`` S > 0 (a rollout pool) stages 1-2 become ``wait_rollout``: the step
takes rows the pool generated while earlier updates ran (:mod:`spmd_rl.schedule`); after the update,
``wait_weights`` sends the new weights and the schedule issues the next work.

Every stage runs under a timer (``timing_s/<stage>``), which is also a ``stage/<name>`` profiler
range for ``trainer.profile_steps`` (:mod:`spmd_rl.profiling`). Metrics are accumulated locally and
reduced over the pool once per step; the update's loss metrics stay device tensors until their
mini-batch ends and are then read in one device-to-host copy (no sync per micro-batch). Validation
(greedy answers on the held-out prompts, or ``trainer.val_n`` sampled ones with pass@k) runs before
the first step, every ``trainer.val_every`` steps and after the last.
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from spmd_rl.algo.filtering import DynamicSampling
from spmd_rl.actor import ActorUpdate
from spmd_rl.algo.objective import compute_advantages
from spmd_rl.checkpoint import Checkpointer, checkpoint_bytes
from spmd_rl.checkpoint_files import model_parameters
from spmd_rl.config import Config, to_dict, to_yaml
from spmd_rl.critic import build_critic, token_rewards
from spmd_rl.data import build_prompts
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.data.prompts import render_prompts
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.distributed.comm import all_gather_objects, broadcast_object, fail_together, relayout
from spmd_rl.distributed.env import DistEnv, format_rank_table
from spmd_rl.plan import plan
from spmd_rl.distributed.pools import GLOBAL
from spmd_rl.world import RunGroups, build_run_groups
from spmd_rl.distill import TeacherLink, check_tokenizers
from spmd_rl.engine import build_engine, build_reference, build_teacher, engine_spec
from spmd_rl.metrics import MetricAccumulator, NullSink, RunSink, grpo_step_flops, peak_flops, phase_mfu
from spmd_rl.models import FlopsModel, eos_token_ids, load_tokenizer, resolve_model_path
from spmd_rl.passk import sample_metrics
from spmd_rl.profiling import format_stage_times, profiled, stage_times
from spmd_rl.reward import overlong_penalty
from spmd_rl.reward.run import build_run_reward
from spmd_rl.rollout import build_rollout_from_config
from spmd_rl.schedule import AsyncSchedule
from spmd_rl.seeds import call_seed, engine_seed, replica_seed
from spmd_rl.step import Placement, StageTimer

log = logging.getLogger("spmd_rl")


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, groups: RunGroups | None = None) -> None:
        """``groups``: the run's pools and meshes, built on every rank of the world (by
        ``spmd_rl.train``, before the reward ranks go to their own loop); built here when None."""
        self.cfg, self.env = cfg, env
        groups = groups or build_run_groups(plan(cfg, env.world_size, env.local_world_size), env)
        self.plan, self.pool = groups.plan, groups.pools.get(GLOBAL)
        self.group = self.pool.group
        self.place = Placement.of(self.plan, self.pool.rank)
        # Picks the checkpoint to resume from (and trims metrics.jsonl) before the sink opens it.
        self.checkpointer = Checkpointer(checkpoint=cfg.checkpoint, output_dir=cfg.trainer.output_dir,
                                         total_steps=cfg.trainer.total_steps, rank_table=groups.rank_table,
                                         config=to_dict(cfg), device=env.device, group=self.group)
        self.sink = self._open_sink(groups.rank_table)
        with fail_together(group=self.group, what="model and data setup"):
            self._load_model_and_prompts()
            self.reward = build_run_reward(
                reward=cfg.reward, task=cfg.data.task, system_prompt=cfg.data.system_prompt,
                actor_tokenizer=self.tokenizer, group=self.group, mesh=groups.actor_mesh, exchange=groups.exchange,
                device=env.device, cache_dir=cfg.model.cache_dir)
        self.mini_batches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        self.updates_per_step = self.mini_batches * cfg.actor.ppo_epochs
        self._build_engines(groups)  # actor, reference, critic, teacher
        self.link = groups.rollout_link  # the rollout pool (pools.rollout_ranks > 0), else None
        self.rollout = None if self.link else build_rollout_from_config(
            cfg.rollout, model_folder=self.model_folder, device=env.device, pad_token_id=self.pad_id,
            eos_token_ids=self.eos_ids, trust_remote_code=cfg.model.trust_remote_code,
            max_prompt_length=cfg.data.max_prompt_length, seed=engine_seed(cfg.trainer.seed, self.place.rollout_dp),
            pool_groups=groups.rollout_pool_groups)
        self.policy_version = self.rollout_version = 0  # actor updates so far / those the rollout holds
        self.row_weight = 1.0  # what a row this rank holds counts in sums (< 1 where rows repeat over ranks)
        self.staleness = cfg.trainer.max_staleness
        if self.link is not None:  # the bounded queue between the pools: S + 1 training rounds and a validation one
            self.link.max_in_flight = self.staleness + 2
        self.schedule = self._async_schedule()
        self.flops = FlopsModel.from_config(self.actor.config)  # per-phase MFU from the real lengths
        self.actor_update = ActorUpdate(self.actor, cfg=cfg, mini_batches=self.mini_batches,
                                        sum_weight=self.place.sum_weight, group=self.group, device=env.device,
                                        temperature=self.temperature, logs_rollout_gap=self.logs_rollout_gap)
        self.dynamic = DynamicSampling(  # DAPO: rounds until data.train_batch_size groups whose scores differ
            train_batch_size=cfg.data.train_batch_size, n=cfg.rollout.n, max_rounds=cfg.algo.max_sample_rounds,
            group=self.group, actor_dp=self.place.actor_dp, actor_dp_size=self.place.actor_dp_size,
            pad_token_id=self.pad_id) if cfg.algo.filter_groups else None
        self.step = 0
        self.checkpointer.track(model_folder=self.model_folder, export=self.actor.export_weights,
                                actor=self.actor, sampler=self.sampler, optional=["in_flight"],  # none: nothing in flight
                                **({"in_flight": self.schedule.in_flight} if self.schedule else {}),
                                **({"critic": self.critic.engine} if self.critic else {}))
        self.checkpointer.check_writable(checkpoint_bytes(  # before the first step, not at the first save
            model_parameters(self.model_folder) * (2 if self.critic else 1),
            hf_copy=engine_spec(cfg.actor.engine).export_copy))

    @property
    def temperature(self) -> float:
        """The temperature every log-prob is computed at: the rollout's (1 for greedy, T = 0)."""
        return self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0

    @property
    def need_old_logprobs(self) -> bool:
        """A forward for the old log-probs runs before the update when the weights move between the
        step's optimizer steps (several per batch) and for PPO's KL reward (needed before the
        advantages). With one optimizer step per batch the proximal policy of decoupled PPO is the
        current one, so the update's own log-probs, detached, serve as the old ones: the ratio is 1,
        and the IS correction (``algo.rollout_is``) and stale samples compare them with the rollout's.
        The same numbers as a separate forward, one forward less per step."""
        return self.updates_per_step > 1 or self.cfg.algo.kl_in_reward

    @property
    def logs_rollout_gap(self) -> bool:
        """Whether the update compares its own log-probs with the rollout's when no old-log-prob forward
        ran (``rollout/logprob_abs_diff``; ``async/logprob_abs_diff_fresh`` for the tokens the current
        weights sampled): where the IS correction or stale samples use the rollout's. The forward, when
        it runs, always logs them."""
        return self.cfg.algo.rollout_is != "none" or self.staleness > 0

    def _build_engines(self, groups: RunGroups) -> None:
        """The actor, the frozen reference (when a KL needs it; with LoRA the actor's own base), PPO's
        critic (``algo.adv_estimator=gae``) and the distillation teacher, each None when off."""
        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        engines = dict(actor=cfg.actor, ref=cfg.ref, model=cfg.model, seed=cfg.trainer.seed, groups=groups,
                       model_folder=self.model_folder, device=self.env.device, pad_token_id=self.pad_id,
                       total_updates=cfg.trainer.total_steps * self.updates_per_step, moe_aux_coef=cfg.algo.moe_aux_coef)
        self.actor = build_engine("actor", **engines)
        self.ref = (build_reference(self.actor, **engines)  # LoRA: the actor's base, adapters off
                    if cfg.algo.use_kl_loss or cfg.algo.kl_in_reward else None)
        self.critic = build_critic(critic=cfg.critic, algo=cfg.algo, actor_tokenizer=self.tokenizer, engines=engines,
                                   total_steps=cfg.trainer.total_steps, mini_batches=self.mini_batches,
                                   sum_weight=self.place.sum_weight, group=self.group)
        self.teacher = self._teacher(groups)  # on-policy distillation (teacher.model.path)

    def _async_schedule(self) -> AsyncSchedule | None:
        """What is in flight between the pools when S > 0 (:mod:`spmd_rl.schedule`); None when synchronous."""
        if not self.staleness:
            return None
        cfg = self.cfg
        return AsyncSchedule(self.link, group=self.group, staleness=self.staleness, stream=cfg.rollout.stream,
                             total_steps=cfg.trainer.total_steps, batch_size=cfg.data.train_batch_size,
                             pad_token_id=self.pad_id, draw=self.draw, prompts=self.prompts, sampling=self.sampling)

    def _teacher(self, groups: RunGroups):
        """The teacher's log-probs: a frozen FSDP engine on the actor's mesh, or the teacher pool's link."""
        path = self.cfg.teacher.model.path
        if path is None:
            return None
        folder = resolve_model_path(path, cache_dir=self.cfg.model.cache_dir)
        tokenizer = load_tokenizer(folder, trust_remote_code=self.cfg.teacher.model.trust_remote_code)
        check_tokenizers(self.tokenizer, tokenizer, student_path=self.cfg.model.path, teacher_path=path)
        if groups.teacher_link is not None:
            return groups.teacher_link
        return build_teacher(teacher=self.cfg.teacher, actor=self.cfg.actor, model_folder=folder, mesh=groups.actor_mesh,
                             group=self.group, device=self.env.device, pad_token_id=self.pad_id, sp_group=groups.sp_group)

    def _open_sink(self, rank_table: list[dict]) -> RunSink | NullSink:
        """Rank 0's console / JSONL / wandb sink (a no-op elsewhere); writes ``config.yaml``."""
        cfg = self.cfg
        if not self.env.is_main:
            return NullSink()
        sink = RunSink(logging_cfg=cfg.logging, output_dir=cfg.trainer.output_dir, total_steps=cfg.trainer.total_steps,
                       start_step=self.checkpointer.start_step, config_dict=to_dict(cfg),
                       start_elapsed_s=self.checkpointer.start_elapsed_s)
        sink.info("rank table\n" + format_rank_table(rank_table))
        for warning in self.plan.warnings:
            sink.info(f"warning: {warning}")
        sink.write_config(to_yaml(cfg), print_all=cfg.logging.print_config)
        return sink

    def _load_model_and_prompts(self) -> None:
        cfg = self.cfg
        self.model_folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_folder, trust_remote_code=cfg.model.trust_remote_code)
        self.pad_id, self.eos_ids = int(self.tokenizer.pad_token_id), eos_token_ids(self.tokenizer)
        train, val = build_prompts(cfg.data)
        render = dict(system_prompt=cfg.data.system_prompt, max_prompt_length=cfg.data.max_prompt_length)
        self.train_samples, self.train_ids, dropped = render_prompts(train, self.tokenizer, **render)
        self.val_samples, self.val_ids, val_dropped = render_prompts(val, self.tokenizer, **render)
        if dropped or val_dropped:
            self.sink.info(f"dropped {dropped} training and {val_dropped} validation prompts longer than "
                           f"data.max_prompt_length={cfg.data.max_prompt_length} tokens")
        if len(self.train_samples) < cfg.data.train_batch_size:
            raise ValueError(f"only {len(self.train_samples)} training prompts for data.train_batch_size="
                             f"{cfg.data.train_batch_size}")
        self.sampler = PromptSampler(len(self.train_samples), cfg.data.train_batch_size, cfg.data.seed)

    # ================================================================== the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        last: dict[str, float] = {}
        self.step = self.policy_version = self.checkpointer.resume()  # resumed weights: the rollout syncs first
        if cfg.val_every and self.step == 0:  # a resumed run validated this step before saving it
            self.sink.log(self.validate(), self.step)
        if self.schedule is not None:  # what a checkpoint held in flight (generated again), then up to S + 1 rounds
            self.sync_weights()
            self.schedule.start(self.step)
        while self.step < cfg.total_steps:
            self.step += 1
            self.sink.step_started(self.step, self.env.device)
            timer = StageTimer(self.step)
            acc = MetricAccumulator()
            trace = os.path.join(cfg.output_dir, "profile", f"step{self.step}_rank{self.env.rank}.json.gz")
            profiling = profiled(self.env.device, trace) if self.step in cfg.profile_steps else nullcontext()
            with profiling as prof, timer("step"):
                if self.schedule is not None:  # rows generated while earlier updates ran
                    with timer("wait_rollout"):
                        batch = self.take(acc)
                else:
                    with timer("weight_sync"):
                        self.sync_weights()
                    with timer("gen"):
                        batch = self.generate(acc)
                batch = self.scored(batch, acc, timer)
                if self.dynamic is not None:  # DAPO: more rounds until enough groups whose scores differ
                    batch = self.dynamic.collect(batch, acc, more=partial(self.another_round, acc=acc, timer=timer))
                with timer("old_logprob"):
                    self.old_logprobs(batch, acc)
                with timer("ref"):
                    self.ref_logprobs(batch)
                if self.teacher is not None:
                    with timer("teacher"):
                        self.teacher_logprobs(batch)
                if self.critic is not None:
                    with timer("values"):
                        self.critic.values(batch)
                with timer("adv"):
                    self.advantages(batch, acc)
                with timer("update"):
                    self.update(batch, acc)
                if self.critic is not None:
                    with timer("critic_update"):
                        self.critic.update(batch, acc)
                if self.schedule is not None:  # new weights to the rollout pool, once it is done with its round
                    with timer("wait_weights"):
                        self.sync_weights()
                    self.schedule.refill(self.step)
            last = self.finish_step(batch, acc, timer)
            if prof is not None and self.env.is_main:
                log.info("step %d under torch.profiler (trace: %s):\n%s", self.step, trace,
                         format_stage_times(stage_times(prof)))
            if cfg.val_every and (self.step % cfg.val_every == 0 or self.step == cfg.total_steps):
                val = self.validate()
                self.sink.log(val, self.step)
                last.update(val)
            self.checkpointer.maybe_save(self.step)
        return last

    # ================================================================== stages
    def draw(self) -> list[int]:
        """The next batch's prompt indices, drawn on rank 0 (every rank's sampler stays in step)."""
        indices = broadcast_object(self.sampler.next_batch() if self.env.is_main else None,
                                   src=self.pool.spec.start, group=self.group)
        if not self.env.is_main:
            self.sampler.next_batch()  # keep every rank's sampler in step, for checkpoints
        return indices

    def sampling(self, step: int, round_: int = 0) -> dict:
        """``round_``: the step's round of prompts (> 0 only under ``algo.filter_groups``)."""
        r = self.cfg.rollout
        return dict(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                    seed=call_seed(self.cfg.trainer.seed, step, round_))  # + the replica's dp rank

    def generate(self, acc: MetricAccumulator, round_: int = 0) -> RolloutBatch:
        indices, sampling = self.draw(), self.sampling(self.step, round_)
        if self.link is not None:  # the rollout pool generates; this rank's rows come back in the actor layout
            rows, out = self.link.generate([self.train_ids[i] for i in indices] if self.env.is_main else None,
                                           sampling, kind="train", num_prompts=len(indices), pad_token_id=self.pad_id)
            return self.to_batch(indices, rows, out, acc)
        dp, dp_size = self.place.rollout_dp, self.place.rollout_dp_size
        per_rank = len(indices) // dp_size
        mine = list(range(dp * per_rank, (dp + 1) * per_rank))
        self.rollout.wake_up()
        g = self.rollout.generate([self.train_ids[indices[i]] for i in mine], **{**sampling, "seed": replica_seed(sampling["seed"], dp)})
        self.rollout.sleep(self.cfg.rollout.sleep_level)
        out = {"response_ids": g.response_ids, "response_mask": g.response_mask, "logprobs": g.logprobs,
               "truncated": g.truncated}
        n = sampling["n"]
        return self.to_batch(indices, (mine[0] * n, (mine[-1] + 1) * n), out, acc, weight=1.0)

    def prompts(self, indices: list[int]) -> list[list[int]] | None:
        """The token ids of training prompts, on the controller (the rank that sends them); None elsewhere."""
        return [self.train_ids[i] for i in indices] if self.env.is_main else None

    def take(self, acc: MetricAccumulator) -> RolloutBatch:
        """Asynchronous GRPO: this step's rows from the rollout pool (:mod:`spmd_rl.schedule`), with their staleness."""
        taken = self.schedule.take(self.step, self.policy_version)
        batch = self.staleness_of(self.to_batch(taken.indices, taken.rows, taken.out, acc), taken.out, acc)
        for name, value in taken.metrics.items():
            acc.add_max(name, value)
        return batch

    def staleness_of(self, batch: RolloutBatch, out: dict, acc: MetricAccumulator) -> RolloutBatch:
        """Per-token staleness (policy versions behind the weights this step updates) and its metrics."""
        mask = batch["response_mask"].bool()
        stale = (self.policy_version - out["versions"][mask]).float()
        if stale.numel():
            acc.add("async/staleness/mean", stale.mean().item(), stale.numel())
            acc.add_max("async/staleness/max", stale.max().item())
        for k in range(self.staleness + 1):  # tokens per policy version, by how far behind it is
            acc.add_sum(f"async/tokens_staleness_{k}", float((stale == k).sum()) * self.row_weight)
        batch["staleness"] = (self.policy_version - out["versions"]).masked_fill(~mask, -1)
        versions = out["versions"].masked_fill(~mask, -1)
        first = out["versions"].masked_fill(~mask, 1 << 62).min(1).values
        for spans in (versions.max(1).values > first).tolist():  # rollout.partial: a row continued under newer weights
            acc.add("async/partial_frac", float(spans))
        return batch

    def to_batch(self, indices: list[int], rows: tuple[int, int], out: dict, acc: MetricAccumulator, *,
                 weight: float | None = None) -> RolloutBatch:
        """The rows ``[start, end)`` of a step (prompt-major, ``rollout.n`` per prompt) as a batch,
        with the response metrics. ``weight``: what each row counts in sums (default: this rank's
        share of its actor dp group's rows)."""
        n = self.cfg.rollout.n
        positions = [row // n for row in range(*rows)]
        batch = RolloutBatch(
            prompts=[self.train_ids[indices[i]] for i in positions],
            tensors={
                "response_ids": out["response_ids"].cpu(),
                "response_mask": out["response_mask"].float().cpu(),
                "rollout_logprobs": out["logprobs"].float().cpu(),
                "group_index": torch.tensor(positions, dtype=torch.long),
                "truncated": out["truncated"].bool().cpu(),
            },
            extras={"sample": [indices[i] for i in positions]},
        )
        mp, mp_size = self.place.rollout_mp, self.place.rollout_mp_size
        if mp_size > 1:  # every rank of the replica holds these rows: keep a share
            share = len(batch) // mp_size
            batch = batch.select(range(mp * share, (mp + 1) * share))
        self.row_weight = self.place.sum_weight if weight is None else weight  # rows repeat over an actor dp group
        lengths = batch["response_mask"].sum(1)
        for length in lengths.tolist():
            acc.add("response_length/mean", length)
        acc.add_max("response_length/max", lengths.max().item())
        acc.add_min("response_length/min", lengths.min().item())
        for flag in batch["truncated"].tolist():
            acc.add("response_length/clip_ratio", float(flag))
        acc.add_sum("perf/gen_tokens", lengths.sum().item() * self.row_weight)
        return batch

    def sync_weights(self) -> None:
        """Hot-swap: stream the actor's full tensors into the rollout engine (all ranks together), when
        the rollout holds an older policy version or dropped its weights (a level-2 sleep). With a
        rollout pool they travel to its ranks over the collective backend (spmd_rl.rollout.pool)."""
        stale = self.rollout_version != self.policy_version
        if not stale and (self.link is not None or not self.rollout.needs_weights):
            return
        dtype = torch.bfloat16 if self.env.device.type == "cuda" else None
        if self.link is not None:
            self.link.sync_weights(self.actor.named_full_tensors(dtype=dtype), self.policy_version)
        else:
            self.rollout.load_weights(self.actor.named_full_tensors(dtype=dtype))
        self.rollout_version = self.policy_version

    def another_round(self, round_: int, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        """``algo.filter_groups``: one more round of prompts for this step, generated and scored."""
        with timer("weight_sync"):  # a no-op unless the rollout dropped its weights when it slept (level 2)
            self.sync_weights()
        with timer("gen"):
            batch = self.generate(acc, round_)
        return self.scored(batch, acc, timer)

    def scored(self, batch: RolloutBatch, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        """A round's rows scored and moved to the actor's data-parallel layout."""
        with timer("reward"):
            self.score(batch, acc)
        with timer("relayout"):
            return relayout(batch, src=self.place.rollout_source(self.pool.rank, self.pool.size),
                            dst=(self.place.actor_dp, self.place.actor_dp_size), group=self.group,
                            pad_token_id=self.pad_id)

    def score(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        samples = [self.train_samples[i] for i in batch.extras["sample"]]
        responses = [ids[mask.bool()].tolist() for ids, mask in zip(batch["response_ids"], batch["response_mask"])]
        completions = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        result = self.reward(samples, completions, batch.prompts, responses)
        scores = torch.tensor(result.scores, dtype=torch.float32)
        r = self.cfg.reward
        if r.overlong_buffer:  # DAPO's soft overlong punishment, part of the score the advantages see
            penalty = overlong_penalty(batch["response_mask"].sum(1), max_len=self.cfg.rollout.max_new_tokens,
                                       buffer=r.overlong_buffer, factor=r.overlong_factor)
            scores = scores + penalty
            for p in penalty.tolist():
                acc.add("reward/overlong_penalty/mean", p)
        batch["scores"] = scores
        batch.extras["completion"] = completions
        for s in scores.tolist():
            acc.add("critic/score/mean", s)
        acc.add_max("critic/score/max", scores.max().item())
        acc.add_min("critic/score/min", scores.min().item())
        acc.add_sum("reward/errors", result.num_errors * self.row_weight)
        if result.model_scores is not None:  # the two parts of critic/score: rule + weight * model
            for total, model in zip(result.scores, result.model_scores):
                acc.add("reward/model_score/mean", model)
                acc.add("reward/rule_score/mean", total - self.cfg.reward.model.weight * model)

    def old_logprobs(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        # With a single optimizer step per batch the update's own log-probs (detached) are the old ones:
        # ratio == 1 exactly, and a whole forward pass is saved (see need_old_logprobs).
        if not self.need_old_logprobs:
            return
        logprobs, _ = self.actor.compute_logprobs(batch, temperature=self.temperature,
                                                  micro_batch_size=self.cfg.actor.micro_batch_size)
        batch["old_logprobs"] = logprobs.cpu()
        mask = batch["response_mask"]
        gap = (logprobs.cpu() - batch["rollout_logprobs"]).abs()
        acc.add("rollout/logprob_abs_diff", (gap * mask).sum().item() / max(mask.sum().item(), 1), mask.sum().item())
        if "staleness" in batch:  # tokens the current weights sampled: only numerical mismatch, as on-policy
            fresh = (batch["staleness"] == 0).float() * mask  # (a concat pads with 0)
            if fresh.sum() > 0:
                acc.add("async/logprob_abs_diff_fresh", (gap * fresh).sum().item() / fresh.sum().item(), fresh.sum().item())

    def ref_logprobs(self, batch: RolloutBatch) -> None:
        if self.ref is None:
            return
        logprobs, _ = self.ref.compute_logprobs(batch, temperature=self.temperature,
                                                micro_batch_size=self.cfg.ref.micro_batch_size)
        batch["ref_logprobs"] = logprobs.cpu()

    def teacher_logprobs(self, batch: RolloutBatch) -> None:
        if isinstance(self.teacher, TeacherLink):
            logprobs = self.teacher.logprobs(batch, temperature=self.temperature,
                                             num_rows=self.cfg.data.train_batch_size * self.cfg.rollout.n)
        else:
            logprobs, _ = self.teacher.compute_logprobs(batch, temperature=self.temperature,
                                                        micro_batch_size=self.cfg.teacher.micro_batch_size)
        batch["teacher_logprobs"] = logprobs.cpu()

    def advantages(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        algo = self.cfg.algo
        rewards = token_rewards(batch, algo=algo, acc=acc)  # the score on the last token (- the KL per token)
        if self.critic is not None:
            adv = self.critic.advantages(batch, rewards, acc)  # GAE
        else:  # group estimators: of the score, or of the sum of the token rewards with the KL in them
            scores = rewards.sum(1) if algo.kl_in_reward else batch["scores"]
            adv = compute_advantages(scores, batch["group_index"], batch["response_mask"], algo=algo)
        batch["advantages"] = adv.float()
        mask = batch["response_mask"]
        acc.add("critic/advantages/mean", (adv * mask).sum().item() / max(mask.sum().item(), 1), mask.sum().item())

    def update(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        """The actor's optimizer steps on the batch (:class:`~spmd_rl.actor.ActorUpdate`); a new policy version."""
        self.actor_update(batch, acc)
        self.actor.offload()  # params / optimizer state to CPU if configured (no-op on CPU runs)
        self.policy_version += 1

    # ================================================================== metrics, validation
    def finish_step(self, batch: RolloutBatch, acc: MetricAccumulator, timer: StageTimer) -> dict[str, float]:
        mask = batch["response_mask"]
        acc.add_sum("perf/total_tokens", (mask.sum().item() + sum(len(p) for p in batch.prompts)) * self.place.sum_weight)
        phases = grpo_step_flops(self.flops, [len(p) for p in batch.prompts], mask.sum(1).long().tolist(),
                                 old_logprob=self.need_old_logprobs, ref=self.ref is not None,
                                 ppo_epochs=self.cfg.actor.ppo_epochs)
        for phase, flops in phases.items():
            acc.add_sum(f"perf/flops/{phase}", flops * self.place.sum_weight)
        metrics = acc.reduce(self.group)
        flops = {phase: metrics.pop(f"perf/flops/{phase}") for phase in phases}
        for name, seconds in timer.seconds.items():
            metrics[f"timing_s/{name}"] = seconds  # the loop is lockstep: rank 0's clock speaks for all
        step_s = max(timer.seconds["step"], 1e-9)
        metrics["perf/tokens_per_s"] = metrics.pop("perf/total_tokens") / step_s
        if "async/rollout_busy_s" in metrics:  # the share of the step each pool waited
            waited = timer.seconds.get("wait_rollout", 0.0) + timer.seconds.get("wait_weights", 0.0)
            metrics["async/actor_idle_frac"] = min(waited / step_s, 1.0)
            metrics["async/rollout_idle_frac"] = max(1.0 - metrics["async/rollout_busy_s"] / step_s, 0.0)
        gen_tokens = metrics.pop("perf/gen_tokens")
        metrics["perf/gen_tokens_per_s"] = gen_tokens / max(timer.seconds.get("gen", 1e-9), 1e-9)
        peak = peak_flops(self.env.device)
        if peak:  # perf/mfu/<phase> and perf/mfu for the step; none on CPU or unknown GPUs
            metrics.update(phase_mfu(flops, timer.seconds, peak=peak, world=dist.get_world_size(self.group)))
        self.sink.log(metrics, self.step)
        return metrics

    def validate(self) -> dict[str, float]:
        """``trainer.val_n`` answers per held-out prompt at ``trainer.val_temperature`` (default: one, greedy);
        mean score and accuracy over all answers, pass@k and mean@k (spmd_rl.passk)."""
        if not self.val_samples:
            return {}
        self.sync_weights()
        n = self.cfg.trainer.val_n
        sampling = dict(n=n, temperature=self.cfg.trainer.val_temperature, top_p=1.0, top_k=0,
                        max_new_tokens=self.cfg.rollout.max_new_tokens, seed=self.cfg.trainer.seed)
        if self.link is not None:  # each actor rank gets an even share of the answers, scored once
            self.link.issue(self.val_ids if self.env.is_main else None, sampling, kind="val",
                            num_prompts=len(self.val_ids), pad_token_id=self.pad_id)
            (start, end), out = self.link.take(last=True)  # after the training rounds in flight
            mine = [row // n for row in range(start, end)]  # the prompt of each row (prompt-major, n each)
            prompt_ids = [self.val_ids[i] for i in mine]
            responses = [ids[mask.bool()].tolist() for ids, mask in zip(out["response_ids"], out["response_mask"])]
        else:
            mine, prompt_ids, responses = self._validate_colocated(sampling)
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True) if responses else []  # [] -> ['']
        # every rank scores, also with no prompts: scoring is collective (fail_together, reward model)
        result = self.reward([self.val_samples[i] for i in mine], texts, prompt_ids, responses)
        results = [(i, float(s), m >= 1.0 - 1e-6) for i, s, m in zip(mine, result.scores, result.main_scores)]
        gathered = [r for part in all_gather_objects(results, self.group) for r in part]
        return {
            "val/score": sum(s for _, s, _ in gathered) / len(gathered),
            "val/accuracy": sum(ok for _, _, ok in gathered) / len(gathered),
            **sample_metrics(((i, ok) for i, _, ok in gathered), prefix="val/"),
        }

    def _validate_colocated(self, sampling: dict) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """This rank's validation answers on the colocated rollout, with each one's prompt (index, ids)."""
        dp, mp, mp_size = self.place.rollout_dp, self.place.rollout_mp, self.place.rollout_mp_size
        share = math.ceil(len(self.val_samples) / self.place.rollout_dp_size)
        mine = list(range(dp * share, min((dp + 1) * share, len(self.val_samples))))
        self.rollout.wake_up()
        prompt_ids = [self.val_ids[i] for i in mine]
        responses: list[list[int]] = []
        if mine:
            out = self.rollout.generate(prompt_ids, **sampling)
            responses = [ids[mask.bool()].tolist() for ids, mask in zip(out.response_ids, out.response_mask)]
            mine = [i for i in mine for _ in range(sampling["n"])]  # prompt-major: n answers per prompt
            prompt_ids = [self.val_ids[i] for i in mine]
        self.rollout.sleep(self.cfg.rollout.sleep_level)
        if mp_size > 1:  # the replica's ranks got the same answers: each scores a share of the rows
            part = math.ceil(len(mine) / mp_size)
            keep = range(mp * part, min((mp + 1) * part, len(mine)))
            mine, prompt_ids, responses = ([xs[i] for i in keep] for xs in (mine, prompt_ids, responses))
        return mine, prompt_ids, responses

    def close(self, error: str | None = None) -> None:
        """End the run's resources; serving pools are told to stop (or to abort with ``error``)."""
        self.sink.close()
        if self.link is not None:
            self.link.close(error)
        else:
            self.rollout.close()
        if isinstance(self.teacher, TeacherLink):
            self.teacher.close(error)
        self.checkpointer.close()  # releases the output folder's lock
