"""Atomic writes: a file or a folder is seen whole (old or new) or not at all, never half written.

    write_atomic(path, text)                  # temp file beside it, fsync, os.replace, fsync of the folder
    write_file(path, text)                    # plain write, fsync'd (inside a folder made atomic otherwise)
    with atomic_folder(out) as tmp:           # write into tmp; it replaces `out` when the block ends
        (tmp / "config.json").write_text(...)

Temporaries are hidden siblings of their target (``.NAME.tmp-...``), on the same file system so the
final rename is atomic; a crash leaves one behind, which the next writer of the same name may remove.
This module imports nothing of the package: checkpoints, exports and the built-in model cache use it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the file system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_file(tmp, text)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def make_readable(folder: Path) -> None:
    """Give ``folder`` and its entries the umask's usual modes: ``mkdtemp`` and some writers
    (safetensors) make them private, while an export or a model cache is meant to be shared."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for path in folder.iterdir():
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


@contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """A hidden sibling temporary folder to write into. When the block ends without an error it gets
    the umask's modes (:func:`make_readable`) and is renamed to ``target`` (an existing ``target`` is
    removed first); on an error it is removed and ``target`` is left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        make_readable(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["atomic_folder", "fsync_dir", "make_readable", "write_atomic", "write_file"]
