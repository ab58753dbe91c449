"""DistEnv reads torchrun's environment, else Slurm's (recorded srun environments), else one process."""

from __future__ import annotations

import pytest

from spmd_rl.distributed.env import DistEnv, expand_slurm_nodelist, format_rank_table

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "node-a", "MASTER_PORT": "29400"}

# What `srun --nodes 2 --ntasks-per-node 4` sets for the 7th task (recorded on a Slurm 23 cluster,
# trimmed to the variables the project reads).
SRUN_TASK6 = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
              "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "4242",
              "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_STEP_NODELIST": "gpu-[07-08]"}


def test_torchrun_env():
    env = DistEnv.from_environ(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (5, 1, 8, 4, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("node-a", 29400, "torchrun")


def test_torchrun_wins_over_slurm():
    # torchrun started inside an sbatch allocation: both sets exist, torchrun's describe the process.
    env = DistEnv.from_environ({**SRUN_TASK6, **TORCHRUN})
    assert env.launcher == "torchrun" and env.rank == 5


def test_srun_env():
    env = DistEnv.from_environ(SRUN_TASK6)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (6, 2, 8, 4, 1)
    assert env.master_addr == "gpu-07"  # first host of the step's node list
    assert env.master_port == 20000 + 4242 % 12000
    # every job's port lies below Linux's ephemeral ports (32768 on), which outgoing connections hold
    assert DistEnv.from_environ({**SRUN_TASK6, "SLURM_JOB_ID": "15000"}).master_port == 23000
    assert max(DistEnv.from_environ({**SRUN_TASK6, "SLURM_JOB_ID": str(j)}).master_port for j in range(0, 40000, 7)) < 32768
    assert env.launcher == "slurm"


def test_srun_env_explicit_master():
    env = DistEnv.from_environ({**SRUN_TASK6, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_single_process():
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


@pytest.mark.parametrize("nodelist,hosts", [
    ("login1", ["login1"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[01-02,07],cpu5", ["gpu01", "gpu02", "gpu07", "cpu5"]),
    ("a[8-11]-ib", ["a8-ib", "a9-ib", "a10-ib", "a11-ib"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


def test_cuda_without_gpu_names_the_flag():
    if DistEnv().pick_device("auto").type == "cuda":
        pytest.skip("this check is for machines without CUDA")
    with pytest.raises(ValueError, match="trainer.device=cuda but torch sees no CUDA device"):
        DistEnv().pick_device("cuda")


def test_rank_table_lists_pools():
    rows = [{"rank": 0, "node": 0, "host": "h", "local_rank": 0, "device": "cpu", "pools": {"global": 0}},
            {"rank": 1, "node": 0, "host": "h", "local_rank": 1, "device": "cpu", "pools": {"reward": 0}}]
    table = format_rank_table(rows).splitlines()
    assert table[0].split()[:5] == ["rank", "node", "host", "local_rank", "device"]
    assert table[2].endswith("global:0") and table[3].endswith("reward:0")


# `sbatch -n 2` then `srun` with no --ntasks-per-node (recorded on the Debian 12 Slurm 22.05
# test cluster of tests/support/slurm_cluster.sh, second task): SLURM_NTASKS_PER_NODE is absent,
# only SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE say "2".
SRUN_NO_PER_NODE = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
                    "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2",
                    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "6",
                    "SLURM_JOB_NODELIST": "vm", "SLURM_STEP_NODELIST": "vm", "SLURM_NODELIST": "vm"}


def test_srun_env_without_ntasks_per_node():
    env = DistEnv.from_environ(SRUN_NO_PER_NODE)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (1, 1, 2, 2, 0)
    assert (env.master_addr, env.master_port, env.launcher) == ("vm", 20006, "slurm")


def test_a_gpu_rank_runs_host_ops_on_one_thread_unless_told():
    """A GPU process without OMP_NUM_THREADS gets one intra-op thread (host_threads' docstring: the
    pool as wide as the machine stalled each small op of the update); a CPU run and a set
    OMP_NUM_THREADS keep torch's choice."""
    import torch

    from spmd_rl.distributed.env import host_threads

    assert host_threads(torch.device("cuda", 0), {}) == 1
    assert host_threads(torch.device("cuda", 0), {"OMP_NUM_THREADS": "8"}) is None
    assert host_threads(torch.device("cpu"), {}) is None
