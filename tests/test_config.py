"""Config: every validation rule with its message, YAML < flag precedence, unknown keys, --help."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_rl.config import Config, from_yaml, load_config, to_yaml

# (flags, the message the rule must give) — one row per rule in spmd_rl/config/sections.py, rollout.py and engines.py;
# the rules between sections and those that need the world size are plan()'s (tests/test_plan.py).
RULES = [
    (["--data.train-batch-size", "0"], "data.train_batch_size must be >= 1, got 0"),
    (["--data.val-size", "-1"], "data.val_size must be >= 0, got -1"),
    (["--data.max-prompt-length", "0"], "data.max_prompt_length must be >= 1, got 0"),
    (["--data.operand-min", "5", "--data.operand-max", "2"], "data.operand_min (5) must be <= data.operand_max (2)"),
    (["--data.ops", "/"], "data.ops must be a non-empty subset of '+-*', got '/'"),
    (["--data.countdown-numbers", "1"], "data.countdown_numbers must be >= 2, got 1"),
    (["--data.task", "file"], "data.task=file reads a file: set --data.path"),
    (["--data.task", "gsm8k"], "data.task=gsm8k reads a file: set --data.path"),
    (["--rollout.n", "0"], "rollout.n must be >= 1, got 0"),
    (["--rollout.temperature", "-0.5"], "rollout.temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    (["--rollout.temperature", "inf"], "rollout.temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["--rollout.top-p", "0"], "rollout.top_p must be in (0, 1], got 0.0"),
    (["--rollout.top-k", "-1"], "rollout.top_k must be >= 0, got -1"),
    (["--rollout.max-new-tokens", "0"], "rollout.max_new_tokens must be >= 1, got 0"),
    (["--rollout.batch-size", "0"], "rollout.batch_size must be >= 1, got 0"),
    (["--rollout.partial-chunk", "0"], "rollout.partial_chunk must be >= 1, got 0"),
    (["--rollout.min-new-tokens", "30"], "rollout.min_new_tokens (30) must be in [1, rollout.max_new_tokens (24)]"),
    (["--rollout.token-delay-s", "-1"], "rollout.token_delay_s must be >= 0, got -1.0"),
    (["--rollout.tp", "0"], "rollout.tp (0) and rollout.pp (1) must be >= 1"),
    (["--rollout.gpu-memory-utilization", "1.5"], "rollout.gpu_memory_utilization must be in (0, 1], got 1.5"),
    (["--algo.rollout-is", "token_truncated", "--algo.rollout-is-cap", "0.5"], "algo.rollout_is_cap must be >= 1, got 0.5"),
    (["--actor.fsdp.fsdp-size", "0"], "actor.fsdp.fsdp_size must be -1 or >= 1, got 0"),
    (["--actor.fsdp.ulysses-size", "0"], "actor.fsdp.ulysses_size must be >= 1, got 0"),
    (["--actor.megatron.tp", "0"], "actor.megatron.tp must be >= 1, got 0"),
    (["--actor.megatron.pp", "0"], "actor.megatron.pp must be >= 1, got 0"),
    (["--actor.megatron.vpp", "0"], "actor.megatron.vpp must be >= 1, got 0"),
    (["--actor.megatron.cp", "0"], "actor.megatron.cp must be >= 1, got 0"),
    (["--actor.megatron.ep", "0"], "actor.megatron.ep must be >= 1, got 0"),
    (["--actor.megatron.etp", "0"], "actor.megatron.etp must be >= 1, got 0"),
    (["--actor.megatron.order", "tp-dp-pp"], "actor.megatron.order must name tp, cp, ep, dp, pp once each"),
    (["--actor.lr", "0"], "actor.lr must be a finite number > 0, got 0.0"),
    (["--actor.lr", "inf"], "actor.lr must be a finite number > 0, got inf"),
    (["--actor.lr", "nan"], "actor.lr must be a finite number > 0, got nan"),
    (["--actor.lr", "-1e-5"], "actor.lr must be a finite number > 0, got -1e-05"),
    (["--actor.betas", "1.5", "0.999"], "actor.betas must be two numbers in [0, 1), got 1.5 0.999"),
    (["--actor.betas", "0.9", "nan"], "actor.betas must be two numbers in [0, 1), got 0.9 nan"),
    (["--actor.weight-decay", "-0.1"], "actor.weight_decay must be a finite number >= 0, got -0.1"),
    (["--critic.lr", "inf"], "critic.lr must be a finite number > 0, got inf"),
    (["--actor.warmup-steps", "-1"], "actor.warmup_steps must be >= 0, got -1"),
    (["--actor.min-lr-ratio", "2"], "actor.min_lr_ratio must be in [0, 1], got 2.0"),
    (["--actor.grad-clip", "-1"], "actor.grad_clip must be >= 0, got -1.0"),
    (["--actor.skip-nonfinite-updates", "-1"], "actor.skip_nonfinite_updates must be >= 0, got -1"),
    (["--actor.ppo-mini-batch-size", "0"], "actor.ppo_mini_batch_size must be >= 1, got 0"),
    (["--actor.micro-batch-size", "0"], "actor.micro_batch_size must be >= 1, got 0"),
    (["--actor.ppo-epochs", "0"], "actor.ppo_epochs must be >= 1, got 0"),
    (["--actor.max-tokens-per-gpu", "0"], "actor.max_tokens_per_gpu must be >= 1 (or unset), got 0"),
    (["--algo.clip-low", "-0.1"], "algo.clip_low (-0.1) and algo.clip_high (0.2) must be >= 0"),
    (["--algo.clip-low", "1.5"], "algo.clip_low must be <= 1 (the ratio is clipped below at 1 - clip_low, which must "
                                 "stay >= 0; 1 = no lower clip), got 1.5"),
    (["--algo.clip-c", "1"], "algo.clip_c must be > 1, got 1.0"),
    (["--reward.timeout-s", "-1"], "reward.timeout_s must be >= 0 (0 = no limit), got -1.0"),
    (["--algo.kl-coef", "-1"], "algo.kl_coef must be >= 0, got -1.0"),
    (["--pools.reward-ranks", "-1"], "pools.reward_ranks must be a count (0, 1, 2, ...) or a fraction of the world in (0, 1), got -1"),
    (["--trainer.total-steps", "0"], "trainer.total_steps must be >= 1, got 0"),
    (["--trainer.val-every", "-1"], "trainer.val_every must be >= 0, got -1"),
    (["--trainer.dist-timeout-s", "0"], "trainer.dist_timeout_s must be >= 1, got 0"),
    (["--trainer.stall-timeout-s", "-1"], "trainer.stall_timeout_s must be >= 0 (0 = off), got -1"),
    (["--trainer.dist-timeout-s", "60"], "trainer.stall_timeout_s (600) must be below trainer.dist_timeout_s (60)"),
    (["--checkpoint.every", "-1"], "checkpoint.every must be >= 0, got -1"),
    (["--checkpoint.keep", "0"], "checkpoint.keep must be >= 1, got 0"),
    (["--checkpoint.every-s", "-1"], "checkpoint.every_s must be a number of seconds >= 0 (0 = off), got -1.0"),
    (["--checkpoint.every-s", "inf"], "checkpoint.every_s must be a number of seconds >= 0 (0 = off), got inf"),
    (["--checkpoint.save-signal", "SIGFOO"], "checkpoint.save_signal: unknown signal 'SIGFOO'; e.g. SIGUSR1"),
    (["--checkpoint.save-signal", "KILL"], "checkpoint.save_signal: unknown signal 'KILL'"),
]


@pytest.mark.parametrize("flags,message", RULES, ids=[r[1][:40] for r in RULES])
def test_rule_message(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(flags)


def test_yaml_then_flags_precedence(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("rollout:\n  n: 16\n  max_new_tokens: 99\nactor:\n  fsdp:\n    fsdp_size: 2\n  betas: [0.8, 0.9]\n")
    cfg = load_config(["--config", str(path), "--rollout.n", "3"])
    assert cfg.rollout.n == 3  # flag beats YAML
    assert cfg.rollout.max_new_tokens == 99  # YAML beats default
    assert cfg.actor.fsdp.fsdp_size == 2
    assert cfg.actor.betas == (0.8, 0.9)
    assert cfg.rollout.top_p == Config().rollout.top_p  # default stays
    cfg2 = load_config([f"--config={path}"])
    assert cfg2.rollout.n == 16


def test_yaml_round_trip(tmp_path):
    cfg = load_config(["--rollout.n", "5", "--data.ops", "+*"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert from_yaml(str(path)) == cfg


def test_unknown_yaml_key_lists_valid_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  nn: 4\n")
    with pytest.raises(ValueError, match=r"unknown config key rollout\.nn; valid keys: backend, n, temperature"):
        load_config(["--config", str(path)])
    path.write_text("rolout: {}\n")
    with pytest.raises(ValueError, match=r"unknown config key rolout; valid keys: model, data, rollout"):
        load_config(["--config", str(path)])


# (YAML text, what load_config must give: the value read, or the error message)
YAML_TYPES = [
    ("actor:\n  lr: 1e-5\n", ("actor.lr", 1e-5)),  # PyYAML reads `1e-5` (no dot) as a string
    ("actor:\n  lr: 1\n", ("actor.lr", 1.0)),  # an int for a float
    ("data:\n  train_batch_size: 8.0\n", ("data.train_batch_size", 8)),  # an integral float for an int
    ("trainer:\n  profile_steps: [2, 4.0]\n", ("trainer.profile_steps", [2, 4])),
    ("actor:\n  fsdp:\n    keep_logits_gib: 2\n", ("actor.fsdp.keep_logits_gib", 2.0)),
    ("actor:\n  fsdp:\n    keep_logits_gib:\n", ("actor.fsdp.keep_logits_gib", None)),
    ("actor:\n  betas: [0.8, 0]\n", ("actor.betas", (0.8, 0.0))),
    ("algo:\n  use_kl_loss: \"false\"\n",
     "p.yaml: algo.use_kl_loss: expected true or false, got the string 'false': write false without quotes"),
    ("algo:\n  use_kl_loss: 0\n", "p.yaml: algo.use_kl_loss: expected true or false, got the integer 0"),
    ("trainer:\n  total_steps: 2.7\n", "p.yaml: trainer.total_steps: expected an integer, got the number 2.7"),
    ("actor:\n  lr: fast\n", "p.yaml: actor.lr: expected a number, got the string 'fast'"),
    ("actor:\n  lr: true\n", "p.yaml: actor.lr: expected a number, got the boolean true"),
    ("rollout:\n  n:\n", "p.yaml: rollout.n: expected an integer, got null (an empty value)"),
    ("logging:\n  run_name: 2024\n", "p.yaml: logging.run_name: expected a string, got the integer 2024 (put it in quotes)"),
    ("logging:\n  wandb: off\n", "p.yaml: logging.wandb: expected one of 'auto', 'on', 'off', got the boolean false "
                                   "(YAML reads unquoted true/false/yes/no/on/off as booleans: put the word in quotes)"),
    ("reward:\n  model:\n    input: words\n",  # a Literal in a nested section
     "p.yaml: reward.model.input: expected one of 'auto', 'ids', 'text', got the string 'words'"),
    ("rollout:\n  sleep_level: 2.0\n", ("rollout.sleep_level", 2)),
    ("rollout:\n  sleep_level: 1.5\n", "p.yaml: rollout.sleep_level: expected one of 0, 1, 2, got the number 1.5"),
    ("actor:\n  betas: [0.9]\n", "p.yaml: actor.betas: expected a list of 2 values, got 1: [0.9]"),
    ("actor:\n  betas: [0.9, high]\n", "p.yaml: actor.betas[1]: expected a number, got the string 'high'"),
    ("actor:\n  betas: 0.9\n", "p.yaml: actor.betas: expected a list, got the number 0.9"),
    ("trainer:\n  profile_steps: [1, 2.5]\n", "p.yaml: trainer.profile_steps[1]: expected an integer, got the number 2.5"),
    ("actor: 5\n", "p.yaml: actor: expected a mapping of keys to values, got the integer 5"),
]


@pytest.mark.parametrize("text,expected", YAML_TYPES, ids=[r[0].replace("\n", " ")[:40] for r in YAML_TYPES])
def test_yaml_values_are_checked_against_their_types(tmp_path, monkeypatch, text, expected):
    """Each YAML value must fit its field's type; it is converted only where nothing is lost, and the
    error names the file and the key (a wrong type used to fail late, or run with a wrong value)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(text)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(expected)):
            load_config(["--config", "p.yaml"])
        return
    key, value = expected
    got = load_config(["--config", "p.yaml"])
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text,where,problem", [
    ("actor:\n  lr: 1e-5\n  betas: [0.9, 0.99\nrollout:\n  n: 4\n", ":4:8:", "expected ',' or ']', but got ':'"),
    ("rollout:\n  n: 4\n  top_p: a: b\n", ":3:11:", "mapping values are not allowed here"),
    ("rollout:\n\tn: 4\n", ":2:1:", "found character '\\t' that cannot start any token"),
])
def test_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path, text, where, problem):
    """A YAML syntax error is a config error (a ValueError naming the file, line and column, which
    ``spmd_rl.train`` prints as one line with status 2), not PyYAML's raw ParserError."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_config(["--config", str(path)])
    message = str(info.value)
    assert message.startswith(f"{path}{where} YAML syntax error: {problem}"), message
    assert "\n" not in message


def test_train_reports_a_yaml_syntax_error_in_one_line(tmp_path):
    """The program: exit status 2 and one line on stderr (before: 1, and three tracebacks)."""
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  n: 4\n  top_p: a: b\n")
    proc = subprocess.run([sys.executable, "-m", "spmd_rl.train", "--config", str(path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "spmd_rl.train" in line or "Error" in line]  # not the status line
    assert lines == [f"spmd_rl.train: invalid configuration: {path}:3:11: YAML syntax error: mapping values are not "
                     "allowed here"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_missing_yaml_file():
    with pytest.raises(FileNotFoundError, match="--config nope.yaml: no such file"):
        load_config(["--config", "nope.yaml"])


def test_rule_from_yaml_names_the_flag(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("rollout:\n  n: 0\n")
    with pytest.raises(ValueError, match=re.escape("rollout.n must be >= 1, got 0")):
        load_config(["--config", str(path)])


@pytest.mark.parametrize("module", ["spmd_rl.train", "spmd_rl.layout"])
def test_help_shows_field_docs(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "--rollout.n" in text and "Responses sampled per prompt" in text
    assert "--actor.fsdp.fsdp-size" in text and "--config PATH" in text
    if module == "spmd_rl.layout":
        assert "--world-size" in text


def test_train_help_imports_no_torch():
    """``python -m spmd_rl.train --help`` answers before the trainer's imports: torch and transformers
    stay unimported (a second instead of five)."""
    code = ("import sys; from spmd_rl import train\n"
            "try:\n    train.main(['--rollout.n', '4', '--help'])\nexcept SystemExit as e:\n    print('exit', e.code)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert "--rollout.n" in out.stdout and "exit 0" in out.stdout, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("preset", sorted(p.name for p in (Path(__file__).parent.parent / "configs").glob("*.yaml")))
def test_every_preset_loads_and_plans(preset):
    """Each shipped preset parses, passes validation, and lays out on 1 and 2 processes."""
    from spmd_rl.plan import plan

    cfg = load_config(["--config", str(Path(__file__).parent.parent / "configs" / preset)])
    for world in (1, 2):
        plan(cfg, world, world)
