"""The loops of the serving pools' ranks: the rollout pool and the teacher pool.

    code = serve_pool(cfg, env, groups)     # spmd_rl.train, on a rank of the rollout or teacher pool

Each builds its engine (the rollout engine with the replica's seed; the frozen teacher under FSDP
over the teacher pool's mesh) and serves the actor pool until its controller says ``stop`` (0) or
``abort`` (1) (:mod:`spmd_rl.rollout.pool`, :mod:`spmd_rl.distill`). The reward pool has its own
loop (:mod:`spmd_rl.reward.server`).
"""

from __future__ import annotations

from spmd_rl.config import Config
from spmd_rl.distributed.env import DistEnv
from spmd_rl.distributed.pools import ROLLOUT, TEACHER
from spmd_rl.world import RunGroups


def serve_pool(cfg: Config, env: DistEnv, groups: RunGroups) -> int:
    """Run this rank's serving loop until the actor pool stops; the exit code."""
    import torch

    from spmd_rl.models import load_tokenizer, resolve_model_path
    from spmd_rl.models.tokenizer import eos_token_ids

    torch.manual_seed(cfg.trainer.seed)
    if groups.in_rollout_pool:
        from spmd_rl.rollout import build_rollout_from_config
        from spmd_rl.rollout.pool import serve_rollout_pool
        from spmd_rl.seeds import engine_seed

        assert groups.rollout_link is not None
        folder = resolve_model_path(cfg.model.path, cache_dir=cfg.model.cache_dir)
        tokenizer = load_tokenizer(folder, trust_remote_code=cfg.model.trust_remote_code)
        pool = groups.pools.get(ROLLOUT)
        replica = groups.plan.rollout.coords(pool.rank)["dp"]
        engine = build_rollout_from_config(
            cfg.rollout, model_folder=folder, device=env.device, pad_token_id=int(tokenizer.pad_token_id),
            eos_token_ids=eos_token_ids(tokenizer), trust_remote_code=cfg.model.trust_remote_code,
            max_prompt_length=cfg.data.max_prompt_length, seed=engine_seed(cfg.trainer.seed, replica),
            pool_groups=groups.rollout_pool_groups)
        try:
            # never asleep: its memory is its own (its pool's ranks, or its capped share of a shared GPU)
            serving = dict(engine=engine, link=groups.rollout_link, replica=replica, sleep_level=0,
                           partial=cfg.rollout.partial, partial_chunk=cfg.rollout.partial_chunk,
                           stage_weights=cfg.rollout.stage_weights)
            if cfg.rollout.stream:
                from spmd_rl.rollout.pool_stream import StreamServer

                return StreamServer(max_prompt_length=cfg.data.max_prompt_length, **serving).serve()
            return serve_rollout_pool(**serving)
        finally:
            engine.close()
    if groups.in_teacher_pool:
        from spmd_rl.distill import TeacherServer
        from spmd_rl.engine import build_teacher

        assert groups.teacher_link is not None and cfg.teacher.model.path is not None
        pool = groups.pools.get(TEACHER)

        def build():
            folder = resolve_model_path(cfg.teacher.model.path, cache_dir=cfg.model.cache_dir)
            tokenizer = load_tokenizer(folder, trust_remote_code=cfg.teacher.model.trust_remote_code)
            return build_teacher(teacher=cfg.teacher, actor=cfg.actor, model_folder=folder, mesh=groups.teacher_mesh,
                                 group=pool.group, device=env.device, pad_token_id=int(tokenizer.pad_token_id))

        return TeacherServer(link=groups.teacher_link, build=build, micro_batch_size=cfg.teacher.micro_batch_size).serve()
    raise RuntimeError(f"rank {env.rank} is in no serving pool (it is a {groups.role} rank)")


__all__ = ["serve_pool"]
