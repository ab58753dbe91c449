"""Checkpoints: exact resume, resharded resume, crash recovery, interrupted saves, HF export.

The end-to-end tests launch the real entry point under torchrun (2 CPU processes, gloo, the tiny
model, 4 GRPO steps with a checkpoint every 2). One uninterrupted run is the reference; a run cut
in two by a restart must end with bitwise-identical weights and identical logged metrics, and so
must a run whose rank 1 is SIGKILLed mid-step under ``torchrun --max-restarts 1`` and the same job
without the fault, started the same way (bitwise comparisons compare runs launched alike). The same checkpoint then
resumes on 1 process and on an HSDP [2, 1] layout, and is exported to a Hugging Face folder that
transformers loads and that scores tokens like the training engine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.checkpoint import Checkpointer
from spmd_rl.checkpoint_files import (
    latest_checkpoint, list_checkpoints, resolve_checkpoint, rng_state, set_rng_state, truncate_metrics,
)
from spmd_rl.config import CheckpointConfig
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed, run_program
from spmd_rl.export import export_hf, load_model_state, parse_size
from spmd_rl.models import resolve_model_path
from test_train_e2e import TINY

STEPS = ["--trainer.total-steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "2"]
UNTIMED = ("timing_s/", "perf/", "elapsed_s")


def launch(out_dir: Path, *flags: str, nproc: int = 2, restarts: int | None = None, env: dict | None = None,
           timeout: int = 300) -> subprocess.CompletedProcess:
    """The training program on ``nproc`` CPU ranks: forked from a warm process (``run_program``), or
    under ``torchrun --max-restarts restarts`` when ``restarts`` is given (0 included)."""
    if restarts is None:  # the program, not torchrun's restarts: its ranks forked from a warm process
        proc = run_program("spmd_rl.train", [*TINY, "--trainer.output-dir", str(out_dir), *flags], nproc=nproc,
                           env=dict(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **(env or {})),
                           cwd=REPO, timeout=timeout)
        assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
        return proc
    environ = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1", **(env or {}))
    # Plain torchrun flags: DistEnv gives every restart attempt its own namespace in the agent's
    # store, so `--max-restarts` needs no extra setting (docs/CHECKPOINTS.md, crash recovery).
    rdzv = ["--master-port", str(free_port()), "--max-restarts", str(restarts)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *rdzv,
           "-m", "spmd_rl.train", *TINY, "--trainer.output-dir", str(out_dir), *flags]
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    return proc


def metrics(out_dir: Path) -> list[dict]:
    with open(out_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ in {different}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """4 uninterrupted steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("reference") / "run"
    launch(out, *STEPS)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_2", "step_4"]
    return out


# --------------------------------------------------------------------------- pieces, one process


def test_auto_ignores_interrupted_saves(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step}))
        (root / f"step_{step}" / "COMPLETE").write_text("")
    (root / "latest").write_text("step_4\n")
    assert latest_checkpoint(root) == root / "step_4"
    # A kill during the save of step 6: its temporary folder, and a folder without the marker.
    (root / ".tmp-step_6").mkdir()
    (root / "step_6").mkdir()
    (root / "step_6" / "meta.json").write_text(json.dumps({"step": 6}))
    assert latest_checkpoint(root) == root / "step_4"
    (root / "latest").write_text("step_6\n")  # even a pointer to it is not followed
    assert latest_checkpoint(root) == root / "step_4"
    (root / "latest").unlink()  # the pointer is a convenience; the markers decide
    assert latest_checkpoint(root) == root / "step_4"
    assert resolve_checkpoint(tmp_path) == (root / "step_4").resolve()
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        resolve_checkpoint(root / "step_6")
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_rng_state_round_trip():
    state = json.loads(json.dumps(rng_state()))  # what a checkpoint stores
    draws = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])


def test_truncate_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3)) + '{"step": 4, "x"')
    assert truncate_metrics(path, 2) == 2  # step 3 and the line cut by a kill
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    assert truncate_metrics(path, -1) == 3  # a fresh start logs everything again


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100KB") == 10**5
    with pytest.raises(ValueError, match="max-shard-size"):
        parse_size("lots")


# --------------------------------------------------------------------------- torchrun


