"""``python -m spmd_rl.layout`` as a user runs it: JSON output, tables, errors and ``--help``.

The plans are checked through ``main(argv)`` in-process (what the command prints and returns);
``--help`` and one refused layout run the real command.

Run: ``python -m pytest tests/test_layout_cli.py -q``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from spmd_rl import layout

ROOT = Path(__file__).resolve().parents[1]


def run_layout(*args: str) -> subprocess.CompletedProcess:
    """``python -m spmd_rl.layout ARGS`` in-process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = layout.main(list(args))
        except SystemExit as e:  # tyro's own errors and --help
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["spmd_rl.layout", *args], code, out.getvalue(), err.getvalue())


def run_layout_command(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "spmd_rl.layout", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_json_hsdp_8_ranks() -> None:
    out = run_layout("--world-size", "8", "--actor.fsdp.fsdp-size", "4", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["world_size"] == 8 and len(d["ranks"]) == 8
    g = d["groups"]
    assert g["fsdp.fsdp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["fsdp.ddp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["ulysses.sp"] == [[r] for r in range(8)] and g["ulysses.dp"] == [list(range(8))]
    assert g["rollout.tp"] == [[r] for r in range(8)] and g["rollout.dp"] == [list(range(8))]
    for key in ("rollout.pp", "megatron.tp", "megatron.cp", "megatron.pp", "megatron.dp", "megatron.ep",
                "megatron.expert_tp", "megatron.expert_dp"):
        assert key in g
    r6 = d["ranks"][6]
    assert r6["rank"] == 6 and r6["pools"] == {"global": 6} and r6["node"] is None
    assert r6["fsdp"] == {"ddp": 1, "fsdp": 2} and r6["rollout"] == {"dp": 6, "pp": 0, "tp": 0}


def test_json_megatron_tp2_pp2_16_ranks() -> None:
    out = run_layout("--world-size", "16", "--nproc-per-node", "8", "--actor.engine", "megatron",
                     "--actor.megatron.tp", "2", "--actor.megatron.pp", "2", "--rollout.tp", "2", "--rollout.backend", "vllm",
                     "--model.path", "tiny-random",
                     "--data.train-batch-size", "8", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    g = d["groups"]
    assert g["megatron.tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["megatron.pp"] == [[r, r + 8] for r in range(8)]
    assert g["megatron.dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["rollout.tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    r5 = d["ranks"][5]
    assert (r5["megatron"]["tp"], r5["megatron"]["dp"], r5["megatron"]["pp"]) == (1, 2, 0)
    assert (r5["node"], r5["local_rank"]) == (0, 5) and (d["ranks"][13]["node"], d["ranks"][13]["local_rank"]) == (1, 5)
    assert d["actor_dp_size"] == 4 and d["rollout_dp_size"] == 8
    assert d["engine_models"].startswith("llama (Llama 2 / 3.x") and "qwen3_moe (Qwen3-MoE" in d["engine_models"]
    assert "gemma3_text" not in d["engine_models"]  # the FSDP engine's only


def test_reward_pool_tables_and_json() -> None:
    args = ["--world-size", "4", "--pools.reward-ranks", "1", "--reward.model.path", "tiny-random-rm", "--data.train-batch-size", "3",
            "--actor.ppo-mini-batch-size", "3"]
    out = run_layout(*args)
    assert out.returncode == 0, out.stderr
    assert "reward = global ranks 3..3 (1)" in out.stdout and "reward.fsdp.fsdp" in out.stdout
    assert "fsdp.ddp" in out.stdout and "rollout.tp" in out.stdout
    assert "actor engine fsdp trains: any Hugging Face causal LM (its own attention for llama, " in out.stdout
    d = json.loads(run_layout(*args, "--json").stdout)
    assert d["groups"]["reward.fsdp.fsdp"] == [[3]] and d["groups"]["fsdp.fsdp"] == [[0, 1, 2]]
    assert d["ranks"][3]["pools"] == {"reward": 0} and d["ranks"][3]["fsdp"] is None
    assert d["ranks"][3]["reward"] == {"fsdp": {"ddp": 0, "fsdp": 0}}


def test_megatron_beside_a_rollout_pool() -> None:
    """megatron tp 2 on the actor pool (global ranks 0-7), the built-in rollout dp 8 on the rollout pool (8-15)."""
    args = ["--world-size", "16", "--nproc-per-node", "8", "--model.path", "tiny-random", "--actor.engine", "megatron",
            "--actor.megatron.tp", "2",
            "--pools.rollout-ranks", "8", "--data.train-batch-size", "8"]
    out = run_layout(*args)
    assert out.returncode == 0, out.stderr
    assert "pools: global = global ranks 0..7 (8); rollout = global ranks 8..15 (8)" in out.stdout
    d = json.loads(run_layout(*args, "--json").stdout)
    g = d["groups"]
    assert g["megatron.tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["megatron.dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["rollout.dp"] == [list(range(8, 16))] and g["rollout.tp"] == [[r] for r in range(8, 16)]
    assert d["actor_dp_size"] == 4 and d["rollout_dp_size"] == 8
    r9 = d["ranks"][9]
    assert r9["pools"] == {"rollout": 1} and r9["megatron"] is None and r9["rollout"] == {"dp": 1, "pp": 0, "tp": 0}
    assert (r9["node"], r9["gpu"]) == (1, 1)
    assert d["ranks"][3]["megatron"]["tp"] == 1 and d["ranks"][3]["rollout"] is None


def test_bad_layout_exits_with_the_plan_message() -> None:
    out = run_layout_command("--world-size", "6", "--rollout.tp", "4")
    assert out.returncode != 0
    assert "rollout.tp (4) * rollout.pp (1) does not divide the global pool size (6)" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_layout("--world-size", "8", "--data.train-batch-size", "4", "--actor.ppo-mini-batch-size", "4")
    assert out.returncode != 0 and "data.train_batch_size (4) must be divisible by the rollout data-parallel size (8)" in out.stderr
    out = run_layout("--rollout.tp", "2")
    assert out.returncode != 0 and "--world-size is required" in out.stderr


def test_the_tool_plans_without_torch() -> None:
    """The layout tool runs where torch is not installed (a laptop): planning and printing a megatron
    cp layout, with a rollout pool and a critic, leave torch and transformers unimported (and fast)."""
    code = ("import sys; from spmd_rl import layout; rc = layout.main(['--world-size', '8', '--actor.engine', "
            "'megatron', '--actor.megatron.cp', '2', '--pools.rollout-ranks', '4', '--json']); "
            "rc2 = layout.main(['--world-size', '2', '--algo.adv-estimator', 'gae']); "
            "print(rc, rc2, sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "0 0 []", proc.stderr[-3000:]


def test_help() -> None:
    out = run_layout_command("--help")
    assert out.returncode == 0
    for flag in ("--world-size", "--nproc-per-node", "--json", "--actor.fsdp.fsdp-size", "--rollout.tp"):
        assert flag in out.stdout


def test_seed_example_vllm_tp4_on_a_rollout_pool_of_8() -> None:
    """The seed's 16-rank example: megatron tp 2 on an actor pool of 8, vLLM tp 4 on a rollout pool of 8.
    The rollout groups are rollout-pool ranks, and they are the groups vLLM gets there
    (spmd_rl.rollout.vllm_groups lays them as vLLM would)."""
    from spmd_rl.rollout.vllm_groups import vllm_group_ranks

    out = run_layout("--world-size", "16", "--nproc-per-node", "8", "--actor.engine", "megatron",
                     "--actor.megatron.tp", "2", "--pools.rollout-ranks", "8", "--model.path", "tiny-random",
                     "--rollout.backend", "vllm", "--rollout.tp", "4", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    g = d["groups"]
    assert g["rollout.tp"] == [[8, 9, 10, 11], [12, 13, 14, 15]] and g["rollout.dp"] == [[8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["megatron.tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d["actor_dp_size"] == 4 and d["rollout_dp_size"] == 2
    assert d["ranks"][9]["pools"] == {"rollout": 1} and d["ranks"][9]["rollout"] == {"dp": 0, "pp": 0, "tp": 1}
    assert (d["ranks"][9]["node"], d["ranks"][9]["gpu"]) == (1, 1) and d["ranks"][3]["rollout"] is None
    vllm = vllm_group_ranks(list(range(8, 16)), tp=4, pp=1)
    assert vllm["world"] == [list(range(8, 16))] and vllm["tp"] == g["rollout.tp"] and vllm["pp"] == g["rollout.pp"]
    assert sorted(vllm["dp"]) == [[r] for r in range(8, 16)]
