"""The ``python`` tool's sandbox: run untrusted code in a limited child process, get its output back.

Usage::

    result = run_python("print(2**10)", timeout_s=5.0, memory_mb=512, output_chars=4000)
    result.stdout          # "1024\\n"
    result.timed_out, result.killed_by_memory, result.exit_code, result.truncated

Each call runs ``sys.executable -I -B -c <bootstrap>`` in a new session (its own process group) with
a fresh temporary working folder that is removed afterwards, whatever happened. The bootstrap,
before the user's code runs:

* sets resource limits: ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU`` (about the wall-clock limit),
  ``RLIMIT_FSIZE`` (``file_mb``: files it writes, its stdout and stderr included), ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE`` 0 and, when not root (root is exempt from it), ``RLIMIT_NPROC`` 0 (no new processes
  or threads);
* enters new user and network namespaces (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``) where the
  kernel allows it (``SandboxResult.network_namespace``): no interface but a down loopback;
* installs an audit hook (``sys.addaudithook``; a hook cannot be removed) that refuses, with a
  ``PermissionError``: every ``socket.*`` event (creation, connect, bind, name lookups), ``open`` for
  writing outside the working folder and reading outside it and the interpreter's own folders, file
  changes (remove, rename, mkdir, chmod, links, ...) outside the folder, new processes
  (``subprocess``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``os.fork``),
  signals to other processes and any use of ``ctypes``.

The parent enforces the wall clock: past ``timeout_s`` it kills the whole process group
(``os.killpg``, SIGKILL). A ``MemoryError`` in the child (the ``RLIMIT_AS`` limit) or a SIGKILL the
sandbox did not send (the kernel's OOM killer) is reported as ``killed_by_memory``.

What it does not protect against: an audit hook is no security boundary (C code, including
extension modules, can do anything the process may do without raising an audit event); without the
namespaces the network is closed only by the hook; CPU, disk bandwidth and kernel attack surface are
not limited beyond the rlimits. Run the trainer in a container when the code is adversarial.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MEMORY_EXIT = 86
"""Exit code of the child after a ``MemoryError`` (the memory limit was reached)."""

TRUNCATED = "\n[... {n} characters cut by the sandbox ...]\n"

_BOOTSTRAP = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])

def _limit(which, soft, hard=None):
    try:
        resource.setrlimit(which, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass

_limit(resource.RLIMIT_AS, cfg["memory"])
_limit(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)
_limit(resource.RLIMIT_FSIZE, cfg["fsize"])
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NOFILE, 64)
if os.geteuid() != 0:
    _limit(resource.RLIMIT_NPROC, 0)

import ctypes, linecache, traceback
def _unshare():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(0x10000000 | 0x40000000) == 0 or libc.unshare(0x40000000) == 0
    except Exception:
        return False
os.write(cfg["status_fd"], b"netns=1" if _unshare() else b"netns=0")
os.close(cfg["status_fd"])
import _posixsubprocess
def _no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is refused")
_posixsubprocess.fork_exec = _no_fork_exec

with open(cfg["code"], encoding="utf-8") as f:
    source = f.read()
work = os.path.realpath(os.getcwd())
readable = [work] + sorted({os.path.realpath(p) for p in
    [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, "/usr/lib",
     "/usr/local/lib", "/usr/share", "/etc/localtime", "/dev/null", "/dev/zero", "/dev/urandom"] if p})

def _inside(path, roots):
    if isinstance(path, int):
        return True
    try:
        full = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return any(full == r or full.startswith(r.rstrip("/") + "/") for r in roots)

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
               "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1),
               "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
               "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.move": (0, 1), "os.mkfifo": (0,),
               "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "os.chflags": (0,)}
REFUSED_PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn",
                    "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg", "os.startfile",
                    "signal.pthread_kill", "os.add_dll_directory", "_posixsubprocess")

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if writing and not _inside(path, (work,)):
            raise PermissionError(f"sandbox: writing {path!r} outside the working folder is refused")
        if not writing and not _inside(path, readable):
            raise PermissionError(f"sandbox: reading {path!r} is refused")
    elif event in PATH_EVENTS:
        for i in PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not _inside(args[i], (work,)):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working folder is refused")
    elif event.startswith(REFUSED_PREFIXES):
        raise PermissionError(f"sandbox: {event} is refused (no network, no processes, no ctypes)")
    elif event == "import" and args[0] in ("_posixsubprocess", "_ctypes"):
        raise PermissionError(f"sandbox: importing {args[0]} again is refused")

sys.addaudithook(_hook)
linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"}
del cfg, f
try:
    exec(compile(source, "main.py", "exec"), namespace)
except MemoryError:
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os.write(2, b"MemoryError: the sandbox's memory limit was reached\n")
    os._exit(86)
except SystemExit:
    raise
except BaseException as e:
    sys.stdout.flush()
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.stderr.flush()
    os._exit(1)
'''


@dataclass
class SandboxResult:
    """What one ``run_python`` call did."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The child's exit status; negative: killed by that signal; None: never started."""
    timed_out: bool
    """Killed at the wall-clock limit (or by ``RLIMIT_CPU``)."""
    killed_by_memory: bool
    truncated: bool
    """``stdout`` or ``stderr`` was cut to ``output_chars``."""
    seconds: float
    network_namespace: bool
    """The child ran in its own network namespace (else only the audit hook kept it off the network)."""
    workdir: str
    """The temporary working folder the code ran in (already removed)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.killed_by_memory


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to its first and last ``limit // 2`` characters with a marker between; whether cut."""
    if len(text) <= limit:
        return text, False
    head, tail = limit // 2, limit - limit // 2
    return text[:head] + TRUNCATED.format(n=len(text) - head - tail) + (text[-tail:] if tail else ""), True