def test_resume_is_exact(reference, tmp_path):
    """2 steps, then a new job resumes at step 2 and runs 2 more: same weights and metrics as 4 at once.
    Leftovers of a save killed at step 3 (a temporary folder, a folder without marker, a pointer
    to it) are ignored by `resume: auto`."""
    out = tmp_path / "run"
    launch(out, "--trainer.total-steps", "2", "--checkpoint.every", "2")
    root = out / "checkpoints"
    shutil.copytree(root / "step_2", root / ".tmp-step_3")
    shutil.copytree(root / "step_2", root / "step_3")
    (root / "step_3" / "COMPLETE").unlink()
    (root / "latest").write_text("step_3\n")
    proc = launch(out, *STEPS)
    assert "resumed from" in proc.stderr and "step_2 at step 2" in proc.stderr, proc.stderr[-3000:]
    assert_same_weights(load_model_state(reference), load_model_state(out))
    assert metrics(out) == metrics(reference)
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    clock = [json.loads(line)["elapsed_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert clock == sorted(clock), f"elapsed_s went back at the resume: {clock}"  # continued from step_2's
    assert not (root / ".tmp-step_3").exists()  # cleaned up by the next save
    assert (root / "latest").read_text().strip() == "step_4"


def test_crash_recovery_under_torchrun_restarts(tmp_path):
    """Rank 1 is SIGKILLed in step 3; torchrun restarts the job, which resumes at step 2 by itself and
    ends bit for bit where the same job without the fault ends. Both are started the same way (torchrun
    with one restart allowed, the same environment and thread settings): a bitwise comparison with
    ranks forked from this warm process (``reference``) would also compare how torch was set up."""
    runs = {}
    for name, env in (("uninterrupted", {"KILL_AT_CALL": "0", "KILL_MARKER": str(tmp_path / "never")}),
                      ("killed", {"KILL_AT_CALL": "3", "KILL_RANK": "1", "KILL_MARKER": str(tmp_path / "marker")})):
        runs[name] = tmp_path / name
        launch(runs[name], *STEPS, "--reward.fn", "support.faults:digit_fraction_killed_once", restarts=1, env=env)
    assert (tmp_path / "marker").is_file(), "the fault was not injected"
    assert_same_weights(load_model_state(runs["uninterrupted"]), load_model_state(runs["killed"]))
    assert metrics(runs["killed"]) == metrics(runs["uninterrupted"])


@pytest.mark.parametrize("layout", ["1 process", "hsdp 2x1"])
def test_resume_on_another_layout(reference, tmp_path, layout):
    """DCP reshards the step-2 checkpoint of the 2-process FSDP run; the change is reported."""
    out = tmp_path / "run"
    flags = ["--checkpoint.resume", str(reference / "checkpoints" / "step_2"), *STEPS]
    if layout == "1 process":
        proc = launch(out, *flags, nproc=1)
        assert "world size 2 -> 1" in proc.stderr, proc.stderr[-3000:]
    else:
        proc = launch(out, *flags, "--actor.fsdp.fsdp-size", "1")
        assert "actor.fsdp.fsdp_size -1 -> 1" in proc.stderr, proc.stderr[-3000:]
    assert [m["step"] for m in metrics(out)] == [3, 4]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_4"]
    resumed, ref = load_model_state(out), load_model_state(reference)
    assert sorted(resumed) == sorted(ref)
    if layout == "hsdp 2x1":  # same data per rank, same sums: HSDP continues the same training
        for k in ref:
            torch.testing.assert_close(resumed[k], ref[k], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- Hugging Face export


def base_folder() -> str:
    return resolve_model_path("tiny-random", cache_dir=None)  # $SPMD_RL_CACHE (conftest)


def _engine_vs_export_body(rank: int, world_size: int, step_dir: str, hf_dir: str, out_dir: str) -> dict:
    """The base model in the FSDP engine with the checkpoint loaded by DCP, and the exported folder
    in the rollout engine: log-probs of the same sampled tokens."""
    from spmd_rl.checkpoint import Checkpointer
    from spmd_rl.config import CheckpointConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.rollout.native import NativeRollout

    engine = FSDPEngine(model_folder=base_folder(), mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), trainable=False, pad_token_id=0)
    ckpt = Checkpointer(checkpoint=CheckpointConfig(resume=step_dir), output_dir=out_dir, total_steps=4,
                        rank_table=[{"rank": 0, "host": "h", "device": "cpu"}])
    ckpt.track(actor=engine)  # only the model: a frozen engine has no optimizer state to load
    assert ckpt.resume() == 4
    rollout = NativeRollout(hf_dir, device=torch.device("cpu"), dtype=torch.float32, batch_size=8,
                            pad_token_id=0, eos_token_ids=[2])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(7, 104, (n,), generator=g).tolist() for n in (5, 9, 13)]
    gen = rollout.generate(prompts, n=3, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=5)
    batch = RolloutBatch(prompts=gen.prompt_ids,
                         tensors={"response_ids": gen.response_ids, "response_mask": gen.response_mask})
    logprobs, _ = engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=4)
    mask = gen.response_mask
    diff = (logprobs - gen.logprobs).abs() * mask
    return {"max": diff.max().item(), "tokens": mask.sum().item()}


