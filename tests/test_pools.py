"""Roles on their own pools (CPU, gloo, tiny models, real processes under torchrun).

* a rollout pool computes what the colocated rollout computes: the same metrics, step by step,
  with one process per device and with two processes per device (``pools.colocate 2``);
* a teacher drives the student toward itself (the reverse KL falls), and a teacher pool gives the
  colocated teacher's metrics;
* a rollout rank killed mid-step ends every process, the cause named;
* the tensor channels between pools: rows routed exactly, weights bit for bit, errors carried.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.distributed.bridge import RowRoute, WeightBridge, recv_rows, send_rows
from spmd_rl.distributed.comm import RemoteFailure
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed, run_program
from support.deps import smollm2
from support.tiny import tiny_model_folder
from test_train_e2e import TINY, read_metrics

STEPS = ["--trainer.total-steps", "3", "--trainer.val-every", "2"]


def launch(out_dir: str, *flags: str, nproc: int) -> subprocess.Popen:
    env = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", out_dir, *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def run(out_dir: str, *flags: str, nproc: int) -> subprocess.CompletedProcess:
    """A run whose ranks are forked from a warm process (``run_program``), for the tests that are
    about the program and not about its launcher."""
    return run_program("spmd_rl.train", [*TINY, "--trainer.output-dir", out_dir, *flags], nproc=nproc, cwd=REPO,
                       env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1"))


def run_ok(out_dir: str, *flags: str, nproc: int) -> str:
    """A run that must succeed; its stderr."""
    proc = run(out_dir, *flags, nproc=nproc)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return proc.stderr


def learning_metrics(out_dir: str) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "elapsed_s"))}
            for m in read_metrics(out_dir)]


def assert_same(a: list[dict], b: list[dict], what: str) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b], what
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (what, sorted(set(x) ^ set(y)))
        for k in x:
            assert abs(x[k] - y[k]) <= 1e-6 * max(1.0, abs(x[k])), f"{what}: step {x['step']} {k}: {x[k]} vs {y[k]}"


def test_rollout_pool_matches_colocated(tmp_path):
    """2 colocated ranks vs 2 actor + 2 rollout ranks (one and two processes per device): the
    rollout data-parallel size and seeds match, so scores, losses, grad norms and validation agree."""
    run_ok(str(tmp_path / "colocated"), *STEPS, nproc=2)
    err = run_ok(str(tmp_path / "pool"), *STEPS, "--pools.rollout-ranks", "2", nproc=4)
    assert "rollout:0" in err and "rollout:1" in err  # the rank table names the pool
    run_ok(str(tmp_path / "shared"), *STEPS, "--pools.rollout-ranks", "2", "--pools.colocate", "2", nproc=4)
    base = learning_metrics(str(tmp_path / "colocated"))
    assert len(base) == 6 and sum("val/accuracy" in m for m in base) == 3  # 3 steps; validation at 0, 2, 3
    assert_same(base, learning_metrics(str(tmp_path / "pool")), "rollout pool")
    assert_same(base, learning_metrics(str(tmp_path / "shared")), "rollout pool, 2 processes per device")
    # the colocated run's checkpoint resumes with a rollout pool, and asynchronous: the pool holds no
    # trained state and gets the resumed actor's weights before it generates; nothing was in flight
    err = run_ok(str(tmp_path / "colocated"), "--trainer.total-steps", "5", "--trainer.val-every", "0",
                 "--pools.rollout-ranks", "2", "--trainer.max-staleness", "1", nproc=4)
    assert "resumed from" in err, err[-3000:]
    resumed = [m for m in read_metrics(str(tmp_path / "colocated")) if "critic/score/mean" in m]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert [m["async/staleness/max"] for m in resumed[3:]] == [0, 1]  # from the resumed weights (version 3)


def test_a_pool_given_as_a_fraction_is_planned_again_at_every_world_size(tmp_path):
    """``--pools.rollout-ranks 0.5``: 2 + 2 ranks, then the same command resumed on 2 processes (1 + 1:
    a lost node) and on 4 again (a node back); the global batch stays, the steps continue. On 1
    process the plan is refused, naming the new size (exit 2, no restart loop)."""
    out = str(tmp_path / "run")
    flags = ("--pools.rollout-ranks", "0.5", "--trainer.val-every", "0")
    err = run_ok(out, *flags, "--trainer.total-steps", "2", nproc=4)
    assert "rollout:1" in err
    err = run_ok(out, *flags, "--trainer.total-steps", "3", nproc=2)
    assert "resumed from" in err and "world size 4 -> 2" in err, err[-3000:]
    assert "rollout:1" not in err and "rollout:0" in err
    err = run_ok(out, *flags, "--trainer.total-steps", "4", nproc=4)
    assert "world size 2 -> 4" in err, err[-3000:]
    steps = [m for m in read_metrics(out) if "critic/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    proc = run(out, *flags, "--trainer.total-steps", "5", nproc=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("pools.rollout_ranks (0.5: 1 of 1) must be smaller than the world size (1): the global pool (actor "
            "and reference) needs at least one rank") in proc.stderr


def test_teacher_distillation_colocated_and_on_a_pool(tmp_path):
    """With no reward, only the distillation term trains: the reverse KL to the teacher falls; a
    teacher pool of 2 ranks gives the colocated teacher's metrics."""
    teacher = tiny_model_folder(None, layers=3, hidden=96, seed=7)
    flags = ["--teacher.model.path", teacher, "--algo.distill-coef", "1.0", "--reward.fn", "support.rewards:zero",
             "--trainer.total-steps", "8", "--trainer.val-every", "0"]
    run_ok(str(tmp_path / "colocated"), *flags, nproc=2)
    run_ok(str(tmp_path / "pool"), *flags, "--pools.teacher-ranks", "2", nproc=4)
    base = learning_metrics(str(tmp_path / "colocated"))
    kl = [m["actor/distill_kl"] for m in base]
    assert sum(kl[-3:]) / 3 < 0.6 * sum(kl[:2]) / 2, f"the reverse KL to the teacher did not fall: {kl}"
    assert_same(base, learning_metrics(str(tmp_path / "pool")), "teacher pool")


