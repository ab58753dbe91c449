"""The Slurm scripts on a real Slurm cluster started on this machine (munged, slurmctld, slurmd).

`tests/support/slurm_cluster.sh` writes a slurm.conf (no cgroups) and starts the daemons: two
nodes, node1 and node2, each in its own network namespace with its own address and host name,
or, where namespaces cannot be made, one node (this host). The tests submit `slurm/grpo.sbatch`
(one torchrun per node) and `slurm/grpo_srun.sbatch` (one srun task per rank) with CPU
overrides, wait with `sbatch --wait`, and read the job log under `logs/` and the run's metrics.

Skipped, with the reason, when Slurm is not installed or its daemons cannot start here; CI sets
SPMD_RL_REQUIRE_SLURM=1 after installing Slurm, which turns those skips into failures.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass

import pytest

from conftest import HERE, REPO
from spmd_rl.distributed.testing import cpu_env, free_port
from support.launchers import STEPS, metric_steps, rank_table, short_run

CLUSTER = os.path.join(HERE, "support", "slurm_cluster.sh")
TIMEOUT_S = 600
"""A hang guard per sbatch --wait, not a speed check: a requeued job runs twice, on a 2-core machine busy with
the rest of the suite."""


@dataclass
class Cluster:
    nodes: int
    env: dict[str, str]
    """The environment of a Slurm client (SLURM_CONF set)."""
    client: list[str]
    """Prefix for client commands: enter the controller's network namespace, if it has one."""


