"""``launch/vllm_venv.sh`` makes a venv that sees the packages of the environment it is built over,
also when that environment is itself a venv (where ``--system-site-packages`` would expose the base
interpreter's packages instead). CPU only, no vllm: ``--no-install`` skips the pip install."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = os.path.join(REPO, "launch", "vllm_venv.sh")


def make_venv(python: str, env_dir: Path) -> None:
    proc = subprocess.run(["bash", SCRIPT, "--no-install", "--python", python, str(env_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def purelib(env_dir: Path) -> Path:
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed("spmd_rl"), reason="spmd_rl is not installed in this environment (the README's "
                    "install line: pip install -e .), only on PYTHONPATH: there is no editable install to see")
def test_venv_over_a_venv_sees_its_packages_and_editable_installs(tmp_path: Path) -> None:
    # outer: a venv over the environment running this test (a venv here, the system Python in CI),
    # plus a module of its own; inner: a venv over the outer venv, as the vLLM venv is made over
    # the user's venv or conda env.
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    make_venv(sys.executable, outer)
    (purelib(outer) / "spmd_rl_outer_marker.py").write_text("WHERE = 'outer'\n")
    make_venv(str(outer / "bin" / "python"), inner)
    assert "include-system-site-packages = false" in (inner / "pyvenv.cfg").read_text()
    check = ("import spmd_rl_outer_marker, torch, tyro, spmd_rl; "
             "print(spmd_rl_outer_marker.WHERE, torch.__version__, spmd_rl.__file__)")
    proc = subprocess.run([str(inner / "bin" / "python"), "-c", check], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr
    where, version, spmd_rl_file = proc.stdout.split()
    import torch

    assert where == "outer" and version == torch.__version__
    # spmd_rl is this checkout (an editable install reaches the inner venv through its .pth)
    assert os.path.realpath(spmd_rl_file).startswith(os.path.realpath(REPO) + os.sep)
    # the inner venv's own site-packages comes first, so what pip installs there wins
    path = subprocess.run([str(inner / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
                          capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split("\n")
    assert path.index(str(purelib(inner))) < path.index(str(purelib(outer)))
    assert sysconfig.get_path("purelib") in path  # and through the outer venv, this environment's
