"""What a new user sees on a first run (issue 19): one line naming config.yaml instead of the whole
config, log lines that do not land on the progress bar, a bar that says what the slow first step is
doing, elapsed_s that goes on after a resume, a persistent compile cache, and --help entries that
give each default once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import logging
import os
import re
import sys
import textwrap
import time

import pytest
import torch

from spmd_rl.config import Config, LoggingConfig, load_config
from spmd_rl.metrics import RunSink, setup_logging


def _screen(text: str) -> list[str]:
    """What a terminal shows for ``text``: ``\\r`` goes back to the start of the line, later
    characters overwrite earlier ones."""
    lines = []
    for raw in text.split("\n"):
        buf: list[str] = []
        col = 0
        for ch in raw:
            if ch == "\r":
                col = 0
                continue
            if col < len(buf):
                buf[col] = ch
            else:
                buf.append(ch)
            col += 1
        lines.append("".join(buf).rstrip())
    return lines


def _sink(tmp_path, **kw) -> RunSink:
    return RunSink(logging_cfg=LoggingConfig(wandb="off", **kw), output_dir=str(tmp_path), total_steps=4,
                   start_step=0, config_dict={})


# --------------------------------------------------------------------------- config.yaml, one line


def test_config_is_written_and_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    sink = _sink(tmp_path)
    text = "model:\n  path: x\n" + "".join(f"k{i}: {i}\n" for i in range(100))
    sink.write_config(text, print_all=LoggingConfig().print_config)
    sink.close()
    assert (tmp_path / "config.yaml").read_text() == text
    shown = [line for line in _screen(sys.stderr.getvalue()) if line and "grpo" not in line]
    assert shown == [f"resolved config: {tmp_path / 'config.yaml'} (--logging.print-config prints it here)"]


def test_print_config_flag_prints_the_whole_config(tmp_path, monkeypatch):
    assert load_config(["--logging.print-config"]).logging.print_config
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    sink = _sink(tmp_path)
    text = "".join(f"k{i}: {i}\n" for i in range(100))
    sink.write_config(text, print_all=True)
    sink.close()
    shown = _screen(sys.stderr.getvalue())
    assert all(f"k{i}: {i}" in shown for i in range(100))


# --------------------------------------------------------------------------- log lines and the bar


def test_log_lines_are_written_around_the_progress_bar(tmp_path, monkeypatch):
    """A log line (the checkpoint's) printed while the bar is shown starts a line of its own, and
    the bar is drawn again after it."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    setup_logging(0, "host")
    sink = _sink(tmp_path)
    sink.log({"timing_s/step": 1.0, "critic/score/mean": 0.5}, 1)
    logging.getLogger("spmd_rl").info("saved checkpoint runs/x/checkpoints/step_1 (1.0 MiB) in 0.10 s")
    shown = _screen(sys.stderr.getvalue())
    ours = [line for line in shown if "saved checkpoint" in line]
    assert len(ours) == 1 and re.fullmatch(r"\d\d:\d\d:\d\d host:0 INFO saved checkpoint runs/x/checkpoints/step_1 "
                                           r"\(1\.0 MiB\) in 0\.10 s", ours[0]), shown
    assert shown[-1].startswith("grpo:") and "1/4" in shown[-1], shown  # the bar again, below the line
    sink.close()


# --------------------------------------------------------------------------- the first step on the bar


@pytest.mark.parametrize("device,note", [("cuda", "step 1: compiling and capturing graphs"),
                                         ("cpu", "step 1: first step running")])
def test_bar_says_what_the_first_step_does(tmp_path, monkeypatch, device, note):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    sink = _sink(tmp_path)
    sink.step_started(1, torch.device(device))
    assert note in _screen(sys.stderr.getvalue())[-1]
    sink.log({"timing_s/step": 1.0, "critic/score/mean": 0.5}, 1)  # step 1's metrics replace the note
    sink.step_started(2, torch.device(device))  # later steps leave the bar alone
    bar = _screen(sys.stderr.getvalue())[-1]
    assert "1/4" in bar and "reward=0.500" in bar and note not in bar and "step 2" not in bar, bar
    sink.close()


# --------------------------------------------------------------------------- elapsed_s after a resume


def _elapsed_body(rank: int, world_size: int, out_dir: str) -> tuple[float, float, int, float]:
    from spmd_rl.checkpoint import Checkpointer
    from spmd_rl.checkpoint_files import list_checkpoints
    from spmd_rl.config import CheckpointConfig
    from spmd_rl.data.sampler import PromptSampler

    table = [{"rank": 0, "host": "h", "device": "cpu"}]
    saver = Checkpointer(checkpoint=CheckpointConfig(), output_dir=out_dir, total_steps=4, rank_table=table)
    saver.track(sampler=PromptSampler(8, 2, 0))
    time.sleep(0.5)  # the run's time before its save
    saved = json.loads((saver.save(2) / "meta.json").read_text())["elapsed_s"]
    resumed = Checkpointer(checkpoint=CheckpointConfig(), output_dir=out_dir, total_steps=4, rank_table=table)
    resumed.track(sampler=PromptSampler(8, 2, 0))
    step = resumed.resume()
    start = resumed.start_elapsed_s
    later = json.loads((resumed.save(3) / "meta.json").read_text())["elapsed_s"]
    # one checkpoint is kept by default (enough to resume), holding only what a resume reads
    assert [p.name for p in list_checkpoints(resumed.root)] == ["step_3"]
    held = {p.name for p in (resumed.root / "step_3").iterdir()}
    assert held <= {".metadata", "__0_0.distcp", "rng", "meta.json", "manifest.json", "config.yaml", "hf",
                    "COMPLETE"}, held
    return saved, start, step, later


def test_elapsed_s_continues_after_a_resume(tmp_path):
    from spmd_rl.distributed.testing import run_distributed

    out = tmp_path / "run"
    ((saved, start, step, later),) = run_distributed(_elapsed_body, 1, str(out))
    assert saved >= 0.5 and step == 2
    assert start == saved  # what the resuming run starts its clock from
    assert later >= saved  # and its own save goes on counting
    sink = RunSink(logging_cfg=LoggingConfig(wandb="off", console=False), output_dir=str(out), total_steps=4,
                   start_step=step, config_dict={}, start_elapsed_s=start)
    sink.log({"critic/score/mean": 0.0}, 3)
    sink.close()
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert first["step"] == 3 and first["elapsed_s"] >= saved


# --------------------------------------------------------------------------- the compile cache


def test_compile_cache_is_set_under_the_cache_folder_unless_set(tmp_path, monkeypatch):
    from spmd_rl.compiled import use_compile_cache

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert use_compile_cache(tmp_path / "compile") == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile"), "TRITON_CACHE_DIR": str(tmp_path / "compile" / "triton")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile")
    # importing torch._dynamo writes torch's own default into the variable: that is not the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert use_compile_cache(tmp_path / "again")["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "again")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine/triton")
    assert use_compile_cache(tmp_path / "other") == {}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine" and os.environ["TRITON_CACHE_DIR"] == "/mine/triton"
    # what makes the folder worth keeping: torch's on-disk FX-graph and AOT-autograd caches are on
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache


