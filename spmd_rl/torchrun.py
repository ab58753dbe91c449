"""torchrun that ends with its workers' status and one line, not with its own traceback.

    python -m spmd_rl.torchrun --nproc-per-node 8 -m spmd_rl.train --config X.yaml   # any torchrun flags

Everything is ``torch.distributed.run`` (the same flags, rendezvous, restarts, signal forwarding);
only its end differs. Plain torchrun exits 1 with a Python traceback whenever a worker failed or a
signal stopped it, so the workers' statuses (2: a user error, 75: stopped after saving its
checkpoint, docs/CHECKPOINTS.md) do not reach the shell or Slurm. Here:

* a worker failed: torchrun's summary is one line naming the first failed worker, and the exit
  status is that worker's (a worker killed by signal N: 128 + N);
* torchrun itself got a stop signal (SIGTERM, SIGINT, ... of ``--signals-to-handle``): it forwarded
  it and waited for its workers as usual (``--shutdown-timeout``); one line, status 128 + N.

And one fix for elastic runs (``--nnodes MIN:MAX`` with MIN < MAX): a node that joins a running job
must find the new round's ``MASTER_ADDR`` in the rendezvous store, which torch's c10d rendezvous
(2.4 to 2.13 at least) writes only in a node's first round when it shares its TCP store with the
workers; the node already at rank 0 never writes it again, and the newcomer waits until the
rendezvous times out. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's own switch: a store of its own
for the workers, found again every round) is set for elastic runs unless already set
(``tests/test_elastic.py``: an agent joins, the world grows at the restart and the run goes on).
"""

from __future__ import annotations

import os
import sys

NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def elastic(argv: list[str]) -> bool:
    """Whether torchrun's ``argv`` asks for a range of nodes (``--nnodes MIN:MAX``, MIN < MAX), as torchrun's
    own parser reads it (a malformed command is left for torchrun to report)."""
    from torch.distributed.run import get_args_parser

    try:
        nnodes = str(get_args_parser().parse_known_args(argv)[0].nnodes)
    except SystemExit:
        return False
    low, _, high = nnodes.partition(":")
    return bool(high) and low != high


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if elastic(sys.argv[1:]):
        os.environ.setdefault(NO_SHARED_STORE, "1")
    try:
        torchrun()
    except SignalException as e:
        name = getattr(e.sigval, "name", str(e.sigval))
        print(f"spmd_rl.torchrun: {name}: forwarded to the workers and waited for them (a run stopped this way saves "
              "its checkpoint first: see the workers' lines above)", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        what = {2: "a user error, reported above", 75: "stopped by a signal after saving its checkpoint"}.get(
            code, "see its output above" if failure.exitcode > 0 else f"killed by {failure.signal_name()}")
        print(f"spmd_rl.torchrun: worker rank {rank} (pid {failure.pid}) exited with status {code} ({what})",
              file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
