"""Fault injection for the crash-recovery tests, as a user reward function (no product hook).

    KILL_AT_CALL=3 KILL_RANK=1 KILL_MARKER=/tmp/m torchrun --max-restarts 1 -m spmd_rl.train \\
        --reward.fn support.faults:digit_fraction_killed_once ...

Rank ``$KILL_RANK`` SIGKILLs itself on its ``$KILL_AT_CALL``-th scoring call (the step number
when validation is off), unless the marker file ``$KILL_MARKER`` exists; it writes the marker
first, so the job that torchrun restarts runs through. Simulates a crashed process or node.
"""

from __future__ import annotations

import os
import signal

from support.rewards import digit_fraction

_calls = 0


def digit_fraction_killed_once(prompts: list[str], completions: list[str], **columns: list) -> list[float]:
    global _calls
    _calls += 1
    marker = os.environ["KILL_MARKER"]
    if (os.environ.get("RANK") == os.environ.get("KILL_RANK", "1") and _calls == int(os.environ["KILL_AT_CALL"])
            and not os.path.exists(marker)):
        with open(marker, "w") as f:
            f.write(f"killed rank {os.environ.get('RANK')} at scoring call {_calls}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_fraction(prompts, completions, **columns)
