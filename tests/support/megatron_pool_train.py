"""TEST SUPPORT ONLY: ``python -m spmd_rl.train`` with the megatron-core CPU shims, whose rollout-pool
ranks also save the weights their engine holds after every weight load.

    run_program("support.megatron_pool_train", [...flags...], nproc=4,
                env={"SPMD_RL_TEST_ROLLOUT_WEIGHTS": folder})
    # folder/rank{R}_load{K}.pt: {hf_name: tensor} of rollout rank R after its K-th load (K from 0)

The recording wraps the real ``RolloutServer.load_weights`` (the weights still travel and load as
in any run); it reads the rollout engine's own parameters afterwards, so a test compares what the
rollout pool generates with against the actor's weights. Same arguments as ``spmd_rl.train``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`

import torch  # noqa: E402

from support.megatron_cpu import install_megatron_cpu_shims  # noqa: E402

install_megatron_cpu_shims()

from spmd_rl.rollout.pool import RolloutServer  # noqa: E402
from spmd_rl.train import main, run  # noqa: E402,F401  (main: for run_program)

ENV = "SPMD_RL_TEST_ROLLOUT_WEIGHTS"
_load_weights = RolloutServer.load_weights


def _load_and_record(self: RolloutServer, *args: object, **kwargs: object) -> None:
    _load_weights(self, *args, **kwargs)
    folder = os.environ.get(ENV)
    if folder:
        self.loads = getattr(self, "loads", -1) + 1
        held = {name: p.detach().cpu().clone() for name, p in self.engine.model.named_parameters()}
        torch.save(held, os.path.join(folder, f"rank{self.link.rank}_load{self.loads}.pt"))


RolloutServer.load_weights = _load_and_record  # type: ignore[method-assign]

if __name__ == "__main__":
    run()