class _Started(Exception):
    pass


def test_train_sets_the_compile_cache_before_the_world_starts(tmp_path, monkeypatch):
    """``spmd_rl.train`` points the caches at ``<cache_root>/compile`` before anything can compile."""
    from spmd_rl import train
    from spmd_rl.distributed.env import DistEnv
    from spmd_rl.models.builtin import cache_root

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # as on a GPU machine, where an import of torch._dynamo has put torch's default there already
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    seen = {}

    def init(self, **kw):
        seen.update({k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
        raise _Started

    monkeypatch.setattr(DistEnv, "init", init)
    with pytest.raises(_Started):
        train.main(["--model.cache-dir", str(tmp_path / "cache"), "--logging.wandb", "off"])
    folder = cache_root(str(tmp_path / "cache")) / "compile"
    assert seen == {"TORCHINDUCTOR_CACHE_DIR": str(folder), "TRITON_CACHE_DIR": str(folder / "triton")}
    from spmd_rl import console

    assert console.current() is None  # a failure to join the world stopped the status line's clock


# --------------------------------------------------------------------------- --help: each default once


def _config_classes(cls: type = Config) -> list[type]:
    out = [cls]
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            out += _config_classes(type(value))
    return out


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it, which tyro prints in --help)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def test_no_field_docstring_restates_its_default():
    """tyro ends every --help entry with ``(default: X)``: a docstring that also says "default: ..."
    or "default X" gives the default twice (or two different ones). Text on why a default was
    chosen, or what a special value means ("0 = off", "None = ..."), is fine."""
    bad = []
    for cls in _config_classes():
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            doc = docs.get(f.name, "")
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if re.search(r"\bdefault\s*:", doc, re.IGNORECASE):
                bad.append(f"{cls.__name__}.{f.name}: {doc!r}")
                continue
            if value is None or dataclasses.is_dataclass(value):
                continue
            shown = re.escape(str(value))
            if re.search(rf"\bdefaults?(\s+(is|to|of|=))?\s*`?{shown}\b", doc, re.IGNORECASE):
                bad.append(f"{cls.__name__}.{f.name}: {doc!r}")
    assert not bad, "docstrings that repeat what tyro prints as (default: X):\n" + "\n".join(bad)
