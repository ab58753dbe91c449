"""The ``python`` tool's sandbox (``spmd_rl/episodes/sandbox.py``), one test per limit, real child processes.

Wall-clock limits are generous where the code is meant to finish (a busy 2-core machine starts Python
slowly); no test asserts a duration, only that the run ended and how.
"""

from __future__ import annotations

import os
import select
import socket

import pytest

from spmd_rl.episodes.sandbox import MEMORY_EXIT, run_python, truncate

SLOW_OK = 120.0  # for code that should finish: the limit only has to be far beyond any start-up time


def test_a_normal_computation_prints_its_result_and_the_folder_is_removed() -> None:
    result = run_python("print(2**10)", timeout_s=SLOW_OK)
    assert result.stdout == "1024\n" and result.stderr == ""
    assert result.exit_code == 0 and result.ok
    assert not (result.timed_out or result.killed_by_memory or result.truncated)
    assert result.workdir and not os.path.exists(result.workdir)
    assert not os.path.exists(os.path.dirname(result.workdir))


def test_the_code_can_write_and_read_inside_its_own_folder() -> None:
    code = "open('a.txt', 'w').write('inside'); import os; os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n" \
           "print(open('d/b.txt').read(), os.getcwd() == os.environ['HOME'])"
    result = run_python(code, timeout_s=SLOW_OK)
    assert result.ok, result.stderr
    assert result.stdout == "inside True\n"
    assert not os.path.exists(result.workdir)


def test_an_infinite_loop_is_killed_at_the_wall_clock_limit() -> None:
    result = run_python("print('started', flush=True)\nwhile True:\n    pass", timeout_s=1.0)
    assert result.timed_out and not result.ok
    assert result.exit_code is not None and result.exit_code < 0  # killed by a signal
    assert not result.killed_by_memory
    assert not os.path.exists(result.workdir)


def test_a_sleeping_process_group_is_killed_too() -> None:
    # time.sleep uses no CPU, so only the wall clock (killpg) can end it
    result = run_python("import time\ntime.sleep(3600)", timeout_s=1.0)
    assert result.timed_out and result.exit_code == -9


@pytest.mark.parametrize("code", [
    "a = []\nwhile True:\n    a.append(' ' * 10**6)",  # grows until the limit
    "x = b'x' * (4 * 1024**3)",  # one allocation over it
])
def test_a_memory_bomb_is_stopped_and_reported_as_memory(code: str) -> None:
    result = run_python(code, timeout_s=SLOW_OK, memory_mb=256)
    assert result.killed_by_memory and not result.timed_out and not result.ok
    assert result.exit_code == MEMORY_EXIT
    assert "memory limit" in result.stderr


def test_a_socket_connect_to_localhost_is_refused_and_nothing_connects() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
                f"s.connect(('127.0.0.1', {port}))\ns.sendall(b'hello')\nprint('connected')")
        result = run_python(code, timeout_s=SLOW_OK)
        assert result.exit_code == 1 and "connected" not in result.stdout
        assert "PermissionError: sandbox: socket" in result.stderr
        # the child has ended: a connection it made would be waiting in the backlog now
        readable, _, _ = select.select([listener], [], [], 0.5)
        assert readable == [], "the sandboxed code reached the listening socket"


def test_name_lookups_and_udp_are_refused() -> None:
    code = "import socket\ntry:\n    socket.getaddrinfo('localhost', 80)\nexcept PermissionError as e:\n    print('lookup', e)\n" \
           "try:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nexcept PermissionError as e:\n    print('udp', e)"
    result = run_python(code, timeout_s=SLOW_OK)
    assert result.ok, result.stderr
    assert "lookup sandbox:" in result.stdout and "udp sandbox:" in result.stdout


def test_a_write_outside_its_folder_is_refused_and_no_file_appears(tmp_path) -> None:
    target = tmp_path / "escaped.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('out')", timeout_s=SLOW_OK)
    assert result.exit_code == 1
    assert "outside the working folder is refused" in result.stderr
    assert not target.exists()


def test_changing_files_outside_its_folder_is_refused(tmp_path) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    code = "\n".join([
        "import os, shutil",
        f"for f in (lambda: os.remove({str(keep)!r}), lambda: os.rename({str(keep)!r}, 'here.txt'),",
        f"          lambda: shutil.rmtree({str(tmp_path)!r}), lambda: os.link({str(keep)!r}, 'hard'),",
        f"          lambda: os.chmod({str(keep)!r}, 0o777), lambda: os.open({str(keep)!r}, os.O_WRONLY)):",
        "    try:",
        "        f()",
        "        print('done')",
        "    except PermissionError as e:",
        "        print('refused')",
    ])
    result = run_python(code, timeout_s=SLOW_OK)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["refused"] * 6
    assert keep.read_text() == "mine"


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['true'])",
    "import os\nos.system('true')",
    "import os\nos.fork()",
    "import os\nos.execv('/bin/true', ['true'])",
    "import os\nos.kill(os.getppid(), 0)",
    "import ctypes\nctypes.CDLL(None).getpid()",
])
def test_processes_signals_and_ctypes_are_refused(code: str) -> None:
    result = run_python(code, timeout_s=SLOW_OK)
    assert result.exit_code == 1
    assert "PermissionError: sandbox:" in result.stderr


def test_output_is_truncated_with_a_marker() -> None:
    result = run_python("print('a' * 5000)\nprint('b' * 5000)", timeout_s=SLOW_OK, output_chars=200)
    assert result.ok and result.truncated
    assert len(result.stdout) < 300
    assert result.stdout.startswith("a" * 100) and result.stdout.rstrip("\n").endswith("b" * 50)
    assert "characters cut by the sandbox" in result.stdout


def test_truncate_keeps_short_text_whole() -> None:
    assert truncate("short", 10) == ("short", False)
    cut, was_cut = truncate("x" * 30, 10)
    assert was_cut and cut.startswith("xxxxx") and cut.endswith("xxxxx") and "20 characters cut" in cut


def test_an_error_in_the_code_reports_its_traceback_and_earlier_output() -> None:
    result = run_python("print('before')\n1 / 0", timeout_s=SLOW_OK)
    assert result.exit_code == 1 and result.stdout == "before\n"
    assert 'File "main.py", line 2' in result.stderr and "ZeroDivisionError" in result.stderr


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_python("pass", timeout_s=0)
