"""Exit soak: many short 2-process torchrun runs under CPU load; counts the runs that abort at exit.

    python bench/exit_soak.py                         # 50 runs, one busy-loop process as load
    python bench/exit_soak.py --runs 20 --load 2      # fewer runs, more load
    python bench/exit_soak.py --tree /tmp/old_copy    # the same soak against another copy of the code

Each run is ``torchrun --nproc-per-node 2 -m spmd_rl.train`` on the built-in tiny model, one GRPO
step of 4 prompts, validation and the final checkpoint, and must exit 0. A run *aborts* when its output shows
``terminate called`` or torchrun reports a worker killed by SIGABRT (``Signal 6``): the exit-time
abort that :mod:`spmd_rl.distributed.process` prevents (a gloo worker thread that outlived the interpreter's finalization); the same
race can also end in SIGSEGV (counted apart). The load is
``--load`` busy-loop processes beside the runs (the abort is a race, more frequent on a busy
machine). Stops by itself: ``--runs`` runs, each killed after ``--run-timeout-s``, and no new run
after ``--max-minutes``. Prints one line per run and a summary; exit status 1 if any run failed.
``--out`` keeps every failed run's output there.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from spmd_rl.distributed.testing import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = [  # one step, validation and the final checkpoint: the run ends right after collectives
    "--model.path", "tiny-random", "--data.task", "arithmetic", "--data.train-batch-size", "4",
    "--data.val-size", "4", "--rollout.n", "2", "--rollout.max-new-tokens", "4",
    "--actor.ppo-mini-batch-size", "4", "--actor.micro-batch-size", "8",
    "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "1",
    "--trainer.total-steps", "1",
]


def _busy(stop_at: float, parent: int) -> None:
    os.nice(5)  # load, not starvation: the runs must still finish
    x = 0
    while time.time() < stop_at and os.getppid() == parent:  # ends with the soak, even a killed one
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def classify(rc: int, text: str) -> str:
    if "terminate called" in text or re.search(r"Signal 6 \(SIGABRT\)|exitcode\s*:\s*-6\b", text):
        return "abort"
    if re.search(r"Signal 11 \(SIGSEGV\)|exitcode\s*:\s*-11\b", text):
        return "crash (SIGSEGV)"
    return "ok" if rc == 0 else f"failed (exit {rc})"


def one_run(tree: str, out_dir: str, timeout_s: float) -> tuple[str, int, float, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "tests")]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "spmd_rl.train", *FLAGS, "--trainer.output-dir", out_dir]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return "timeout", -9, time.monotonic() - start, text
    return classify(proc.returncode, text), proc.returncode, time.monotonic() - start, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--load", type=int, default=1, help="busy-loop processes running beside the runs")
    ap.add_argument("--tree", default=REPO, help="the copy of the code to run (default: this one)")
    ap.add_argument("--run-timeout-s", type=float, default=300)
    ap.add_argument("--max-minutes", type=float, default=90, help="start no run after this long")
    ap.add_argument("--out", default=None, help="folder for the output of failed runs")
    args = ap.parse_args()

    deadline = time.monotonic() + args.max_minutes * 60
    stop_at = time.time() + args.max_minutes * 60 + args.run_timeout_s
    loaders = [multiprocessing.Process(target=_busy, args=(stop_at, os.getpid()), daemon=True) for _ in range(args.load)]
    for p in loaders:
        p.start()
    counts: dict[str, int] = {}
    times = []
    try:
        with tempfile.TemporaryDirectory(prefix="exit_soak_") as tmp:
            for i in range(args.runs):
                if time.monotonic() > deadline:
                    print(f"--max-minutes {args.max_minutes} reached, stopping after {i} runs", flush=True)
                    break
                verdict, rc, seconds, text = one_run(args.tree, os.path.join(tmp, f"run{i}"), args.run_timeout_s)
                counts[verdict] = counts.get(verdict, 0) + 1
                times.append(seconds)
                print(f"run {i + 1:3d}/{args.runs}: {verdict:<20s} exit {rc:4d}  {seconds:5.1f} s", flush=True)
                if verdict != "ok" and args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, f"run{i + 1}.log"), "w") as f:
                        f.write(text)
    finally:
        for p in loaders:
            p.terminate()
    done = sum(counts.values())
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    mean = sum(times) / max(len(times), 1)
    print(f"{done} runs (load {args.load}, tree {args.tree}): {summary}; aborts {counts.get('abort', 0)}/{done}; "
          f"mean {mean:.1f} s per run", flush=True)
    return 0 if counts.get("ok", 0) == done else 1


if __name__ == "__main__":
    sys.exit(main())
