"""Two "nodes" on one host through the launch scripts: a short GRPO run across two torchruns.

* localhost: `launch/multi_node.sh --static --nnodes 2 --node-rank 0|1 --head 127.0.0.1:PORT`
  (torchrun --master-addr/--master-port), one process per node;
* own addresses: each node in its own network namespace (veth pair, 10.x addresses, its own
  host name and /etc/hosts), c10d rendezvous on the head named by host name, as on a real
  cluster. Needs root and `ip netns`; skipped with the error text where a namespace cannot be made.

Also `launch/single_node.sh` for real, the launch scripts' usage texts and argument errors, and
the layout check script.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import HERE, REPO
from spmd_rl.distributed.testing import cpu_env, free_port
from support.launchers import STEPS, communicate_or_kill, metric_steps, rank_table, short_run

LAUNCH = os.path.join(REPO, "launch")
TIMEOUT_S = 600  # two torchruns on 2 cores, maybe shared with another suite: as test_slurm allows


def _env(**extra: str) -> dict[str, str]:
    return cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _check_run(procs: list[subprocess.Popen], out_dir: str) -> tuple[list[dict[str, str]], int]:
    """Both nodes succeed and the run logged every step; the rank table and which process printed it."""
    outputs = communicate_or_kill(procs, TIMEOUT_S)
    for node, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} exited {p.returncode}\n{err[-6000:]}"
    assert metric_steps(out_dir) == list(range(1, STEPS + 1))
    # Global rank 0 prints the table; with c10d the rendezvous, not --node-rank, picks its node.
    printed = [i for i, (_, err) in enumerate(outputs) if "rank table" in err]
    assert len(printed) == 1, "expected one rank table, from rank 0"
    return rank_table(outputs[printed[0]][1]), printed[0]


def test_two_nodes_on_localhost_static(tmp_path):
    out = str(tmp_path / "run")
    head = f"127.0.0.1:{free_port()}"
    # Static rendezvous: global ranks follow --node-rank, whichever node starts first.
    procs = [
        _start([os.path.join(LAUNCH, "multi_node.sh"), "--static", "--nnodes", "2", "--node-rank", str(r),
                "--head", head, "--nproc", "1", "--", *short_run(out)], _env())
        for r in (1, 0)
    ]
    rows, printer = _check_run(procs, out)
    assert [(row["rank"], row["node"], row["local_rank"]) for row in rows] == [("0", "0", "0"), ("1", "1", "0")]
    assert printer == 1  # the process started with --node-rank 0 holds global rank 0


def test_single_node_script(tmp_path):
    out = str(tmp_path / "run")
    proc = _start([os.path.join(LAUNCH, "single_node.sh"), "--nproc", "2", "--max-restarts", "1", "--",
                   *short_run(out)], _env())
    rows, _ = _check_run([proc], out)
    assert [(row["rank"], row["node"], row["local_rank"]) for row in rows] == [("0", "0", "0"), ("1", "0", "1")]


# ---------------------------------------------------------------------------- own addresses
def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: (namespace, host name, address) per node.

    `ip netns exec` bind-mounts /etc/netns/<namespace>/hosts over /etc/hosts, so each node
    resolves both names; an empty resolv.conf keeps lookups off the real network.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs root, `ip` (iproute2) and `unshare` to make network namespaces")
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    nodes = [(f"spmdrl{tag}{c}", f"node{c}", f"{subnet}.{i + 1}") for i, c in enumerate("ab")]
    made: list[str] = []
    try:
        for ns, _, _ in nodes:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        (ns_a, _, addr_a), (ns_b, _, addr_b) = nodes
        veth_a, veth_b = f"sr{tag}a", f"sr{tag}b"
        _sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for ns, veth, addr in ((ns_a, veth_a, addr_a), (ns_b, veth_b, addr_b)):
            _sh("ip", "link", "set", veth, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _sh("ip", "-n", ns, "link", "set", veth, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(f"{etc}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for _, h, a in nodes))
            open(f"{etc}/resolv.conf", "w").close()
        _sh("ip", "netns", "exec", ns_a, "unshare", "--uts", "hostname", "check")
    except OSError as e:
        _cleanup(made)
        pytest.skip(f"network namespaces are not available here: {e}")
    yield nodes
    _cleanup(made)


def _cleanup(namespaces: list[str]) -> None:
    for ns in namespaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def test_two_nodes_with_own_addresses(tmp_path, two_hosts):
    out = str(tmp_path / "run")
    port = 29500 + os.getpid() % 1000  # a port inside the namespaces, free since they are new
    head_host = two_hosts[0][1]
    procs = []
    for rank, (ns, host, _) in enumerate(two_hosts):
        launch = [os.path.join(LAUNCH, "multi_node.sh"), "--nnodes", "2", "--node-rank", str(rank),
                  "--head", f"{head_host}:{port}", "--nproc", "1", "--", *short_run(out)]
        # A new UTS namespace gives the node its own host name; exec keeps one process to kill.
        script = f'hostname {host} && exec "$@"'
        procs.append(_start(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script, "sh", *launch],
                            _env()))
    rows, _ = _check_run(procs, out)
    assert [(row["rank"], row["node"], row["host"]) for row in rows] == [("0", "0", "nodea"), ("1", "1", "nodeb")]


# ---------------------------------------------------------------------------- script interfaces
@pytest.mark.parametrize("script", ["single_node.sh", "multi_node.sh", "check_layout.sh"])
def test_usage_text(script):
    proc = subprocess.run([os.path.join(LAUNCH, script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "Options:" in proc.stdout and "--" in proc.stdout
    with open(os.path.join(LAUNCH, script)) as f:
        assert "set -euo pipefail" in f.read()
    bad = subprocess.run([os.path.join(LAUNCH, script), "--no-such-flag"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown option '--no-such-flag'" in bad.stderr


@pytest.mark.parametrize("args,message", [
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes, --node-rank and --head are required"),
    (["--nnodes", "2", "--node-rank", "2", "--head", "h"], "--node-rank must be in 0..1, got '2'"),
    (["--nnodes", "2", "--node-rank", "1", "--head", "h:x"], "--head must be HOST or HOST:PORT, got 'h:x'"),
    (["--nnodes", "2", "--node-rank", "1", "--head", "h", "--nproc", "0"], "--nproc must be a positive integer"),
])
def test_multi_node_argument_errors(args, message):
    proc = subprocess.run([os.path.join(LAUNCH, "multi_node.sh"), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr


def test_check_layout_script():
    script = os.path.join(LAUNCH, "check_layout.sh")
    ok = subprocess.run([script, "--nnodes", "2", "--nproc", "4", "--json"], capture_output=True, text=True,
                        timeout=120, env=_env())
    assert ok.returncode == 0, ok.stderr
    assert '"world_size": 8' in ok.stdout
    bad = subprocess.run([script, "--nproc", "3", "--", "--data.train-batch-size", "8"], capture_output=True,
                         text=True, timeout=120, env=_env())
    assert bad.returncode != 0 and "data.train_batch_size (8)" in bad.stderr
