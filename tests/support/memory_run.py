"""``torchrun ... -m support.memory_run PREFIX [spmd_rl.train flags]``: the trainer, and each rank's memory.

Each rank writes ``PREFIX<rank>.json`` at exit: ``base``, its resident memory once torch, transformers,
the trainer and a Llama model class are imported (what every rank pays before any model exists), and
``peak``, its peak resident memory over the run (VmHWM), both in bytes. ``tests/test_memory.py`` reads
them.
"""

from __future__ import annotations

import atexit
import json
import os
import sys


def main() -> None:
    prefix, argv = sys.argv[1], sys.argv[2:]
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import spmd_rl.trainer  # noqa: F401
    from spmd_rl.engine.host_memory import peak_rss, rss
    from spmd_rl.train import run

    base = rss()
    rank = os.environ.get("RANK", "0")

    def report() -> None:
        with open(f"{prefix}{rank}.json", "w") as f:
            json.dump({"base": base, "peak": peak_rss()}, f)

    atexit.register(report)
    sys.argv = ["spmd_rl.train", *argv]
    run(argv)


if __name__ == "__main__":
    main()
