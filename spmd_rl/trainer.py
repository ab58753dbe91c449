"""The GRPO trainer: the seven stages of one step, in lockstep on every rank.

    trainer = Trainer(cfg, env, groups=build_run_groups(plan, env))   # engines, data, reward
    trainer.fit()

Rank 0 is the controller inside the same loop: it draws the step's prompts and logs. Everything
else is symmetric. Per step:

1. prompts   rank 0 draws ``data.train_batch_size`` prompt indices and broadcasts them; each
             rollout data-parallel rank takes a contiguous slice (tp ranks of a group share one);
2. rollout   the rollout engine receives the actor's weights if they changed (hot-swap), generates
             ``rollout.n`` responses per prompt, sleeps;
3. reward    each rank scores the responses it holds: rules, plus the reward model (colocated, or
             a round trip to the reward pool when ``pools.reward_ranks`` > 0);
4. old       actor log-probs before the update (only when a step makes several optimizer steps);
5. ref       frozen reference log-probs (when the KL loss is on);
6. adv       group advantages, local since all n responses of a prompt are on one rank;
7. update    mini-batches x micro-batches with global token normalisation.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.distributed as dist

from spmd_rl.algo.objective import actor_objective, compute_advantages
from spmd_rl.checkpoint import Checkpointer
from spmd_rl.config import Config, to_dict, to_yaml
from spmd_rl.data import build_prompts
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.data.prompts import render_prompts
from spmd_rl.data.sampler import PromptSampler
from spmd_rl.distributed.plan import plan
from spmd_rl.distributed.comm import all_gather_objects, broadcast_object, fail_together, relayout
from spmd_rl.distributed.env import DistEnv, format_rank_table
from spmd_rl.distributed.world import RunGroups, build_run_groups
from spmd_rl.engine.fsdp import FSDPEngine
from spmd_rl.metrics import MetricAccumulator, NullSink, RunSink, grpo_step_flops, peak_flops, phase_mfu
from spmd_rl.models import FlopsModel, load_tokenizer, resolve_model_path
from spmd_rl.profiling import STAGE_PREFIX, format_stage_times, profiled, stage_times
from spmd_rl.reward.run import build_run_reward
from spmd_rl.rollout import build_rollout

log = logging.getLogger("spmd_rl")


class StageTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        with torch.profiler.record_function(STAGE_PREFIX + name):  # a named range under torch.profiler
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, groups: RunGroups | None = None) -> None:
        """``groups``: the run's pools and meshes, built on every rank of the world (by
        ``spmd_rl.train``, before the reward ranks go to their own loop); built here when None."""
        self.cfg = cfg
        self.env = env
        self.plan = plan(cfg, env.world_size, env.local_world_size) if groups is None else groups.plan
        if cfg.rollout.backend == "native" and cfg.rollout.tp * cfg.rollout.pp > 1:
            raise ValueError(
                f"rollout.tp ({cfg.rollout.tp}) * rollout.pp ({cfg.rollout.pp}) > 1 needs a sharded rollout "
                "engine; the native engine holds a whole model per rank: use --rollout.tp 1 --rollout.pp 1 "
                "or --rollout.backend vllm"
            )
        groups = groups or build_run_groups(self.plan, env)
        self.pools = groups.pools
        self.pool = self.pools.get("global")
        self.group = self.pool.group
        rows = groups.rank_table
        # Picks the checkpoint to resume from (and trims metrics.jsonl) before the sink opens it.
        self.checkpointer = Checkpointer(checkpoint=cfg.checkpoint, output_dir=cfg.trainer.output_dir,
                                         total_steps=cfg.trainer.total_steps, rank_table=rows,
                                         config=to_dict(cfg), device=env.device, group=self.group)
        self.sink = RunSink(logging_cfg=cfg.logging, output_dir=cfg.trainer.output_dir,
                            total_steps=cfg.trainer.total_steps, start_step=self.checkpointer.start_step,
                            config_dict=to_dict(cfg)) if env.is_main else NullSink()
        self.sink.info("rank table\n" + format_rank_table(rows))
        if env.is_main:
            os.makedirs(cfg.trainer.output_dir, exist_ok=True)
            with open(os.path.join(cfg.trainer.output_dir, "config.yaml"), "w") as f:
                f.write(to_yaml(cfg))
            self.sink.info("resolved config\n" + to_yaml(cfg))

        with fail_together(group=self.group, what="model and data setup"):
            tiny = dict(layers=cfg.model.tiny_layers, hidden=cfg.model.tiny_hidden, heads=cfg.model.tiny_heads,
                        kv_heads=cfg.model.tiny_kv_heads, seed=cfg.model.tiny_seed)
            self.model_folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir, tiny=tiny)
            self.tokenizer = load_tokenizer(self.model_folder, trust_remote_code=cfg.model.trust_remote_code)
            train, val = build_prompts(cfg.data)
            self.train_samples, self.train_ids, dropped = render_prompts(
                train, self.tokenizer, system_prompt=cfg.data.system_prompt, max_prompt_length=cfg.data.max_prompt_length)
            self.val_samples, self.val_ids, val_dropped = render_prompts(
                val, self.tokenizer, system_prompt=cfg.data.system_prompt, max_prompt_length=cfg.data.max_prompt_length)
            self.reward = build_run_reward(
                reward=cfg.reward, task=cfg.data.task, system_prompt=cfg.data.system_prompt,
                actor_tokenizer=self.tokenizer, group=self.group, mesh=groups.actor_mesh, exchange=groups.exchange,
                device=env.device, cache_dir=cfg.model.cache_dir)
        if dropped or val_dropped:
            self.sink.info(f"dropped {dropped} training and {val_dropped} validation prompts longer than "
                           f"data.max_prompt_length={cfg.data.max_prompt_length} tokens")
        if len(self.train_samples) < cfg.data.train_batch_size:
            raise ValueError(f"only {len(self.train_samples)} training prompts for data.train_batch_size="
                             f"{cfg.data.train_batch_size}")
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.eos_ids = _eos_ids(self.tokenizer)
        self.sampler = PromptSampler(len(self.train_samples), cfg.data.train_batch_size, cfg.data.seed)

        # Engines. Rollout is (dp, tp=1, pp=1) over the pool; the actor's data-parallel ranks are
        # the Ulysses dp coordinates (pool rank // ulysses_size), so with sp > 1 the relayout in
        # fit() hands every sp rank of a dp group the same rows (identity when sp == 1).
        torch.manual_seed(cfg.trainer.seed)
        dev = env.device
        self.mini_batches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        self.updates_per_step = self.mini_batches * cfg.actor.ppo_epochs
        mesh = groups.actor_mesh
        layout = dict(group=self.group, sp_group=groups.sp_group, use_packing=cfg.actor.use_packing,
                      max_tokens_per_gpu=cfg.actor.max_tokens_per_gpu)
        if cfg.actor.engine == "megatron":  # same interface; actor and reference share megatron's groups
            from spmd_rl.engine.megatron import MegatronEngine

            common = dict(model_folder=self.model_folder, device=dev, layout=self.plan.megatron,
                          megatron=cfg.actor.megatron, trust_remote_code=cfg.model.trust_remote_code,
                          pad_token_id=self.pad_id, seed=cfg.trainer.seed)
            self.actor = MegatronEngine(actor=cfg.actor, total_updates=cfg.trainer.total_steps * self.updates_per_step,
                                        trainable=True, **common)
            self.ref = MegatronEngine(trainable=False, **common) if cfg.algo.use_kl_loss else None
        else:
            self.actor = FSDPEngine(
                model_folder=self.model_folder, mesh=mesh, device=dev, fsdp=cfg.actor.fsdp, actor=cfg.actor,
                total_updates=cfg.trainer.total_steps * self.updates_per_step, trainable=True,
                gradient_checkpointing=cfg.model.gradient_checkpointing,
                trust_remote_code=cfg.model.trust_remote_code, pad_token_id=self.pad_id, **layout,
            )
            self.ref = None
            if cfg.algo.use_kl_loss:
                self.ref = FSDPEngine(
                    model_folder=self.model_folder, mesh=mesh, device=dev, fsdp=cfg.actor.fsdp, trainable=False,
                    trust_remote_code=cfg.model.trust_remote_code, pad_token_id=self.pad_id,
                    param_offload=cfg.ref.param_offload, **layout,
                )
        self.rollout_dp = self.plan.rollout_dp_rank(self.pool.rank)
        self.rollout_dp_size = self.plan.rollout_dp_size
        # The tp x pp ranks of one rollout replica generate the same rows; each keeps a contiguous
        # share (mp rank), so rank order (dp, mp) = pool rank order is the global row order.
        coords = self.plan.rollout.coords(self.pool.rank)
        self.rollout_mp_size = cfg.rollout.tp * cfg.rollout.pp
        self.rollout_mp = coords["pp"] * cfg.rollout.tp + coords["tp"]
        self.rollout_src = ((self.pool.rank, self.pool.size) if self.rollout_mp_size > 1
                            else (self.rollout_dp, self.rollout_dp_size))
        options: dict[str, object] = {"compile_decode": None if cfg.rollout.compile_decode else False}
        if cfg.rollout.backend == "vllm":  # seed: the same inside a replica, different across replicas
            options = dict(tp=cfg.rollout.tp, pp=cfg.rollout.pp, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                           max_model_len=cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                           seed=cfg.trainer.seed * 1_000_003 + self.rollout_dp)
        self.rollout = build_rollout(
            cfg.rollout.backend, model_folder=self.model_folder, device=dev,
            dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
            batch_size=cfg.rollout.batch_size, pad_token_id=self.pad_id, eos_token_ids=self.eos_ids,
            trust_remote_code=cfg.model.trust_remote_code, **options,
        )
        self.weights_stale = False
        # Old log-probs: needed for several optimizer steps per batch, and by the IS correction
        # (the trainer's own log-probs of the sampling policy).
        self.need_old_logprobs = self.updates_per_step > 1 or cfg.algo.rollout_is != "none"
        self.actor_dp = self.plan.actor_dp_rank(self.pool.rank)
        self.actor_dp_size = self.plan.actor_dp_size
        # The sp ranks of a dp group hold the same rows: only sp rank 0 adds them to sums over the
        # pool (token counts for the loss, summed metrics); weighted means are unaffected.
        self.sum_weight = 1.0 if self.plan.ulysses.coords(self.pool.rank)["sp"] == 0 else 0.0
        if cfg.actor.engine == "megatron":  # tp/cp/pp ranks share rows: count on tp 0 of the last stage (loss_fn runs there)
            c, mp = self.plan.megatron.coords(self.pool.rank), self.plan.megatron
            self.sum_weight = float(c["tp"] == 0 and c["cp"] == 0 and c["pp"] == mp.pp - 1)
        self.flops = FlopsModel.from_config(self.actor.config)  # per-phase MFU from the real lengths
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.step = 0
        self.checkpointer.track(model_folder=self.model_folder, actor=self.actor, sampler=self.sampler)

    # ================================================================== the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        last: dict[str, float] = {}
        self.step = self.checkpointer.resume()
        # Resumed actor weights differ from the rollout's base copy: hot-swap before generating.
        self.weights_stale = self.step > 0
        if cfg.val_every and self.step == 0:  # a resumed run validated this step before saving it
            self.sink.log(self.validate(), self.step)
        while self.step < cfg.total_steps:
            self.step += 1
            timer = StageTimer()
            acc = MetricAccumulator()
            trace = os.path.join(cfg.output_dir, "profile", f"step{self.step}_rank{self.env.rank}.json.gz")
            profiling = profiled(self.env.device, trace) if self.step in cfg.profile_steps else nullcontext()
            with profiling as prof, timer("step"):
                with timer("gen"):
                    batch = self.generate(acc, timer)
                with timer("reward"):
                    self.score(batch, acc)
                batch = relayout(batch, src=self.rollout_src,
                                 dst=(self.actor_dp, self.actor_dp_size), group=self.group, pad_token_id=self.pad_id)
                with timer("old_logprob"):
                    self.old_logprobs(batch, acc)
                with timer("ref"):
                    self.ref_logprobs(batch)
                with timer("adv"):
                    self.advantages(batch, acc)
                with timer("update"):
                    self.update(batch, acc)
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
    def generate(self, acc: MetricAccumulator, timer: StageTimer) -> RolloutBatch:
        indices = broadcast_object(self.sampler.next_batch() if self.env.is_main else None,
                                   src=self.pool.spec.start, group=self.group)
        if not self.env.is_main:
            self.sampler.next_batch()  # keep every rank's sampler in step, for checkpoints
        per_rank = len(indices) // self.rollout_dp_size
        mine = list(range(self.rollout_dp * per_rank, (self.rollout_dp + 1) * per_rank))
        with timer("weight_sync"):
            self.sync_weights()
        self.rollout.wake_up()
        out = self.rollout.generate(
            [self.train_ids[indices[i]] for i in mine], n=self.cfg.rollout.n,
            temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p, top_k=self.cfg.rollout.top_k,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            seed=self.cfg.trainer.seed * 1_000_003 + self.step * 7919 + self.rollout_dp,
        )
        self.rollout.sleep(self.cfg.rollout.sleep_level)
        n = self.cfg.rollout.n
        rows = [i for i in mine for _ in range(n)]
        batch = RolloutBatch(
            prompts=out.prompt_ids,
            tensors={
                "response_ids": out.response_ids.cpu(),
                "response_mask": out.response_mask.float().cpu(),
                "rollout_logprobs": out.logprobs.float().cpu(),
                "group_index": torch.tensor(rows, dtype=torch.long),
                "truncated": out.truncated.cpu(),
            },
            extras={"sample": [indices[i] for i in rows]},
        )
        if self.rollout_mp_size > 1:  # every rank of the replica holds these rows: keep a share
            share = len(batch) // self.rollout_mp_size
            batch = batch.select(range(self.rollout_mp * share, (self.rollout_mp + 1) * share))
        lengths = batch["response_mask"].sum(1)
        for length in lengths.tolist():
            acc.add("response_length/mean", length)
        acc.add_max("response_length/max", lengths.max().item())
        acc.add_min("response_length/min", lengths.min().item())
        for flag in batch["truncated"].tolist():
            acc.add("response_length/clip_ratio", float(flag))
        acc.add_sum("perf/gen_tokens", lengths.sum().item())
        return batch

    def sync_weights(self) -> None:
        """Hot-swap: stream the actor's full tensors into the rollout engine (all ranks together)."""
        if not self.weights_stale and not self.rollout.needs_weights:
            return
        dtype = torch.bfloat16 if self.env.device.type == "cuda" else None
        self.rollout.load_weights(self.actor.named_full_tensors(dtype=dtype))
        self.weights_stale = False

    def score(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        samples = [self.train_samples[i] for i in batch.extras["sample"]]
        responses = [ids[mask.bool()].tolist() for ids, mask in zip(batch["response_ids"], batch["response_mask"])]
        completions = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        result = self.reward(samples, completions, batch.prompts, responses)
        scores = torch.tensor(result.scores, dtype=torch.float32)
        batch["scores"] = scores
        batch.extras["completion"] = completions
        for s in scores.tolist():
            acc.add("critic/score/mean", s)
        acc.add_max("critic/score/max", scores.max().item())
        acc.add_min("critic/score/min", scores.min().item())
        acc.add_sum("reward/errors", result.num_errors)
        if result.model_scores is not None:  # the two parts of critic/score: rule + weight * model
            for total, model in zip(result.scores, result.model_scores):
                acc.add("reward/model_score/mean", model)
                acc.add("reward/rule_score/mean", total - self.cfg.reward.model.weight * model)

    def old_logprobs(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        # On-policy with a single optimizer step per batch, the update's own log-probs (detached)
        # are the old ones: ratio == 1 exactly, and a whole forward pass is saved (unless the IS
        # correction needs them).
        if not self.need_old_logprobs:
            return
        logprobs, _ = self.actor.compute_logprobs(batch, temperature=self.temperature,
                                                  micro_batch_size=self.cfg.actor.micro_batch_size)
        batch["old_logprobs"] = logprobs.cpu()
        mask = batch["response_mask"]
        diff = ((logprobs.cpu() - batch["rollout_logprobs"]).abs() * mask).sum()
        acc.add("rollout/logprob_abs_diff", diff.item() / max(mask.sum().item(), 1), mask.sum().item())

    def ref_logprobs(self, batch: RolloutBatch) -> None:
        if self.ref is None:
            return
        logprobs, _ = self.ref.compute_logprobs(batch, temperature=self.temperature,
                                                micro_batch_size=self.cfg.ref.micro_batch_size)
        batch["ref_logprobs"] = logprobs.cpu()

    def advantages(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        adv = compute_advantages(batch["scores"], batch["group_index"], batch["response_mask"], algo=self.cfg.algo)
        batch["advantages"] = adv.float()
        mask = batch["response_mask"]
        acc.add("critic/advantages/mean", (adv * mask).sum().item() / max(mask.sum().item(), 1), mask.sum().item())

    def update(self, batch: RolloutBatch, acc: MetricAccumulator) -> None:
        cfg = self.cfg
        device = self.env.device
        for _epoch in range(cfg.actor.ppo_epochs):
            for mini in batch.chunks(self.mini_batches):
                counts = torch.tensor([mini["response_mask"].sum().item(), float(len(mini))],
                                      dtype=torch.float64) * self.sum_weight
                if dist.get_world_size(self.group) > 1:
                    dist.all_reduce(counts, group=self.group)
                global_tokens, global_seqs = counts.tolist()

                pending: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []  # read after the step: no sync

                def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: RolloutBatch):
                    mask = micro["response_mask"].to(device)
                    old = micro["old_logprobs"].to(device) if "old_logprobs" in micro else logprobs.detach()
                    ref = micro["ref_logprobs"].to(device) if "ref_logprobs" in micro else None
                    sampled = micro["rollout_logprobs"].to(device) if cfg.algo.rollout_is != "none" else None
                    loss, metrics = actor_objective(
                        logprobs, entropy, old_logprobs=old, advantages=micro["advantages"].to(device),
                        response_mask=mask, ref_logprobs=ref, algo=cfg.algo,
                        global_tokens=global_tokens, global_seqs=global_seqs, rollout_logprobs=sampled)
                    tokens = mask.sum()
                    for key, value in metrics.items():
                        global_part = key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
                        pending.append((key, value.detach(), None if global_part else tokens))
                    return loss, metrics

                stats = self.actor.train_mini_batch(
                    self.actor.micro_batches(mini, micro_batch_size=cfg.actor.micro_batch_size), loss_fn,
                    temperature=self.temperature, need_entropy_grad=cfg.algo.entropy_coef > 0)
                if pending:  # one device-to-host copy for the mini-batch's metrics: (value, tokens) pairs
                    pairs = torch.stack([torch.stack([v, v if t is None else t]).float().reshape(2)
                                         for _, v, t in pending]).tolist()
                    for (key, _, tokens), (value, weight) in zip(pending, pairs):
                        if tokens is None:  # global parts
                            acc.add_sum(key, value * self.sum_weight / self.updates_per_step)
                        else:
                            acc.add(key, value, weight)
                # grad_norm and lr are identical on every rank; weight 1 per rank keeps the mean exact.
                skipped = stats.get("skipped", 0.0)  # a non-finite update the engine was allowed to skip
                if not skipped:
                    acc.add("actor/grad_norm", stats["grad_norm"])
                acc.add("actor/skipped_updates", skipped * self.updates_per_step)  # mean x count = count
                acc.add("actor/lr", stats["lr"])
        self.actor.offload()  # params / optimizer state to CPU if configured (no-op on CPU runs)
        self.weights_stale = True

    # ================================================================== metrics, validation
    def finish_step(self, batch: RolloutBatch, acc: MetricAccumulator, timer: StageTimer) -> dict[str, float]:
        mask = batch["response_mask"]
        acc.add_sum("perf/total_tokens", (mask.sum().item() + sum(len(p) for p in batch.prompts)) * self.sum_weight)
        phases = grpo_step_flops(self.flops, [len(p) for p in batch.prompts], mask.sum(1).long().tolist(),
                                 old_logprob=self.need_old_logprobs, ref=self.ref is not None,
                                 ppo_epochs=self.cfg.actor.ppo_epochs)
        for phase, flops in phases.items():
            acc.add_sum(f"perf/flops/{phase}", flops * self.sum_weight)
        metrics = acc.reduce(self.group)
        flops = {phase: metrics.pop(f"perf/flops/{phase}") for phase in phases}
        for name, seconds in timer.seconds.items():
            metrics[f"timing_s/{name}"] = seconds  # the loop is lockstep: rank 0's clock speaks for all
        step_s = max(timer.seconds["step"], 1e-9)
        metrics["perf/tokens_per_s"] = metrics.pop("perf/total_tokens") / step_s
        gen_tokens = metrics.pop("perf/gen_tokens")
        metrics["perf/gen_tokens_per_s"] = gen_tokens / max(timer.seconds.get("gen", 1e-9), 1e-9)
        peak = peak_flops(self.env.device)
        if peak:  # perf/mfu/<phase> and perf/mfu for the step; none on CPU or unknown GPUs
            metrics.update(phase_mfu(flops, timer.seconds, peak=peak, world=dist.get_world_size(self.group)))
        self.sink.log(metrics, self.step)
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy (``rollout.val_temperature``) answers to the held-out prompts; mean score and accuracy."""
        if not self.val_samples:
            return {}
        self.sync_weights()
        share = math.ceil(len(self.val_samples) / self.rollout_dp_size)
        mine = list(range(self.rollout_dp * share, min((self.rollout_dp + 1) * share, len(self.val_samples))))
        self.rollout.wake_up()
        prompt_ids = [self.val_ids[i] for i in mine]
        responses: list[list[int]] = []
        if mine:
            out = self.rollout.generate(
                prompt_ids, n=1, temperature=self.cfg.rollout.val_temperature,
                top_p=1.0, top_k=0, max_new_tokens=self.cfg.rollout.max_new_tokens, seed=self.cfg.trainer.seed)
            responses = [ids[mask.bool()].tolist() for ids, mask in zip(out.response_ids, out.response_mask)]
        if self.rollout_mp_size > 1:  # the replica's ranks got the same answers: each scores a share
            part = math.ceil(len(mine) / self.rollout_mp_size)
            keep = range(self.rollout_mp * part, min((self.rollout_mp + 1) * part, len(mine)))
            mine, prompt_ids, responses = ([xs[i] for i in keep] for xs in (mine, prompt_ids, responses))
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True) if responses else []  # [] -> ['']
        # every rank scores, also with no prompts: scoring is collective (fail_together, reward model)
        result = self.reward([self.val_samples[i] for i in mine], texts, prompt_ids, responses)
        results = [(float(s), float(m >= 1.0 - 1e-6)) for s, m in zip(result.scores, result.main_scores)]
        self.rollout.sleep(self.cfg.rollout.sleep_level)
        gathered = [r for part in all_gather_objects(results, self.group) for r in part]
        return {
            "val/score": sum(s for s, _ in gathered) / len(gathered),
            "val/accuracy": sum(a for _, a in gathered) / len(gathered),
        }

    def close(self) -> None:
        self.sink.close()
        self.rollout.close()


def _eos_ids(tokenizer) -> list[int]:
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    return sorted(ids)
