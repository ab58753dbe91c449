"""Elastic runs with a rollout pool given as a fraction of the world: torchrun agents on this host
(``--nnodes 1:2``, the c10d rendezvous, 2 processes each).

* A lost agent: two agents, one killed after a checkpoint. The survivor's workers stop on the lost
  peers, its agent restarts them at world size 2, ``plan()`` lays the pools out again (1 actor rank +
  1 rollout rank instead of 2 + 2), and the run resumes from the checkpoint and finishes.
* A joining agent: one agent runs alone (world 2); a second one joins under ``spmd_rl.torchrun``; the
  first agent's workers save on torchrun's SIGTERM, both agents restart them at world size 4, the
  pools are planned again (2 + 2) and the run resumes and finishes.

Every step is logged, none missing."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

from conftest import HERE, REPO
from spmd_rl.distributed.testing import cpu_env, free_port
from test_train_e2e import TINY

STEPS = 10


def _agent(out: str, port: int, log: str, *, launcher: str = "torch.distributed.run", steps: int = STEPS,
           last_call_s: int = 3, host: bool | None = None) -> subprocess.Popen:
    """An agent of the run in ``out``. ``last_call_s``: how long a rendezvous that has its minimum (one
    agent) waits for more; ``host``: whether it hosts the rendezvous store (None: whoever binds first)."""
    conf = f"last_call_timeout={last_call_s}" + ("" if host is None else f",is_host={int(host)}")
    cmd = [sys.executable, "-m", launcher, "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
           "--rdzv-conf", conf, "--max-restarts", "2", "--monitor-interval", "1",
           "-m", "spmd_rl.train", *TINY,
           "--trainer.output-dir", out, "--pools.rollout-ranks", "0.5", "--trainer.total-steps", str(steps),
           "--checkpoint.every", "1", "--trainer.stall-timeout-s", "30", "--trainer.dist-timeout-s", "90"]
    env = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=REPO)


def _saved(out: str, world_size: int | None = None) -> int:
    """The latest step saved in ``out`` (by a world of ``world_size`` processes, when given); 0 if none."""
    steps = []
    for folder in glob.glob(os.path.join(out, "checkpoints", "step_*")):
        step = folder.rsplit("_", 1)[1]
        if not step.isdigit():
            continue
        if world_size is not None:
            try:
                with open(os.path.join(folder, "meta.json")) as f:
                    if json.load(f)["world_size"] != world_size:
                        continue
            except (OSError, ValueError, KeyError):  # being written
                continue
        steps.append(int(step))
    return max(steps or [0])


def test_a_lost_agent_replans_the_pools_and_the_run_finishes(tmp_path):
    out, port = str(tmp_path / "run"), free_port()
    # the first agent hosts the rendezvous store, which must outlive the second. Started together, they
    # meet in the first round (it waits 20 s for the second agent); one that comes later joins at a
    # restart, so the kill waits for a checkpoint of the world of 4 either way
    first = _agent(out, port, str(tmp_path / "first.log"), last_call_s=20, host=True)
    second = _agent(out, port, str(tmp_path / "second.log"), last_call_s=20, host=False)
    try:
        deadline = time.monotonic() + 300
        while _saved(out, world_size=4) < 2 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert _saved(out, world_size=4) >= 2, (tmp_path / "first.log").read_text()[-3000:]
        os.killpg(second.pid, signal.SIGKILL)  # the node is lost, with its agent and workers
        code = first.wait(timeout=600)
    finally:
        for p in (first, second):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log = (tmp_path / "first.log").read_text()
    assert code == 0, log[-4000:]
    assert "differences from the saving run: world size 4 -> 2" in log, log[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if "critic/score/mean" in line]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and steps[-1] == STEPS, steps


def test_a_joining_agent_grows_the_world_at_the_restart(tmp_path):
    out, port, steps = str(tmp_path / "run"), free_port(), 60
    first = _agent(out, port, str(tmp_path / "first.log"), launcher="spmd_rl.torchrun", steps=steps)
    second = None
    try:
        deadline = time.monotonic() + 300
        while _saved(out) < 2 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert _saved(out) >= 2, (tmp_path / "first.log").read_text()[-3000:]
        second = _agent(out, port, str(tmp_path / "second.log"), launcher="spmd_rl.torchrun", steps=steps)
        codes = first.wait(timeout=600), second.wait(timeout=120)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log, joined = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert codes == (0, 0), log[-4000:] + joined[-3000:]
    # rank 0 of the grown world says it, on whichever agent the rendezvous ranked first (the lower
    # pid, which is the joining one's once pids wrap around)
    assert "differences from the saving run: world size 2 -> 4" in log + joined, log[-3000:] + joined[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = [json.loads(line)["step"] for line in f if "critic/score/mean" in line]
    assert sorted(set(logged)) == list(range(1, steps + 1)) and logged[-1] == steps, logged


def test_elastic_runs_get_a_rendezvous_store_of_their_own() -> None:
    from spmd_rl.torchrun import elastic

    assert elastic(["--nnodes", "1:2", "--nproc-per-node", "2", "-m", "spmd_rl.train"])
    assert elastic(["--nproc-per-node", "8", "--nnodes=2:4", "-m", "spmd_rl.train", "--nnodes", "9"])
    assert not elastic(["--nnodes", "2:2", "-m", "spmd_rl.train"])
    assert not elastic(["--nnodes", "2", "--nproc-per-node", "2", "-m", "spmd_rl.train", "--nnodes", "1:2"])
