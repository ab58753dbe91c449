"""Entry point: ``torchrun --nproc-per-node N -m spmd_rl.train [--config X.yaml] [flags]``.

Also runs as a single process (``python -m spmd_rl.train``) and under ``srun`` (one task per GPU).
Every process parses the same flags, validates the layout before any process group exists, joins
the world and builds every pool's groups and meshes together. Then it runs the loop of its pool:
the ``global`` pool's ranks the trainer, the rollout, teacher and reward pools' ranks their server
(:func:`spmd_rl.serve.serve_pool`), until the trainer sends them ``stop`` (or ``abort`` with its
error when it fails, so that no serving rank waits out the timeout).

A bad configuration exits with status 2 and its message, printed by rank 0 at once; the other ranks
wait ``REPORT_GRACE_S`` before printing it themselves, so that none of them exits first and has
torchrun stop rank 0 before it printed.
Other expected user errors (a bad data file, a reward function that fails, an output folder another
run holds, a corrupt checkpoint: :data:`USER_ERRORS`) end the same way with one line from rank 0 and
status 2; ``--logging.debug`` adds the traceback. SIGTERM, SIGINT and ``checkpoint.save_signal`` save
a checkpoint at the end of the step and end with status 75 (``PREEMPTED``, docs/CHECKPOINTS.md).

Run as a program, the process ends through :func:`run`: a torchrun worker dies with its agent
(``kill -9`` of torchrun: SIGTERM, :func:`~spmd_rl.distributed.process.die_with_parent`), an
exception is torchrun's root cause (its error file), and the process ends with ``os._exit`` after
the exit handlers, never finalizing the interpreter while gloo threads live (the SIGABRT at exit:
:mod:`spmd_rl.distributed.process`). A stage that stalls on a stopped or hung rank ends the run
after ``trainer.stall_timeout_s`` (:mod:`spmd_rl.distributed.watchdog`).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time

_PARENT_PID = os.getppid()  # before the imports below: the launcher that started this process

from typing import TYPE_CHECKING, Any

from spmd_rl import console
from spmd_rl.config import load_config
from spmd_rl.memory import device_memory
from spmd_rl.models.shape import read_model_shape
from spmd_rl.plan import plan
from spmd_rl.distributed.process import (
    PREEMPTED, USER_ERROR, Preempted, catch_stop_signals, die_with_parent, exit_now, run_entry,
)

if TYPE_CHECKING:
    from spmd_rl.config import Config
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.distributed.watchdog import NullWatchdog
    from spmd_rl.world import RunGroups

log = logging.getLogger("spmd_rl")

REPORT_GRACE_S = 3.0
"""How long a rank other than 0 waits before reporting a configuration error itself (see main)."""


def main(argv: list[str] | None = None) -> int:
    torchrun = bool(os.environ.get("TORCHELASTIC_RUN_ID"))
    if torchrun:  # a torchrun worker: end with the agent, even a kill -9'd one
        die_with_parent(_PARENT_PID)
    # SIGTERM / SIGINT: save at the end of the step and stop (Preempted); at once when the agent is gone
    catch_stop_signals(parent_pid=_PARENT_PID if torchrun else None)
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        load_config(argv)  # prints the flags and exits, before torch is imported (below)
    if console.main_rank():  # the status line: what the run does from its first second, on a ticking clock
        console.start().phase("importing torch")
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.metrics import setup_logging

    env = DistEnv.from_environ()
    setup_logging(env.rank, env.hostname)
    try:
        cfg = load_config(argv)
        shape = read_model_shape(cfg.model.path, cache_dir=cfg.model.cache_dir)  # config.json / GGUF header
        gpu = device_memory(cfg.trainer.device, env.local_rank, env.local_world_size, cfg.pools.colocate)
        # every rule, before any group; with the shape and the GPU's memory also each rank's memory estimate
        run_plan = plan(cfg, env.world_size, env.local_world_size, model_shape=shape, device_bytes=gpu)
    except (ValueError, FileNotFoundError) as e:
        # Every rank finds the same error. Rank 0 reports it at once; the others wait, so that none of
        # them exits first and has torchrun stop rank 0 before it printed (then torchrun stops them
        # while they wait). A rank still alive after the wait (rank 0 slower, or srun) reports it too.
        if not env.is_main:
            time.sleep(REPORT_GRACE_S)
        where = "" if env.is_main else f" (rank {env.rank})"
        console.close()
        print(f"spmd_rl.train: invalid configuration{where}: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return start_run(cfg, env, run_plan, torchrun=torchrun)
    except BaseException:
        console.close()  # the status line stops ticking: a traceback goes below it
        raise


def start_run(cfg: Config, env: DistEnv, run_plan: Any, *, torchrun: bool) -> int:
    """A checked configuration: join the world, build the groups, then serve a pool or train."""
    from spmd_rl.compiled import use_compile_cache
    from spmd_rl.distributed.watchdog import install, start_watchdog

    if cfg.checkpoint.save_signal:  # the early warning (Slurm's --signal=USR1@120) too
        catch_stop_signals(("SIGTERM", "SIGINT", cfg.checkpoint.save_signal), parent_pid=_PARENT_PID if torchrun else None)
    from spmd_rl.models.builtin import cache_root

    use_compile_cache(cache_root(cfg.model.cache_dir) / "compile")  # before anything compiles
    if not cfg.logging.console:
        console.close(clear=True)
    console.phase(f"joining the world of {env.world_size} process(es)")
    env.init(device=cfg.trainer.device, timeout_s=cfg.trainer.dist_timeout_s, colocate=cfg.pools.colocate)
    cap_memory(run_plan, env)
    watchdog = start_watchdog(env, cfg.trainer.stall_timeout_s)  # stage 'setup' until the trainer's first
    install(watchdog)
    console.phase("importing the trainer (transformers)")
    from spmd_rl.world import build_run_groups
    from spmd_rl.trainer import Trainer  # heavy imports after the cheap checks
    import transformers

    transformers.utils.logging.disable_progress_bar()

    console.phase("building the process groups")
    groups = build_run_groups(run_plan, env, close_timeout_s=min(60.0, cfg.trainer.dist_timeout_s))
    if groups.role != "trainer":  # a rollout, teacher or reward rank: its pool's server
        from spmd_rl.serve import serve_pool

        watchdog.beat(0, f"{groups.role} server", lockstep=False)  # checked for silence only: no steps
        try:
            return serve_pool(cfg, env, groups)
        finally:
            watchdog.stop()
            env.shutdown()
    return run_trainer(cfg, env, groups, run_plan, watchdog)


def run_trainer(cfg: Config, env: DistEnv, groups: RunGroups, run_plan: Any, watchdog: NullWatchdog) -> int:
    """A trainer rank's loop and its end: 0, :data:`~spmd_rl.distributed.process.PREEMPTED` after a save
    on a stop signal, 2 after an expected user error (:func:`user_error`); any other error is raised.
    The serving pools are told to stop, or to abort with the error."""
    from spmd_rl.trainer import Trainer

    trainer = None
    error = None
    code = 0
    try:
        trainer = Trainer(cfg, env, groups=groups)
        trainer.fit()
    except Preempted:  # saved; its one line is logged: the serving pools are told to stop, not to abort
        code = PREEMPTED
    except BaseException as e:
        console.close()  # the error's lines go below the status line, not onto it
        error = f"{type(e).__name__}: {e}"
        line = user_error(e, setup=trainer is None)
        if line is None:
            if len(run_plan.pools) > 1:  # logged before the other pools are told, which may end the job
                log.error("rank %d failed, stopping the other pools: %s", env.rank, error)
            raise
        code = report_user_error(line, env, debug=cfg.logging.debug)
    finally:
        watchdog.stop()  # the loop is over: a rank closing (wandb upload) while the others have left is no stall
        for link in groups.links.values():  # stop, or abort with the error
            link.close(error)
        if trainer is not None:
            trainer.close()
        env.shutdown()
    return code


USER_ERRORS = ("OutputDirInUse", "CorruptCheckpoint", "CheckpointMismatch", "RewardError")
"""What an expected user error is raised as (by name, also when another rank raised it): an output
folder in use, a corrupt checkpoint, one that does not fit this run, a reward function that fails."""
SETUP_ERRORS = USER_ERRORS + ("ValueError", "OSError", "FileNotFoundError", "IsADirectoryError", "NotADirectoryError",
                              "PermissionError", "JSONDecodeError", "UnicodeDecodeError")
"""...and while the trainer is built (before the first step), what a bad data file, model path or
setting is raised as; during the steps these keep their traceback (they may be bugs)."""


def user_error(e: BaseException, *, setup: bool) -> str | None:
    """The one line reporting ``e`` when it is an expected user error (:data:`USER_ERRORS`, or
    :data:`SETUP_ERRORS` during ``setup``; on this rank or, through
    :class:`~spmd_rl.distributed.comm.RankFailure`, on every rank that failed), else None: an
    unexpected error keeps its traceback."""
    from spmd_rl.distributed.comm import RankFailure

    expected = SETUP_ERRORS if setup else USER_ERRORS
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk: the message says what is kept
        return f"no space left: {_one_line(e.strerror or str(e))}"
    if isinstance(e, RankFailure):
        if not e.failures or any(kind not in expected for _, _, kind, _ in e.failures):
            return None
        rank, _, kind, message = e.failures[0]
        return f"rank {rank}: {kind}: {_one_line(message)}"
    if type(e).__name__ not in expected:
        return None
    return f"{type(e).__name__}: {_one_line(str(e))}"


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in text.strip().splitlines() if part.strip())


def report_user_error(line: str, env: DistEnv, *, debug: bool) -> int:
    """Rank 0 prints ``line`` (and the traceback with ``logging.debug``); the others print only with
    ``logging.debug`` and wait :data:`REPORT_GRACE_S` first, so that rank 0 is not stopped before it
    printed (as for a configuration error). Returns :data:`~spmd_rl.distributed.process.USER_ERROR`."""
    import traceback

    if debug:
        traceback.print_exc()
    if env.is_main:
        print(f"spmd_rl.train: error: {line}", file=sys.stderr, flush=True)
    else:
        time.sleep(REPORT_GRACE_S)
    return USER_ERROR


def cap_memory(run_plan: object, env: DistEnv) -> None:
    """With several processes per GPU, cap this one at its pool's share of the device's memory."""
    fractions = getattr(run_plan, "memory_fractions")
    if not fractions or env.device.type != "cuda":
        return
    import torch

    pool = run_plan.member_of(env.rank)[0]  # type: ignore[attr-defined]
    torch.cuda.set_per_process_memory_fraction(fractions[pool], env.device)
    total = torch.cuda.get_device_properties(env.device).total_memory
    log.info("rank %d (%s pool) may use %.2f of %s (%.1f GiB)", env.rank, pool, fractions[pool], env.device,
             fractions[pool] * total / 2**30)


def run(argv: list[str] | None = None) -> None:
    """The program: :func:`main`'s status (0; 2 for a bad configuration or another expected user error,
    one line from rank 0; 75 when a stop signal stopped the run after its checkpoint; 1 with the
    traceback printed on any other error), ended without interpreter finalization
    (spmd_rl.distributed.process)."""
    exit_now(run_entry(main, argv))


if __name__ == "__main__":
    run()
