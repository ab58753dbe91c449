"""Entry point: ``torchrun --nproc-per-node N -m spmd_rl.train [--config X.yaml] [flags]``.

Also runs as a single process (``python -m spmd_rl.train``) and under ``srun`` (one task per GPU).
Every process parses the same flags, validates the layout before any process group exists, joins
the world and builds every pool's groups and meshes together. Then it runs the loop of its pool:
the ``global`` pool's ranks the trainer, the ``reward`` pool's ranks (``pools.reward_ranks``) the
reward-model server, until the trainer sends them ``stop`` (or ``abort`` with its error when it
fails, so that no reward rank waits out the timeout).
"""

from __future__ import annotations

import logging
import sys
import time

from spmd_rl.config import load_config
from spmd_rl.distributed.plan import plan
from spmd_rl.distributed.env import DistEnv
from spmd_rl.metrics import setup_logging

log = logging.getLogger("spmd_rl")

REPORT_GRACE_S = 3.0
"""How long a rank other than 0 waits before reporting a configuration error itself (see main)."""


def main(argv: list[str] | None = None) -> int:
    env = DistEnv.from_environ()
    setup_logging(env.rank, env.hostname)
    try:
        cfg = load_config(argv)
        run_plan = plan(cfg, env.world_size, env.local_world_size)  # every layout rule, before any group
        if cfg.pools.reward_ranks and cfg.reward.model.path is None:
            raise ValueError(f"pools.reward_ranks={cfg.pools.reward_ranks} makes a reward pool, but reward.model.path "
                             "is not set, so it would serve nothing: set --reward.model.path or --pools.reward_ranks 0")
    except (ValueError, FileNotFoundError) as e:
        # Every rank finds the same error. Rank 0 reports it at once; the others wait, so that none of
        # them exits first and has torchrun stop rank 0 before it printed (then torchrun stops them
        # while they wait). A rank still alive after the wait (rank 0 slower, or srun) reports it too.
        if not env.is_main:
            time.sleep(REPORT_GRACE_S)
        where = "" if env.is_main else f" (rank {env.rank})"
        print(f"spmd_rl.train: invalid configuration{where}: {e}", file=sys.stderr, flush=True)
        return 2
    env.init(device=cfg.trainer.device, timeout_s=cfg.trainer.dist_timeout_s)
    from spmd_rl.distributed.world import build_run_groups
    from spmd_rl.trainer import Trainer  # heavy imports after the cheap checks
    import transformers

    transformers.utils.logging.disable_progress_bar()

    groups = build_run_groups(run_plan, env, close_timeout_s=min(60.0, cfg.trainer.dist_timeout_s))
    if groups.in_reward_pool:
        from spmd_rl.reward.server import serve_reward_pool

        try:
            return serve_reward_pool(rm=cfg.reward.model, cache_dir=cfg.model.cache_dir, device=env.device,
                                     exchange=groups.exchange, group=groups.pools.get("reward").group,
                                     mesh=groups.reward_mesh)
        finally:
            env.shutdown()
    trainer = None
    error = None
    try:
        trainer = Trainer(cfg, env, groups=groups)
        trainer.fit()
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        if groups.exchange is not None:  # logged before the reward pool is told, which may end the job
            log.error("rank %d failed, stopping the reward pool: %s", env.rank, error)
        raise
    finally:
        if groups.exchange is not None:
            groups.exchange.close(error)
        if trainer is not None:
            trainer.close()
        env.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
