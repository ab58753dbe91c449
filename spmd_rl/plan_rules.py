"""The rules :func:`spmd_rl.plan.plan` checks between config sections, one function per feature: the
training engine's and the rollout backend's support (LoRA, the MoE loss, router replay, sharded
rollouts), multi-turn episodes, DAPO's extra rounds, a teacher, a critic, asynchronous staleness and
what may run while weights are in flight. Each raises ``ValueError`` naming the flags to change (or
returns the warnings the layout tool prints); none needs the world size, which ``plan.py`` handles with
the layouts, batch sizes and pools.

    check_episodes(cfg, backend_spec(cfg.rollout.backend), rollout_pool=True)   # ValueError naming the flag
    warnings = staleness_warnings(cfg, rollout_pool=True)                        # what the layout tool prints
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spmd_rl.algo import CRITIC_ESTIMATOR_NAMES
from spmd_rl.distributed.dims import RolloutLayout
from spmd_rl.engine import ENGINES
from spmd_rl.rollout import BACKENDS

if TYPE_CHECKING:
    from spmd_rl.config import Config
    from spmd_rl.models.shape import ModelShape


def staleness_warnings(cfg: Config, *, rollout_pool: bool) -> list[str]:
    """Asynchronous GRPO (``trainer.max_staleness`` > 0) needs a rollout pool; its warnings."""
    if cfg.trainer.max_staleness == 0:
        return []
    if not rollout_pool:
        raise ValueError(
            f"trainer.max_staleness={cfg.trainer.max_staleness} overlaps generation with the update, which needs "
            f"the rollout on ranks of its own: set --pools.rollout-ranks N (N > 0), or --trainer.max-staleness 0")
    if cfg.algo.rollout_is == "none":
        return [f"trainer.max_staleness={cfg.trainer.max_staleness} trains on samples of an older policy "
                f"with no importance correction: consider --algo.rollout-is token"]
    return []


def check_engine(cfg: Config, engine: Any) -> None:
    """What the training engine in use (its registry entry) supports: LoRA, the MoE loss, its flags."""
    if cfg.actor.lora.enabled and not engine.lora:
        supported = sorted(name for name, spec in ENGINES.items() if spec.lora)
        raise ValueError(f"actor.lora.rank={cfg.actor.lora.rank} trains LoRA adapters, which actor.engine="
                         f"{cfg.actor.engine} does not support: use --actor.engine {' or '.join(supported)}, or "
                         f"--actor.lora.rank 0 for full fine-tuning")
    if cfg.algo.moe_aux_coef > 0 and not engine.moe_aux:
        supported = sorted(name for name, spec in ENGINES.items() if spec.moe_aux)
        raise ValueError(f"algo.moe_aux_coef={cfg.algo.moe_aux_coef} adds the router's load-balancing loss, which "
                         f"actor.engine={cfg.actor.engine} does not compute (its MoE layers train without it): use "
                         f"--algo.moe-aux-coef 0 or --actor.engine {' or '.join(supported)}")
    ignored = engine.ignored_flags(cfg.actor)
    if ignored:
        raise ValueError(f"{', '.join(ignored)} apply to actor.engine=fsdp only; unset them for "
                         f"actor.engine={cfg.actor.engine} (which uses actor.micro_batch_size)")


def check_backend(cfg: Config, backend: Any, rollout: RolloutLayout) -> None:
    """What the rollout backend in use (its registry entry) supports: sharded models, its own rules."""
    if not backend.model_parallel and rollout.tp * rollout.pp > 1:
        raise ValueError(
            f"rollout.tp ({rollout.tp}) * rollout.pp ({rollout.pp}) > 1 needs a sharded rollout engine; "
            f"rollout.backend={cfg.rollout.backend} holds a whole model per rank: use --rollout.tp 1 "
            f"--rollout.pp 1 or --rollout.backend vllm")
    backend.check(cfg.rollout)
    if cfg.rollout.dtype == "fp8" and not backend.fp8:
        supported = sorted(name for name, spec in BACKENDS.items() if spec.fp8)
        raise ValueError(f"--rollout.dtype fp8: rollout.backend={cfg.rollout.backend} does not hold its weights in "
                         f"FP8 here: use --rollout.backend {' or '.join(supported)}, or --rollout.dtype auto")


def rollout_warnings(cfg: Config) -> list[str]:
    """What the rollout's settings advise: FP8 weights widen the gap to the trainer's log-probs."""
    if cfg.rollout.dtype == "fp8" and not cfg.algo.rollout_correction_on:
        return ["rollout.dtype=fp8 samples from an FP8 copy of the policy, further from the trainer's log-probs than "
                "the model dtype: consider --algo.rollout-is token (rollout/logprob_abs_diff and rollout_corr/kl "
                "report the gap)"]
    return []


def check_episodes(cfg: Config, backend: Any, *, rollout_pool: bool) -> None:
    """Multi-turn episodes (``--env.*``, ``--agent.fn``): where they can run, and an episode's length."""
    env, agent = cfg.env, cfg.agent.fn
    if not env.enabled and agent is None:
        return
    name = f"agent.fn={agent}" if agent else f"env.fn={env.fn}" if env.fn else f"env.name={env.name}"
    if agent is not None and env.enabled:
        other = f"env.fn={env.fn}" if env.fn else f"env.name={env.name}"
        raise ValueError(f"agent.fn={agent} drives its episodes itself, and {other} names an environment too: "
                         f"set one of them")
    if agent is not None and env.tools:
        raise ValueError(f"agent.fn={agent}: the agent runs its own tools (they reach the model as `tools` in its "
                         f"requests); env.tools={env.tools} is for environments: unset it")
    if not backend.stream:
        raise ValueError(f"{name}: multi-turn episodes continue each episode from its exact tokens in one stream, "
                         f"which rollout.backend={cfg.rollout.backend} cannot: use --rollout.backend native")
    if rollout_pool and cfg.rollout.stream:  # the pool's ranks play whole rounds of episodes, not streamed groups
        raise ValueError(f"{name}: multi-turn episodes on a rollout pool (pools.rollout_ranks="
                         f"{cfg.pools.rollout_ranks}) are played in whole rounds; rollout.stream=True streams "
                         f"single-turn groups: drop --rollout.stream")
    for flag in ("partial", "stage_weights"):
        if rollout_pool and getattr(cfg.rollout, flag):  # an episode's turns are all of one policy version
            raise ValueError(f"{name}: multi-turn episodes on a rollout pool take new weights between rounds; "
                             f"rollout.{flag}=True takes them during one: drop --rollout.{flag.replace('_', '-')}")
    if cfg.reward.model.path is not None:
        raise ValueError(f"{name}: an episode's score is its environment's rewards; reward.model.path="
                         f"{cfg.reward.model.path} would score it again: unset it")
    budget, longest = cfg.actor.max_tokens_per_gpu, cfg.data.max_prompt_length + env.max_tokens
    if budget is not None and longest > budget:
        raise ValueError(f"actor.max_tokens_per_gpu ({budget}) is below data.max_prompt_length "
                         f"({cfg.data.max_prompt_length}) + env.max_tokens ({env.max_tokens}) = {longest}, an "
                         f"episode's longest sequence")


