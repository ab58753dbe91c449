"""The loop of every serving pool's ranks: rollout, teacher and reward, dispatched from here alone.

    code = serve_pool(cfg, env, groups)     # spmd_rl.train, on a rank whose role is not "trainer"

Each role is a server on the service protocol (:mod:`spmd_rl.distributed.service`): this module
builds the role's server from the config (the rollout engine with the replica's seed; the frozen
teacher under FSDP over the teacher pool's mesh; the reward model under FSDP over the reward pool's
mesh) and serves the actor pool until it says ``stop`` (0) or ``abort`` (1)
(:mod:`spmd_rl.rollout.pool`, :mod:`spmd_rl.rollout.pool_stream`, :mod:`spmd_rl.distill`,
:mod:`spmd_rl.reward.server`). The engines are imported only on the ranks that serve them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from spmd_rl.config import Config
from spmd_rl.distributed.env import DistEnv
from spmd_rl.distributed.pools import REWARD, ROLLOUT, TEACHER
from spmd_rl.world import RunGroups

if TYPE_CHECKING:
    from spmd_rl.distributed.service import ServiceServer


def serve_pool(cfg: Config, env: DistEnv, groups: RunGroups) -> int:
    """Run this rank's server until the actor pool stops; the exit code."""
    import torch

    build: Callable[[Config, DistEnv, RunGroups], ServiceServer] | None = SERVERS.get(groups.role)
    if build is None:
        raise RuntimeError(f"rank {env.rank} is in no serving pool (it is a {groups.role} rank)")
    torch.manual_seed(cfg.trainer.seed)
    return build(cfg, env, groups).serve()


def rollout_server(cfg: Config, env: DistEnv, groups: RunGroups) -> ServiceServer:
    """A rollout-pool rank's server: its engine (never asleep: its memory is its own, its pool's ranks or
    its capped share of a shared GPU), streaming with ``rollout.stream``; with episodes (``--env.*``,
    ``--agent.fn``) the runner that plays them here, from the data rows each round's command carries."""
    from spmd_rl.episodes.build import build_episode_runner, episode_prompt_length, episodes_on
    from spmd_rl.models import load_tokenizer, resolve_model_path
    from spmd_rl.models.tokenizer import eos_token_ids
    from spmd_rl.rollout import build_rollout_from_config
    from spmd_rl.rollout.pool import RolloutServer
    from spmd_rl.rollout.pool_stream import StreamServer
    from spmd_rl.seeds import engine_seed

    assert groups.rollout_link is not None
    folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir)
    tokenizer = load_tokenizer(folder, trust_remote_code=cfg.model.trust_remote_code)
    replica = groups.plan.rollout.coords(groups.pools.get(ROLLOUT).rank)["dp"]
    engine = build_rollout_from_config(
        cfg.rollout, model_folder=folder, device=env.device, pad_token_id=int(tokenizer.pad_token_id),
        eos_token_ids=eos_token_ids(tokenizer), trust_remote_code=cfg.model.trust_remote_code,
        max_prompt_length=episode_prompt_length(cfg), seed=engine_seed(cfg.trainer.seed, replica),
        pool_groups=groups.rollout_pool_groups, record_routes=cfg.actor.router_replay)
    serving = dict(engine=engine, link=groups.rollout_link, replica=replica, sleep_level=0,
                   partial=cfg.rollout.partial, partial_chunk=cfg.rollout.partial_chunk,
                   stage_weights=cfg.rollout.stage_weights)
    if episodes_on(cfg):  # plan() refuses them with rollout.stream
        return RolloutServer(**serving, episodes=build_episode_runner(cfg, tokenizer, eos_token_ids(tokenizer)))
    if cfg.rollout.stream:
        return StreamServer(max_prompt_length=cfg.data.max_prompt_length, **serving)
    return RolloutServer(**serving)


def teacher_server(cfg: Config, env: DistEnv, groups: RunGroups) -> ServiceServer:
    """A teacher-pool rank's server; the frozen teacher is loaded when it starts serving."""
    from spmd_rl.distill import TeacherServer
    from spmd_rl.engine import build_teacher
    from spmd_rl.models import load_tokenizer, resolve_model_path

    assert groups.teacher_link is not None and cfg.teacher.model.path is not None
    pool = groups.pools.get(TEACHER)

    def build():
        folder = resolve_model_path(cfg.teacher.model.path, cache_dir=cfg.model.cache_dir)
        tokenizer = load_tokenizer(folder, trust_remote_code=cfg.teacher.model.trust_remote_code)
        return build_teacher(teacher=cfg.teacher, actor=cfg.actor, model_folder=folder, mesh=groups.teacher_mesh,
                             group=pool.group, device=env.device, pad_token_id=int(tokenizer.pad_token_id))

    return TeacherServer(link=groups.teacher_link, build=build, micro_batch_size=cfg.teacher.micro_batch_size)


def reward_server(cfg: Config, env: DistEnv, groups: RunGroups) -> ServiceServer:
    """A reward-pool rank's server: ``reward.model.path`` under FSDP over the reward pool's mesh, loaded
    when it starts serving."""
    from spmd_rl.reward.model import RewardModel, resolve_reward_model
    from spmd_rl.reward.server import RewardServer

    assert groups.exchange is not None
    rm, mesh = cfg.reward.model, groups.reward_mesh

    def build() -> RewardModel:
        if mesh is None:
            raise ValueError("this rank is not in the reward pool's FSDP mesh")
        return RewardModel(folder=resolve_reward_model(rm, cache_dir=cfg.model.cache_dir), mesh=mesh, device=env.device,
                           micro_batch_size=rm.micro_batch_size, param_offload=rm.param_offload,
                           trust_remote_code=rm.trust_remote_code)

    return RewardServer(link=groups.exchange, group=groups.pools.get(REWARD).group, build=build)


SERVERS: dict[str, Callable[[Config, DistEnv, RunGroups], ServiceServer]] = {
    ROLLOUT: rollout_server, TEACHER: teacher_server, REWARD: reward_server}
"""Each serving role's server, built from the run's config and groups."""


__all__ = ["SERVERS", "serve_pool"]
