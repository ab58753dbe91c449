"""Test setup: make `tests/` importable (for `support.*`), keep model caches in one place, keep
CUDA uninitialised in the test processes, and undo the logging set-up of entry points run in-process.

Devices: a test says what it needs. CPU tests run their ranks and subprocesses with the GPUs hidden
(``spmd_rl.distributed.testing``: ``run_distributed``, ``run_program``, ``cpu_env`` for the
subprocesses a test starts), so they run on CPU and gloo on any machine; CUDA tests skip without a
GPU (``support.devices``) and start their ranks with ``spawn``."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# One cache for the whole session (and for subprocesses that tests start): built-in models are
# materialised once. CI may point this elsewhere.
os.environ.setdefault("SPMD_RL_CACHE", os.path.join(REPO, ".cache", "models"))
# ``torch.cuda.is_available()`` (the skip conditions, product code run in-process) counts devices
# through NVML instead of initialising the CUDA driver: a process that initialised it cannot fork
# children that use CUDA, and every subprocess inherits the setting.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# One thread per process, as CI runs (.ci/run): a test starts several rank processes, and each of
# `pytest -n N`'s workers with a thread per core would oversubscribe the machine many times over.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests' own Hugging Face reference models (``from_pretrained(...).cuda().eval()``) kernelize
# through the ``kernels`` package on a GPU, which fetches kernels from the Hub (no internet there);
# the product's loaders pass ``use_kernels=False`` themselves (spmd_rl.models.load_causal_lm).
os.environ.setdefault("USE_HUB_KERNELS", "NO")


import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_spmd_rl_logger():
    """Tests that run an entry point in-process (``spmd_rl.train.main``) call ``setup_logging``,
    which gives the ``spmd_rl`` logger a handler on that test's captured stderr and stops
    propagation; restore the logger so later tests' ``caplog`` sees its records."""
    logger = logging.getLogger("spmd_rl")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


# ---- tests that need the machine to themselves
# Under ``pytest -n 2`` two tests run at once. A test marked ``alone`` (one that measures how two of
# its processes overlap in time) holds an exclusive lock while every other test holds a shared one,
# so it never runs beside another test; without xdist the lock is never contended.
import fcntl  # noqa: E402
import tempfile  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: run with no other test beside it (under pytest-xdist)")
    # pytest-xdist's default (``--loadscope-reorder``) hands out ``--dist loadfile``'s files by their
    # number of tests, most first: that would start the few-test, minutes-long files (below) last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.fixture(autouse=True)
def _machine_share(request: pytest.FixtureRequest):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), f"spmd_rl-tests-{run}.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- the longest files first
# ``--dist loadfile`` hands whole files to the two workers in collection order. Started last, a file
# of several minutes (vLLM's subprocesses, the launchers' fault tests) would run alone at the end
# while the other worker idles; started first, the short files fill in around it. Ordered by each
# file's measured total (longest first).
LONG_FILES = ("test_learning.py", "test_vllm_rollout.py", "test_process_lifecycle.py", "test_async.py",
              "test_pools.py", "test_checkpoint.py", "test_multinode.py", "test_train_e2e.py", "test_slurm.py",
              "test_reward_pool.py", "test_critic.py", "test_checkpoint_faults.py", "test_lora.py",
              "test_models.py", "test_fsdp_parity.py", "test_megatron_parity.py", "test_megatron_cp.py",
              "test_megatron_pools.py", "test_fsdp_depth.py", "test_dapo.py", "test_rollout_fast.py",
              "test_doc_commands.py", "test_config.py", "test_megatron_state.py", "test_nonfinite.py",
              "test_megatron_e2e.py", "test_megatron_families.py", "test_attention.py",
              "test_rollout_contbatch.py", "test_rollout.py", "test_evaluate.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order