def check_router_replay(cfg: Config, engine: Any, backend: Any, shape: ModelShape | None) -> None:
    """``actor.router_replay``: an MoE model, an engine that replays and a rollout that records, on the
    single-turn road (the stream and the episodes do not carry the experts)."""
    if not cfg.actor.router_replay:
        return
    flag = "--actor.router-replay"
    if shape is not None and not shape.experts:
        raise ValueError(f"{flag} replays a mixture-of-experts router; {shape.describe()} has no experts: drop {flag}")
    if not engine.router_replay:
        supported = sorted(name for name, spec in ENGINES.items() if spec.router_replay)
        raise ValueError(f"{flag}: actor.engine={cfg.actor.engine} does not replay recorded experts: use "
                         f"--actor.engine {' or '.join(supported)}, or drop {flag}")
    if not backend.router_replay:
        supported = sorted(name for name, spec in BACKENDS.items() if spec.router_replay)
        raise ValueError(f"{flag}: rollout.backend={cfg.rollout.backend} does not report which experts it chose "
                         f"for each token: use --rollout.backend {' or '.join(supported)}, or drop {flag}")
    for on, what, drop in ((cfg.rollout.stream, "rollout.stream=True streams rows", "--rollout.stream"),
                           (cfg.env.enabled or cfg.agent.fn is not None, "multi-turn episodes stream their turns",
                            "--env.* / --agent.fn")):
        if on:
            raise ValueError(f"{flag} records experts on the rollout's batch road; {what}, which do not carry "
                             f"them: drop {drop} or {flag}")