@smollm2  # the teacher named here is SmolLM2 (its tokenizer is the point)
def test_teacher_with_another_tokenizer_is_refused(tmp_path):
    proc = run(str(tmp_path / "run"), "--teacher.model.path", "smollm2-135m-instruct", "--algo.distill-coef", "0.1",
               "--trainer.total-steps", "1", nproc=1)
    err = proc.stderr
    assert proc.returncode != 0
    assert "have different tokenizers" in err and "smollm2-135m-instruct" in err and "tiny-random" in err


def _child_with_rank(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker of global ``rank`` (read from /proc)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"RANK") == str(rank).encode():
            return int(pid)
    return None


def test_killed_rollout_rank_stops_every_pool(tmp_path):
    """kill -9 of a rollout-pool rank after the first step: every process exits (none waits for the dead rank) and
    the launcher names the rank and its signal."""
    out = str(tmp_path / "run")
    proc = launch(out, "--pools.rollout-ranks", "2", "--trainer.total-steps", "200", "--trainer.val-every", "0",
                  nproc=4)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 300
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    victim = _child_with_rank(proc.pid, 3)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)  # a hang guard: without the kill the run has 200 steps to go
    assert proc.returncode != 0
    assert "rank" in err and ("Signal 9" in err or "SIGKILL" in err), err[-4000:]


# --------------------------------------------------------------------------- the channels


def _route_rows(rank: int, world: int) -> dict:
    """Ranks 0-1 hold rows 0..5 and 6..11 (rank 1 also a copy of 0's, as a tp peer would);
    ranks 2-3 take 0..3 and 4..11; rank 1 then fails on purpose for a second round."""
    torch.manual_seed(0)
    ids = torch.arange(12 * 4).reshape(12, 4)
    lp = torch.randn(12, 4)
    route = RowRoute(sources={0: (0, 6), 1: (6, 12)}, dests={2: (0, 4), 3: (4, 12)})
    spec = {"ids": (torch.long, -1), "lp": (torch.float32, 0.0)}
    out: dict = {}
    if rank < 2:
        a, b = route.sources[rank]
        width = 3 if rank == 1 else 4  # pieces of different lengths are padded when joined
        send_rows(route, {"ids": ids[a:b, :width], "lp": lp[a:b, :width]}, first_row=a)
        send_rows(route, {"ids": ids[a:b], "lp": lp[a:b]}, first_row=a, error="boom" if rank == 1 else None)
    else:
        got = recv_rows(route, spec)
        a, b = route.dests[rank]
        expect = ids[a:b].clone()
        if b > 6:
            expect[max(a, 6) - a:, 3] = -1
        out["ids_equal"] = torch.equal(got["ids"], expect)
        out["lp_rows"] = torch.equal(got["lp"][:, :3], lp[a:b, :3])
        try:
            recv_rows(route, spec)
            out["error"] = None
        except RemoteFailure as e:
            out["error"] = (e.rank, e.message)
    return out


def test_rows_routed_exactly_and_errors_carried():
    results = run_distributed(_route_rows, 4)
    assert results[2]["ids_equal"] and results[3]["ids_equal"]
    assert results[2]["lp_rows"] and results[3]["lp_rows"]
    assert results[2]["error"] is None  # rows 0..3 all come from rank 0, which did not fail
    assert results[3]["error"] == (1, "boom")


def _bridge(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group = dist.new_group([0, 1, 2])
    bridge = WeightBridge(group=group, sender=0, device=torch.device("cpu"), bucket_bytes=1000)
    torch.manual_seed(1)
    tensors = [(f"w{i}", torch.randn(7, 11 + i).to(torch.bfloat16 if i % 2 else torch.float32)) for i in range(6)]
    if rank == 0:
        stats = bridge.send(iter(tensors))
        return {"buckets": stats.buckets, "bytes": stats.bytes}
    got = [(n, t.clone()) for n, t in bridge.receive()]
    return {"same": [n for n, _ in got] == [n for n, _ in tensors]
            and all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(got, tensors))}


