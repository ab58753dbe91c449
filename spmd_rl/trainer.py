"""The GRPO trainer: the stages of one step, in lockstep on every rank of the actor's pool.

    trainer = Trainer(cfg, env, groups=build_run_groups(plan, env))   # engines, data, reward
    trainer.fit()

Rank 0 is the controller inside the same loop: it draws the step's prompts and logs. Everything
else is symmetric. The step's batch comes from one object, the batch source (:mod:`spmd_rl.source`),
which the loop asks for the next batch and tells when the weights changed; which source a run has
(colocated or pool rounds, rounds ahead, streamed groups, DAPO's extra rounds) the loop never asks.
Per step:

1-4. batch      the source's stages: ``weight_sync`` and ``gen`` (the rollout gets the actor's weights
                if it holds an older version; rank 0 draws ``data.train_batch_size`` prompts, the
                rollout generates ``rollout.n`` responses each), ``reward`` (each rank scores the rows it
                holds: rules, the reward model or the reward pool, DAPO's overlong penalty) and
                ``relayout`` (to the actor's data-parallel layout); at max staleness S > 0 a
                ``wait_rollout`` for rows generated while earlier updates ran instead;
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

After the update the source hears of the new weights: at S > 0 ``wait_weights`` sends them to the
rollout pool and more work is issued.

Every stage runs under a timer (``timing_s/<stage>``), which is also a ``stage/<name>`` profiler
range for ``trainer.profile_steps`` (:mod:`spmd_rl.profiling`). Metrics are accumulated locally and
reduced over the pool once per step; the update's loss metrics stay device tensors until their
mini-batch ends and are then read in one device-to-host copy (no sync per micro-batch). Validation
(greedy answers on the held-out prompts, or ``trainer.val_n`` sampled ones with pass@k) runs before
the first step, every ``trainer.val_every`` steps and after the last.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist

from spmd_rl import console
from spmd_rl.actor import ActorUpdate, log_rollout_gap
from spmd_rl.algo.filtering import DynamicSampling
from spmd_rl.algo.objective import compute_advantages
from spmd_rl.checkpoint import Checkpointer, checkpoint_bytes
from spmd_rl.checkpoint_files import model_parameters
from spmd_rl.config import Config, to_dict, to_yaml
from spmd_rl.critic import build_critic, token_rewards
from spmd_rl.data import build_prompts
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.data.prompts import render_prompts
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.distill import TeacherLink, check_tokenizers
from spmd_rl.distributed.comm import all_gather_objects, fail_together
from spmd_rl.distributed.env import DistEnv, format_rank_table
from spmd_rl.distributed.pools import GLOBAL
from spmd_rl.engine import build_engine, build_reference, build_teacher, engine_spec
from spmd_rl.metrics import MetricAccumulator, NullSink, RunSink, grpo_step_flops, peak_flops, phase_mfu
from spmd_rl.models import FlopsModel, eos_token_ids, load_tokenizer, resolve_model_path
from spmd_rl.models.tokenizer import decode_tokens
from spmd_rl.passk import answer_metrics, is_correct
from spmd_rl.plan import plan
from spmd_rl.profiling import format_stage_times, profiled, stage_times
from spmd_rl.reward.run import build_run_reward
from spmd_rl.rollout import build_rollout_from_config
from spmd_rl.seeds import engine_seed
from spmd_rl.episodes.build import build_episode_runner, episode_prompt_length, episodes_on
from spmd_rl.source import (
    ActorLayout, BatchSource, Episodes, LocalRollout, PoolRollout, Scorer, StepPrompts, build_batch_source,
)
from spmd_rl.step import Placement, StageTimer
from spmd_rl.world import RunGroups, build_run_groups

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
        console.phase("building the engines (actor, reference, rollout)")
        self._build_engines(groups)  # actor, reference, critic, teacher
        self.rollout = self._rollout(groups)  # the engine in this process, or the rollout pool's link
        self.policy_version = 0  # actor updates so far
        self.source = self._batch_source()
        self.flops = FlopsModel.from_config(self.actor.config)  # per-phase MFU from the real lengths
        self.actor_update = ActorUpdate(self.actor, cfg=cfg, mini_batches=self.mini_batches,
                                        sum_weight=self.place.sum_weight, group=self.group, device=env.device,
                                        temperature=self.temperature, logs_rollout_gap=self.logs_rollout_gap)
        self.step = 0
        in_flight = self.source.in_flight  # what a checkpoint holds of the rounds in flight (None: none ever are)
        self.checkpointer.track(model_folder=self.model_folder, export=self.actor.export_weights,
                                actor=self.actor, sampler=self.sampler, optional=["in_flight"],
                                **({"in_flight": in_flight} if in_flight is not None else {}),
                                **({"critic": self.critic.engine} if self.critic else {}))
        self.checkpointer.check_writable(checkpoint_bytes(  # before the first step, not at the first save
            model_parameters(self.model_folder) * (2 if self.critic else 1),
            hf_copy=engine_spec(cfg.actor.engine).export_copy, weights_only=cfg.checkpoint.weights_only))

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
        The same numbers as a separate forward, one forward less per step. Rejection by divergence
        (``algo.rollout_rs``) and batch-normalised weights need every token's old log-prob before the
        first micro-batch: the forward runs for them too."""
        algo = self.cfg.algo
        return (self.updates_per_step > 1 or algo.kl_in_reward or algo.rollout_rs is not None
                or algo.rollout_is_batch_normalize)

    @property
    def logs_rollout_gap(self) -> bool:
        """Whether the update compares its own log-probs with the rollout's when no old-log-prob forward
        ran (``rollout/logprob_abs_diff``; ``async/logprob_abs_diff_fresh`` for the tokens the current
        weights sampled): where the IS correction or stale samples use the rollout's. The forward, when
        it runs, always logs them."""
        return self.cfg.algo.rollout_is != "none" or self.cfg.trainer.max_staleness > 0

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

    def _rollout(self, groups: RunGroups) -> LocalRollout | PoolRollout:
        """The colocated rollout engine (taking turns on the device with the actor), or the link to the
        rollout pool (``pools.rollout_ranks`` > 0), whose queue holds S + 1 training rounds and a
        validation one."""
        cfg, dtype = self.cfg, torch.bfloat16 if self.env.device.type == "cuda" else None
        episodes = self._episodes(here=groups.rollout_link is None) if episodes_on(cfg) else None
        if groups.rollout_link is not None:
            groups.rollout_link.max_in_flight = cfg.trainer.max_staleness + 2
            groups.rollout_link.record_experts = cfg.actor.router_replay
            return PoolRollout(groups.rollout_link, dtype=dtype, is_controller=self.env.is_main,
                               pad_token_id=self.pad_id, episodes=episodes)
        engine = build_rollout_from_config(
            cfg.rollout, model_folder=self.model_folder, device=self.env.device, pad_token_id=self.pad_id,
            eos_token_ids=self.eos_ids, trust_remote_code=cfg.model.trust_remote_code,
            max_prompt_length=episode_prompt_length(cfg), seed=engine_seed(cfg.trainer.seed, self.place.rollout_dp),
            pool_groups=groups.rollout_pool_groups, record_routes=cfg.actor.router_replay)
        return LocalRollout(engine, place=self.place, sleep_level=cfg.rollout.sleep_level_on(self.env.device.type),
                            dtype=dtype, episodes=episodes)

    def _episodes(self, *, here: bool) -> Episodes:
        """``--env.*`` / ``--agent.fn``: every response a multi-turn episode (:mod:`spmd_rl.episodes`),
        played from the data rows by an environment or by an agent through the endpoint. With a rollout
        pool (not ``here``) the runner is built there (:mod:`spmd_rl.serve`): here it is None, and the rows go
        with each round."""
        rows = [s.row for s in self.train_samples], [s.row for s in self.val_samples]
        if not here:
            return Episodes(None, *rows)
        return Episodes(build_episode_runner(self.cfg, self.tokenizer, self.eos_ids), *rows)

    def _batch_source(self) -> BatchSource:
        """Where each step's batch comes from (:mod:`spmd_rl.source`): synchronous rounds (with DAPO's
        extra rounds under ``algo.filter_groups``), rounds ahead or streamed groups at max staleness S > 0."""
        cfg = self.cfg
        prompts = StepPrompts(self.sampler, self.train_ids, group=self.group, src=self.pool.spec.start,
                              is_controller=self.env.is_main, rollout=cfg.rollout, seed=cfg.trainer.seed)
        scorer = Scorer(self.reward, samples=self.train_samples, tokenizer=self.tokenizer, reward_cfg=cfg.reward,
                        max_new_tokens=cfg.rollout.max_new_tokens)
        dynamic = DynamicSampling(  # DAPO: rounds until data.train_batch_size groups whose scores differ
            train_batch_size=cfg.data.train_batch_size, n=cfg.rollout.n, max_rounds=cfg.algo.max_sample_rounds,
            group=self.group, actor_dp=self.place.actor_dp, actor_dp_size=self.place.actor_dp_size,
            pad_token_id=self.pad_id) if cfg.algo.filter_groups else None
        return build_batch_source(
            self.rollout, staleness=cfg.trainer.max_staleness, stream=cfg.rollout.stream, dynamic=dynamic,
            total_steps=cfg.trainer.total_steps, actor=self.actor, prompts=prompts, scorer=scorer,
            layout=ActorLayout(self.place, self.pool.rank, self.pool.size, self.group, self.pad_id))

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
            console.phase("validating before the first step")
            self.sink.log(self.validate(), self.step)
        self.source.start(self.step, self.policy_version)
        while self.step < cfg.total_steps:
            self.step += 1
            self.sink.step_started(self.step, self.env.device)
            timer, acc = StageTimer(self.step), MetricAccumulator()
            with self.profiled() as prof, timer("step"):
                batch = self.source.next_batch(self.step, acc, timer)  # generated, scored, in the actor's layout
                self.train_on(batch, acc, timer)
                self.source.weights_changed(self.step, self.policy_version, timer)
            last = self.finish_step(batch, acc, timer)
            self.report_profile(prof)
            last.update(self.maybe_validate())
            self.checkpointer.maybe_save(self.step)
        return last

    def train_on(self, batch: RolloutBatch, acc: MetricAccumulator, timer: StageTimer) -> None:
        """Stages 5-11 on the step's batch: log-probs, values, advantages, the updates."""
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

    @property
    def trace_path(self) -> str:
        return os.path.join(self.cfg.trainer.output_dir, "profile", f"step{self.step}_rank{self.env.rank}.json.gz")

    def profiled(self):
        """The step under torch.profiler when it is one of ``trainer.profile_steps``."""
        return profiled(self.env.device, self.trace_path) if self.step in self.cfg.trainer.profile_steps else nullcontext()

    def report_profile(self, prof) -> None:
        if prof is not None and self.env.is_main:
            log.info("step %d under torch.profiler (trace: %s):\n%s", self.step, self.trace_path,
                     format_stage_times(stage_times(prof)))

    def maybe_validate(self) -> dict[str, float]:
        """Validation every ``trainer.val_every`` steps and after the last."""
        every, total = self.cfg.trainer.val_every, self.cfg.trainer.total_steps
        if not every or (self.step % every and self.step != total):
            return {}
        val = self.validate()
        self.sink.log(val, self.step)
        return val

    # ================================================================== stages
    def old_logprobs(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        # With a single optimizer step per batch the update's own log-probs (detached) are the old ones:
        # ratio == 1 exactly, and a whole forward pass is saved (see need_old_logprobs).
        if not self.need_old_logprobs:
            return
        logprobs, _ = self.actor.compute_logprobs(batch, temperature=self.temperature,
                                                  micro_batch_size=self.cfg.actor.micro_batch_size)
        batch["old_logprobs"] = logprobs.cpu()
        log_rollout_gap(acc, logprobs, batch)

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
        self.actor.offload()  # params / optimizer state to host memory if configured; on CPU runs the gradients go
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
        metrics.update(self.checkpointer.pop_timing())  # the saves since the last step's line (after step - 1)
        step_s = max(timer.seconds["step"], 1e-9)
        metrics["perf/tokens_per_s"] = metrics.pop("perf/total_tokens") / step_s
        if self.env.device.type == "cuda":  # every pool's processes share the run's GPUs, pools.colocate to a GPU
            gpus = max(dist.get_world_size() // self.cfg.pools.colocate, 1)
            metrics["perf/tokens_per_s_per_gpu"] = metrics["perf/tokens_per_s"] / gpus
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
        self.rollout.sync(self.actor, self.policy_version)
        sampling = dict(n=self.cfg.trainer.val_n, temperature=self.cfg.trainer.val_temperature, top_p=1.0, top_k=0,
                        max_new_tokens=self.cfg.rollout.max_new_tokens, seed=self.cfg.trainer.seed)
        got = self.rollout.answers(self.val_ids, sampling)
        if got.scores is not None:  # episodes: their environments' rewards
            scores = main = got.scores
        else:  # every rank scores, also with no prompts: scoring is collective (fail_together, reward model)
            texts = decode_tokens(self.tokenizer, got.responses)
            result = self.reward([self.val_samples[i] for i in got.prompts], texts, got.prompt_ids, got.responses)
            scores, main = result.scores, result.main_scores
        answers = [(i, float(s), is_correct(m)) for i, s, m in zip(got.prompts, scores, main)]
        return answer_metrics([a for part in all_gather_objects(answers, self.group) for a in part], prefix="val/")

    def close(self, error: str | None = None) -> None:
        """End the run's resources; serving pools are told to stop (or to abort with ``error``)."""
        self.sink.close()
        self.rollout.close(error)
        if isinstance(self.teacher, TeacherLink):
            self.teacher.close(error)
        self.checkpointer.close()  # releases the output folder's lock