def check_sections(cfg: Config) -> None:
    """Rules between config sections that need no world size."""
    tb, mb = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if mb > tb:
        raise ValueError(f"actor.ppo_mini_batch_size ({mb}) must be <= data.train_batch_size ({tb})")
    if tb % mb:
        raise ValueError(f"actor.ppo_mini_batch_size ({mb}) must divide data.train_batch_size ({tb})")
    if cfg.rollout.n == 1 and cfg.algo.adv_estimator in ("grpo", "rloo"):
        # A group of one has no baseline (spmd_rl.algo.advantages): its advantage is the raw score.
        raise ValueError(
            f"rollout.n=1 makes every prompt's group a single response, so algo.adv_estimator="
            f"{cfg.algo.adv_estimator} has nothing to compare it with: its advantage is the raw score, with no "
            f"baseline; use --rollout.n 2 or more, or --algo.adv-estimator reinforce_pp_baseline (whose baseline "
            f"is then the batch's mean)")
    budget, longest = cfg.actor.max_tokens_per_gpu, cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    sp = cfg.actor.fsdp.ulysses_size
    if budget is not None and budget * sp < longest:
        raise ValueError(
            f"actor.max_tokens_per_gpu ({budget}) * actor.fsdp.ulysses_size ({sp}) must be >= "
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) = {longest}, the longest sequence")


def check_dapo(cfg: Config) -> None:
    """DAPO's dynamic sampling and overlong shaping against the rollout and the schedule."""
    if cfg.algo.filter_groups and cfg.trainer.max_staleness > 0:
        raise ValueError(
            f"algo.filter_groups decides from each round's scores whether the step needs another round, which "
            f"asynchronous GRPO (trainer.max_staleness={cfg.trainer.max_staleness}) has already issued ahead: set "
            f"--trainer.max-staleness 0 or turn off --algo.filter-groups (--algo.no-filter-groups)")
    if cfg.algo.filter_groups and cfg.rollout.n < 2:
        raise ValueError(f"algo.filter_groups drops groups whose rollout.n scores are all equal, and a group of "
                         f"rollout.n={cfg.rollout.n} always is: use --rollout.n 2 or more")
    buffer, max_len = cfg.reward.overlong_buffer, cfg.rollout.max_new_tokens
    if buffer > max_len:
        raise ValueError(f"reward.overlong_buffer ({buffer}) must be <= rollout.max_new_tokens ({max_len}): the "
                         f"penalty falls from 0 at max_new_tokens - buffer to -reward.overlong_factor at max_new_tokens")


