"""The service protocol every serving pool runs on (spmd_rl/distributed/service.py), with a toy role
on 3 gloo CPU processes: clients 0 and 1 (0 the controller), server 2.

Commands reach the server in order from the controller alone; ``stop`` ends the loop with 0, or 1
when the server failed; ``abort`` with 1; a server that fails to set up, or fails on a command,
answers the clients' next request with its error (rank, host, what failed, the exception), which
every client raises.
"""

from __future__ import annotations

import pytest

from spmd_rl.distributed.comm import RemoteFailure
from spmd_rl.distributed.service import ServiceLink, ServiceServer
from spmd_rl.distributed.testing import run_distributed


class Adder(ServiceServer):
    """Adds the controller's ``add`` commands; answers each request round with its total per row."""

    def __init__(self, link: ServiceLink, *, broken: bool) -> None:
        super().__init__(link)
        self.broken, self.total, self.seen = broken, 0, []

    def setup(self) -> None:
        if self.broken:
            raise ValueError("no model here")

    def handle(self, kind: str, payload: object) -> None:
        if kind != "add":
            return super().handle(kind, payload)
        self.seen.append(payload)
        try:
            if payload < 0:
                raise ArithmeticError(f"negative {payload}")
            self.total += payload
        except ArithmeticError as e:
            self.fail("adding", e)
        got = self.gather()
        if self.error is not None:
            self.reply_error(got, self.error)
        else:
            self.reply(got, {c: [self.total + r for r in rows] for c, rows in got.rows.items()})


def body(rank: int, world_size: int, case: str) -> dict:
    link = ServiceLink(role="adder", clients=[0, 1], servers=[2], close_timeout_s=10)
    if rank == 2:
        server = Adder(link, broken=case == "setup")
        return {"code": server.serve(), "seen": server.seen}
    answers, error = [], None
    for value in (1, 2, -1 if case == "handle" else 3):
        link.command("add", value)  # the controller's reaches the server; rank 1's is a no-op
        try:
            answers.append(link.request([10 * rank, 10 * rank + 1]))
        except RemoteFailure as e:
            error = str(e)
            break
    link.close("RuntimeError: boom" if case == "abort" else None)
    return {"answers": answers, "error": error}


@pytest.mark.parametrize("case", ["stop", "abort", "setup", "handle"])
def test_commands_shutdown_and_errors_reach_every_rank(case: str) -> None:
    out = run_distributed(body, 3, case, timeout_s=120)
    server = out[2]
    assert server["code"] == (0 if case == "stop" else 1)
    if case in ("stop", "abort"):
        assert server["seen"] == [1, 2, 3]  # in order, once: rank 1 commands nothing
        for rank in (0, 1):
            assert out[rank]["error"] is None
            assert out[rank]["answers"] == [[1 + 10 * rank, 2 + 10 * rank], [3 + 10 * rank, 4 + 10 * rank],
                                            [6 + 10 * rank, 7 + 10 * rank]]
        return
    want = ("loading the adder failed: ValueError: no model here" if case == "setup"
            else "adding failed: ArithmeticError: negative -1")
    for rank in (0, 1):
        message = out[rank]["error"]
        assert message.startswith("rank 2: adder rank 2 (") and message.endswith(want), message
