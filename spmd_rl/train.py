"""Entry point: ``torchrun --nproc-per-node N -m spmd_rl.train [--config X.yaml] [flags]``.

Also runs as a single process (``python -m spmd_rl.train``) and under ``srun`` (one task per GPU).
Every process parses the same flags, validates the layout before any process group exists, joins
the world and runs the same loop.
"""

from __future__ import annotations

import logging
import sys

from spmd_rl.config import load_config
from spmd_rl.dist import dims
from spmd_rl.dist.env import DistEnv
from spmd_rl.metrics import setup_logging

log = logging.getLogger("spmd_rl")


def main(argv: list[str] | None = None) -> int:
    env = DistEnv.from_environ()
    setup_logging(env.rank, env.hostname)
    try:
        cfg = load_config(argv)
        dims.plan(cfg, env.world_size, env.local_world_size)  # every layout rule, before any group
    except (ValueError, FileNotFoundError) as e:
        if env.is_main:
            print(f"spmd_rl.train: invalid configuration: {e}", file=sys.stderr)
        return 2
    env.init(device=cfg.trainer.device, timeout_s=cfg.trainer.dist_timeout_s)
    from spmd_rl.trainer import Trainer  # heavy imports after the cheap checks
    import transformers

    transformers.utils.logging.disable_progress_bar()

    trainer = None
    try:
        trainer = Trainer(cfg, env)
        trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        env.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