def check_teacher(cfg: Config, *, separate: bool, engine_meshes: tuple[str, ...]) -> None:
    """A teacher needs a use, and a colocated one the FSDP mesh it shares with the actor."""
    has_teacher, coef = cfg.teacher.model.path is not None, cfg.algo.distill_coef
    if coef > 0 and not has_teacher:
        raise ValueError(f"algo.distill_coef={coef} distills from a teacher, but teacher.model.path is not set: "
                         f"set --teacher.model.path or --algo.distill-coef 0")
    if has_teacher and coef == 0:
        raise ValueError(f"teacher.model.path={cfg.teacher.model.path} is set but algo.distill_coef is 0, so the "
                         f"teacher would score for nothing: set --algo.distill-coef (e.g. 0.1) or unset the teacher")
    if has_teacher and not separate and "fsdp" not in engine_meshes:
        raise ValueError(f"a colocated teacher runs under FSDP on the actor's mesh, which actor.engine="
                         f"{cfg.actor.engine} does not build: give it ranks of its own (--pools.teacher-ranks N) "
                         f"or use --actor.engine fsdp")


def critic_warnings(cfg: Config, *, engine_builds_critic: bool) -> list[str]:
    """PPO's critic: an engine that builds it, a use for its flags; the warnings about the KL terms."""
    algo, path = cfg.algo, cfg.critic.model.path
    uses_critic = algo.adv_estimator in CRITIC_ESTIMATOR_NAMES
    if uses_critic and not engine_builds_critic:
        raise ValueError(f"algo.adv_estimator={algo.adv_estimator} trains a critic (a value model), which actor.engine="
                         f"{cfg.actor.engine} does not build: use --actor.engine fsdp, or a group estimator "
                         f"(--algo.adv-estimator grpo)")
    if path is not None and not uses_critic:
        raise ValueError(f"critic.model.path={path} is set but algo.adv_estimator={algo.adv_estimator} trains no "
                         f"critic: set --algo.adv-estimator gae or unset --critic.model.path")
    if algo.kl_in_reward and algo.use_kl_loss:
        return [("algo.kl_in_reward and algo.use_kl_loss are both on: the KL to the reference counts twice, in the "
                 "reward and in the actor's loss; PPO's usual setting is --algo.use-kl-loss false")]
    return []


_IN_FLIGHT = {  # rollout flags that act while rows or weights are in flight: (what it does, what its backend needs)
    "partial": ("continues responses under weights that arrive while the rollout generates, which happens only on "
                "a rollout pool with rounds in flight", "continues responses under new weights"),
    "stream": ("sends groups from a rollout pool while the actor trains on earlier ones, which needs a rollout pool "
               "and prompts in flight", "hands back each response as it finishes"),
    "stage_weights": ("receives weights that arrive while a rollout pool generates, which happens only with rounds "
                      "in flight", "looks for new weights while it generates"),
}


def check_in_flight(cfg: Config, *, rollout_pool: bool, backend: Any) -> None:
    """``rollout.partial`` and ``rollout.stream`` need a rollout pool, prompts in flight (max staleness
    > 0), and a backend whose registry entry says it can (``BackendSpec.partial`` / ``.stream``)."""
    for flag, (does, needs) in _IN_FLIGHT.items():
        if not getattr(cfg.rollout, flag):
            continue
        option = f"--rollout.{flag.replace('_', '-')}"
        if not rollout_pool or cfg.trainer.max_staleness == 0:
            raise ValueError(
                f"rollout.{flag} {does} (pools.rollout_ranks={cfg.pools.rollout_ranks}, trainer.max_staleness="
                f"{cfg.trainer.max_staleness}): set --pools.rollout-ranks N (N > 0) and --trainer.max-staleness S "
                f"(S > 0), or drop {option}")
        if not getattr(backend, flag):
            raise ValueError(f"rollout.{flag} needs a rollout backend that {needs}; rollout.backend="
                             f"{cfg.rollout.backend} does not: use --rollout.backend native, or drop {option}")
    if cfg.rollout.stage_weights and cfg.rollout.partial:
        raise ValueError("rollout.stage_weights holds new weights until the round in progress ends, and "
                         "rollout.partial loads them in the middle of it: drop one of --rollout.stage-weights and "
                         "--rollout.partial")


__all__ = ["check_backend", "check_dapo", "check_engine", "check_episodes", "check_in_flight", "check_router_replay", "check_sections", "check_teacher", "critic_warnings", "staleness_warnings"]