def _child_env(work: str) -> dict[str, str]:
    env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def _read(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read()
    return truncate(data.decode("utf-8", errors="replace"), limit)


def _remove_tree(top: str) -> None:
    """Remove ``top`` even where the code made parts of it unreadable."""
    for root, _, _ in os.walk(top):
        try:
            os.chmod(root, 0o700)
        except OSError:
            pass
    shutil.rmtree(top, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _start(code: str, base: str, work: str, cfg: dict, out, err) -> tuple[subprocess.Popen, int]:
    """Start the child; return it and the read end of the pipe it reports its namespace on (read that
    after the child ended: it is written before the user's code runs)."""
    code_path = os.path.join(base, "code.py")
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    status_r, status_w = os.pipe()
    cfg = dict(cfg, code=code_path, status_fd=status_w)
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", _BOOTSTRAP, json.dumps(cfg)], cwd=work,
                                env=_child_env(work), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, pass_fds=(status_w,), close_fds=True)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    return proc, status_r


def _namespace_status(status_r: int) -> bool:
    with os.fdopen(status_r, "rb") as status:
        return status.read() == b"netns=1"


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child; kill its process group at ``timeout_s``; whether it was killed for time."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
        return True
    finally:
        _kill_group(proc)  # anything it left behind in its group


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, output_chars: int = 4000,
               file_mb: int = 16) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring) and return what it printed and how it ended."""
    if not timeout_s > 0 or memory_mb < 16 or output_chars < 0 or file_mb < 1:
        raise ValueError(f"run_python: timeout_s must be > 0, memory_mb >= 16, output_chars >= 0, file_mb >= 1; "
                         f"got {timeout_s}, {memory_mb}, {output_chars}, {file_mb}")
    base = tempfile.mkdtemp(prefix="spmd_rl_sandbox_")
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    cfg = {"memory": memory_mb << 20, "cpu": max(1, math.ceil(timeout_s)) + 1, "fsize": file_mb << 20}
    start = time.monotonic()
    try:
        with open(os.path.join(base, "stdout"), "wb") as out, open(os.path.join(base, "stderr"), "wb") as err:
            proc, status_r = _start(code, base, work, cfg, out, err)
            timed_out = _wait(proc, timeout_s)
            netns = _namespace_status(status_r)
        seconds = time.monotonic() - start
        stdout, cut_out = _read(os.path.join(base, "stdout"), output_chars)
        stderr, cut_err = _read(os.path.join(base, "stderr"), output_chars)
    finally:
        _remove_tree(base)
    rc = proc.returncode
    timed_out = timed_out or rc == -signal.SIGXCPU
    memory = rc == MEMORY_EXIT or (rc == -signal.SIGKILL and not timed_out)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=rc, timed_out=timed_out, killed_by_memory=memory,
                         truncated=cut_out or cut_err, seconds=seconds, network_namespace=netns, workdir=work)


__all__ = ["MEMORY_EXIT", "SandboxResult", "run_python", "truncate"]