def _unavailable(reason: str) -> None:
    if os.environ.get("SPMD_RL_REQUIRE_SLURM") == "1":
        pytest.fail(f"SPMD_RL_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def _start(state: str, nodes: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPMD_RL_SLURMCTLD_PORT=str(free_port()), SPMD_RL_SLURMD_PORT=str(free_port()))
    return subprocess.run([CLUSTER, "start", state, str(nodes)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running cluster of two nodes, else of one."""
    missing = [b for b in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
               if shutil.which(b) is None]
    if missing:
        _unavailable(f"Slurm is not installed (no {', '.join(missing)}; "
                     "apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        _unavailable("the test cluster needs root (slurmd starts jobs as their user)")
    state = str(tmp_path_factory.mktemp("slurm"))
    nodes, started = 2, _start(state, 2)
    if started.returncode != 0:
        warnings.warn(f"no two-node Slurm cluster here, testing one node: {started.stderr.strip()[-2000:]}")
        nodes, started = 1, _start(state, 1)
    if started.returncode != 0:
        _unavailable(f"the Slurm daemons did not start: {started.stderr.strip()[-3000:]}")
    printed = dict(line.split("=", 1) for line in started.stdout.split() if "=" in line)
    client = ["nsenter", f"--net=/run/netns/{printed['SLURM_NETNS']}"] if "SLURM_NETNS" in printed else []
    try:
        yield Cluster(nodes=nodes, env=cpu_env(SLURM_CONF=printed["SLURM_CONF"]), client=client)
    finally:
        subprocess.run([CLUSTER, "stop", state], capture_output=True, timeout=60)


def _sbatch(cluster: Cluster, cwd: str, script: str, sbatch_args: list[str], train_args: list[str],
            **env: str) -> subprocess.CompletedProcess:
    """`sbatch --wait [sbatch_args] slurm/<script> [train_args]`, submitted from ``cwd``."""
    # sbatch hands the submitting environment to the job (--export=ALL is the default).
    job_env = dict(cluster.env, PYTHONPATH=os.pathsep.join([REPO, HERE]), PYTHON=sys.executable,
                   OMP_NUM_THREADS="1", **env)
    cmd = [*cluster.client, "sbatch", "--wait", *sbatch_args, os.path.join(REPO, "slurm", script), *train_args]
    return subprocess.run(cmd, env=job_env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)


def _job_log(cwd: str, job_name: str, proc: subprocess.CompletedProcess) -> str:
    """The job's own log, where the script's `#SBATCH --output=logs/%x-%j.out` puts it."""
    logs = glob.glob(os.path.join(cwd, "logs", f"{job_name}-*.out"))
    assert len(logs) == 1, f"job logs {logs}; sbatch said:\n{proc.stdout}\n{proc.stderr}"
    with open(logs[0]) as f:
        text = f.read()
    assert proc.returncode == 0, f"sbatch --wait exited {proc.returncode}\n{proc.stderr}\njob log:\n{text[-6000:]}"
    job_id = proc.stdout.split()[-1]
    assert os.path.basename(logs[0]) == f"{job_name}-{job_id}.out"
    return text


def _expected_table(cluster: Cluster) -> list[tuple[str, str, str]]:
    """(rank, node, local rank) of a 2-process run: one per node, or both on the one node."""
    if cluster.nodes == 2:
        return [("0", "0", "0"), ("1", "1", "0")]
    return [("0", "0", "0"), ("1", "0", "1")]


def test_grpo_sbatch_torchrun_per_node(slurm, tmp_path):
    os.makedirs(tmp_path / "logs")
    out = str(tmp_path / "run")
    # CPU overrides of the 2 nodes x 8 GPUs defaults: no GPUs, 2 processes in all.
    if slurm.nodes == 2:
        sbatch_args, per_node = ["--gpus-per-node", "0"], "1"  # the script's own --nodes=2
    else:
        sbatch_args, per_node = ["--nodes", "1", "--gpus-per-node", "0"], "2"
    proc = _sbatch(slurm, str(tmp_path), "grpo.sbatch", sbatch_args, short_run(out), NPROC_PER_NODE=per_node)
    log = _job_log(str(tmp_path), "grpo", proc)
    assert f"{slurm.nodes} node(s) x {per_node} process(es), rendezvous" in log
    assert metric_steps(out) == list(range(1, STEPS + 1))
    rows = rank_table(log)
    assert [(r["rank"], r["node"], r["local_rank"]) for r in rows] == _expected_table(slurm)
    if slurm.nodes == 2:
        assert [r["host"] for r in rows] == ["node1", "node2"]


def test_grpo_srun_direct(slurm, tmp_path):
    os.makedirs(tmp_path / "logs")
    out = str(tmp_path / "run")
    # One task per rank; each reads SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS and the node list.
    per_node = "1" if slurm.nodes == 2 else "2"
    proc = _sbatch(slurm, str(tmp_path), "grpo_srun.sbatch",
                   ["--nodes", str(slurm.nodes), "--ntasks-per-node", per_node, "--gpus-per-node", "0"],
                   short_run(out))
    log = _job_log(str(tmp_path), "grpo-srun", proc)
    assert f"2 task(s) on {slurm.nodes} node(s)" in log
    assert metric_steps(out) == list(range(1, STEPS + 1))
    rows = rank_table(log)
    assert [(r["rank"], r["node"], r["local_rank"]) for r in rows] == _expected_table(slurm)
    if slurm.nodes == 2:
        assert [r["host"] for r in rows] == ["node1", "node2"]


def test_bad_flags_fail_the_job(slurm, tmp_path):
    os.makedirs(tmp_path / "logs")
    proc = _sbatch(slurm, str(tmp_path), "grpo_srun.sbatch",
                   ["--nodes", "1", "--ntasks-per-node", "2", "--gpus-per-node", "0"],
                   short_run(str(tmp_path / "run")) + ["--data.train-batch-size", "3"])
    assert proc.returncode != 0
    logs = glob.glob(os.path.join(tmp_path, "logs", "grpo-srun-*.out"))
    with open(logs[0]) as f:
        assert "data.train_batch_size (3)" in f.read()


@pytest.mark.parametrize("script", ["grpo.sbatch", "grpo_srun.sbatch"])
def test_early_warning_saves_requeues_and_resumes(slurm, tmp_path, script):
    """Slurm's early warning (USR1 to the batch script, here ``scancel --batch --signal=USR1`` from rank 0's
    reward function in step 2): the script forwards it, the run saves step 2 and stops with 75, the script
    requeues the job, which resumes at step 2 and finishes: every step logged once."""
    os.makedirs(tmp_path / "logs")
    out, marker = str(tmp_path / "run"), tmp_path / "signalled"
    per_node = "1" if slurm.nodes == 2 else "2"
    if script == "grpo.sbatch":
        args = ["--gpus-per-node", "0"] if slurm.nodes == 2 else ["--nodes", "1", "--gpus-per-node", "0"]
    else:
        args = ["--nodes", str(slurm.nodes), "--ntasks-per-node", per_node, "--gpus-per-node", "0"]
    proc = _sbatch(slurm, str(tmp_path), script, ["--open-mode=append", *args],
                   short_run(out) + ["--reward.fn", "support.faults:digit_fraction_signalled"],
                   NPROC_PER_NODE=per_node, SIGNAL_AT_CALL="2", SIGNAL_TARGET="slurm", SIGNAL_NAME="SIGUSR1",
                   SIGNAL_MARKER=str(marker))
    log = _job_log(str(tmp_path), "grpo" if script == "grpo.sbatch" else "grpo-srun", proc)
    assert marker.is_file(), log[-6000:]
    assert "USR1 (the end is near)" in log and "stopped by SIGUSR1 after step 2/" in log, log[-6000:]
    assert "requeued, it resumes from it" in log, log[-6000:]
    assert "at step 2" in log and "resumed from" in log, log[-6000:]
    assert metric_steps(out) == list(range(1, STEPS + 1))
