"""Tests for spmd_rl.atomic: a file or folder is replaced whole, or left as it was.

Run with ``python3 -m pytest tests/test_atomic.py -q``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from spmd_rl.atomic import atomic_folder, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "latest"
    path.write_text("step_1\n")
    write_atomic(path, "step_2\n")
    assert path.read_text() == "step_2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_atomic_folder_replaces_the_target_with_shared_modes(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.json").write_text("{}")
    with atomic_folder(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        (tmp / "new.json").write_text("{}")
        os.chmod(tmp / "new.json", 0o600)  # as safetensors writes its files
        assert (target / "old.json").exists()  # the old folder stays whole until the block ends
    assert sorted(p.name for p in target.iterdir()) == ["new.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((target / "new.json").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~mask


def test_atomic_folder_keeps_the_target_when_the_block_fails(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "out"
    target.mkdir(parents=True)
    (target / "old.json").write_text("{}")
    with pytest.raises(RuntimeError, match="half written"):
        with atomic_folder(target) as tmp:
            (tmp / "part.safetensors").write_bytes(b"\0")
            raise RuntimeError("half written")
    assert sorted(p.name for p in target.iterdir()) == ["old.json"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["out"]
