"""TEST SUPPORT ONLY: ``python -m spmd_rl.train`` with the megatron-core CPU shims installed first.

    torchrun --nproc-per-node 2 tests/support/megatron_cpu_train.py --actor.engine megatron ...

Same arguments and behaviour as ``python -m spmd_rl.train``; the shims (``support.megatron_cpu``)
let megatron-core's CUDA-only calls run on a CPU-only torch. Not used on GPU machines.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`

from support.megatron_cpu import install_megatron_cpu_shims  # noqa: E402

install_megatron_cpu_shims()

from spmd_rl.train import main, run  # noqa: E402,F401  (main: for run_program)

if __name__ == "__main__":
    run()