def test_weight_bridge_bit_for_bit_in_buckets():
    results = run_distributed(_bridge, 3)
    assert results[1]["same"] and results[2]["same"]
    assert results[0]["buckets"] > 1  # 1000-byte buckets: several rounds
    assert results[0]["bytes"] == sum(7 * (11 + i) * (2 if i % 2 else 4) for i in range(6))


@pytest.mark.parametrize("flags,rows", [
    (["--pools.rollout-ranks", "2", "--pools.colocate", "2"], {"gpu": [0, 1, 0, 1], "pools": [{"global": 0},
                                                                                             {"global": 1},
                                                                                             {"rollout": 0},
                                                                                             {"rollout": 1}]}),
])
def test_layout_json_pools_and_gpus(flags, rows, capsys):
    import json

    from spmd_rl import layout

    assert layout.main([*flags, "--world-size", "4", "--nproc-per-node", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["gpu"] for r in d["ranks"]] == rows["gpu"]
    assert [r["pools"] for r in d["ranks"]] == rows["pools"]
    assert d["groups"]["rollout.dp"] == [[2, 3]] and d["groups"]["rollout.tp"] == [[2], [3]]
    assert d["memory_fractions"] == {"global": 0.5, "rollout": 0.5}


def _pool_groups_worker(rank: int, world: int) -> dict:
    """Every rank makes the groups of a rollout pool on ranks 2-3 (tp 2); the pool's ranks are served
    them in creation order, the others are members of none; an unknown rank list is refused."""
    import torch.distributed as dist

    from spmd_rl.rollout.vllm_groups import VllmPoolGroups

    groups = VllmPoolGroups.create(pool_ranks=[2, 3], tp=2, pp=1, device_type="cpu")
    out: dict = {"keys": sorted(groups.mine), "sizes": {str(k): len(v) for k, v in groups.mine.items()}}
    if rank >= 2:
        served = [groups._new_group([2, 3], backend="gloo") for _ in range(4)]  # world (device, cpu), tp (device, cpu)
        out["distinct"] = len({id(g) for g in served}) == 4
        t = torch.ones(1) * rank
        dist.all_reduce(t, group=served[3])
        out["sum"] = t.item()
        out["outsider"] = groups._new_group([0, 1]) is dist.GroupMember.NON_GROUP_MEMBER
        try:
            groups._new_group([2, 3, 1])
            out["refused"] = ""
        except RuntimeError as e:
            out["refused"] = str(e)
    dist.barrier()  # rank 0 holds the store: it stays until the pool's ranks are done
    return out


def _fsdp_pool_groups_worker(rank: int, world: int) -> dict:
    """An FSDP run with a rollout pool builds its groups without megatron-core (an optional extra):
    megatron's group builder refuses here, as a machine without the package would."""
    from spmd_rl.config import ActorConfig, Config, DataConfig, PoolsConfig
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.engine.megatron import groups as megatron_groups
    from spmd_rl.plan import plan
    from spmd_rl.world import build_run_groups

    def refuse(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'megatron' (an FSDP run must not need it)")

    megatron_groups.create_model_parallel_groups = refuse
    env = DistEnv.from_environ().init(device="cpu")
    cfg = Config(pools=PoolsConfig(rollout_ranks=1), data=DataConfig(train_batch_size=2),
                 actor=ActorConfig(ppo_mini_batch_size=2))
    groups = build_run_groups(plan(cfg, world), env, close_timeout_s=10)
    return {name: groups.pools.get(name).spec.ranks for name in ("global", "rollout")}


def test_an_fsdp_run_with_a_rollout_pool_needs_no_megatron() -> None:
    res = run_distributed(_fsdp_pool_groups_worker, 2)
    assert res[0] == res[1] == {"global": [0], "rollout": [1]}


def test_pool_groups_made_on_every_rank_served_on_the_pool() -> None:
    """vLLM's groups over a rollout pool (spmd_rl.rollout.vllm_groups, no vLLM needed): made on every
    rank of the world, handed out on the pool's ranks only."""
    res = run_distributed(_pool_groups_worker, 4)
    assert res[0]["keys"] == [] and res[1]["keys"] == []  # the actor ranks hold none of vLLM's groups
    for r in (2, 3):
        # world and tp ([2, 3]) and ep for MoE models: 3 pairs; dcp, pcp, pp, dp singletons: 4 pairs
        assert set(res[r]["keys"]) == {(r,), (2, 3)} and res[r]["sizes"] == {"(2, 3)": 6, f"({r},)": 8}
        assert res[r]["distinct"] and res[r]["sum"] == 5.0 and res[r]["outsider"]
        assert "vLLM asks for a process group over ranks [2, 3, 1] that spmd_rl/rollout/vllm_groups.py did not " \
               "make" in res[r]["refused"]