def test_export_loads_in_transformers(reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = load_model_state(reference)
    # The CLI, in one process without torchrun, with tiny shards to exercise the index.
    sharded = tmp_path / "hf_sharded"
    proc = subprocess.run([sys.executable, "-m", "spmd_rl.export", str(reference), str(sharded),
                           "--max-shard-size", "100KB"], capture_output=True, text=True, cwd=REPO,
                          env=cpu_env(PYTHONPATH=REPO), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 4)" in proc.stdout
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("model-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(sharded)
    assert_same_weights(trained, {k: v.detach() for k, v in model.state_dict().items()})
    base = AutoModelForCausalLM.from_pretrained(base_folder()).state_dict()
    assert all(not torch.equal(base[k], trained[k]) for k in trained if k.endswith("proj.weight")), "not trained?"
    assert AutoTokenizer.from_pretrained(sharded)("2+3").input_ids

    single = export_hf(reference / "checkpoints" / "step_4", tmp_path / "hf")
    assert (single / "model.safetensors").is_file() and not (single / "model.safetensors.index.json").exists()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_hf(reference, single)
    (result,) = run_distributed(_engine_vs_export_body, 1, str(reference / "checkpoints" / "step_4"),
                                str(single), str(tmp_path / "engine"))
    print(f"\nengine (DCP) vs exported HF model log-probs over {result['tokens']:.0f} tokens: max abs diff {result['max']:.2e}")
    assert result["tokens"] > 20 and result["max"] <= 1e-4, result


class _Component:
    def __init__(self) -> None:
        self.x = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"x": self.x}

    def load_state_dict(self, state: dict) -> None:
        self.x.copy_(state["x"])


def _export_copy_body(rank: int, world_size: int, out_dir: str) -> tuple[int, list[float], list[str], int]:
    from spmd_rl.checkpoint import EXPORT
    from spmd_rl.checkpoint_files import load_without_process_group

    table = [{"rank": 0, "host": "h", "device": "cpu"}]
    calls = []

    def export() -> dict:  # like the megatron engine's export_weights: HF names, written only
        calls.append(1)
        return {"model.embed_tokens.weight": torch.full((2, 2), 5.0)}

    old = _Component()
    old.x += 7.0
    saver = Checkpointer(checkpoint=CheckpointConfig(), output_dir=out_dir, total_steps=2, rank_table=table)
    saver.track(actor=old, export=export)
    folder = saver.save(2)
    saved = load_without_process_group(folder, [EXPORT])[EXPORT]
    new = _Component()
    loader = Checkpointer(checkpoint=CheckpointConfig(), output_dir=out_dir, total_steps=2, rank_table=table)
    loader.track(actor=new, export=export)
    return loader.resume(), new.x.tolist(), sorted(saved), len(calls)


def _renamed_copy_body(rank: int, world_size: int, tmp: str) -> tuple[int, list[float], int]:
    table = [{"rank": 0, "host": "h", "device": "cpu"}]
    old = _Component()
    old.x += 3.0
    saver = Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/run", total_steps=5, rank_table=table)
    saver.track(actor=old)
    shutil.copytree(saver.save(3), f"{tmp}/mycopy")
    new = _Component()
    loader = Checkpointer(checkpoint=CheckpointConfig(resume=f"{tmp}/mycopy"), output_dir=f"{tmp}/run2",
                          total_steps=5, rank_table=table)
    loader.track(actor=new)
    return loader.resume(), new.x.tolist(), loader.start_step


def test_resume_from_a_renamed_copy_of_a_checkpoint(tmp_path):
    """`--checkpoint.resume /path/to/mycopy`: a complete checkpoint under another name than step_N
    resumes at the step in its meta.json; a partial copy or a foreign folder says why not."""
    (res,) = run_distributed(_renamed_copy_body, 1, str(tmp_path))
    assert res == (3, [3.0, 3.0, 3.0], 3)
    assert resolve_checkpoint(tmp_path / "mycopy") == (tmp_path / "mycopy").resolve()
    partial = tmp_path / "partial"
    shutil.copytree(tmp_path / "mycopy", partial)
    (partial / "COMPLETE").unlink()
    with pytest.raises(FileNotFoundError, match=r"partial holds a checkpoint's meta\.json but no COMPLETE marker"):
        resolve_checkpoint(partial)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text('{"name": "x"}')
    (foreign / "COMPLETE").write_text("")
    with pytest.raises(FileNotFoundError, match=r"foreign/meta\.json does not name the checkpoint's step \(KeyError"):
        resolve_checkpoint(foreign)


def test_export_copy_is_written_and_never_loaded(tmp_path):
    """``track(export=...)``: the HF copy is saved under ``hf`` for ``spmd_rl.export``; a resume
    restores the components without asking for (or reading) it."""
    (res,) = run_distributed(_export_copy_body, 1, str(tmp_path / "run"))
    assert res == (2, [7.0, 7.0, 7.0], ["model.embed_tokens.weight"], 1)
