"""The reward pool: its ranks serve reward-model scores to the global pool until training ends.

    # reward-pool ranks (spmd_rl.serve.serve_pool dispatches by pool membership)
    code = RewardServer(link=groups.exchange, group=reward_pool.group, build=lambda: RewardModel(...)).serve()
    # global-pool ranks
    scores = RemoteModelReward(groups.exchange).score(rows)        # one float per row
    groups.exchange.close(error)                                   # stop, or abort with the error

Both ends are the reward role on the service protocol (:mod:`spmd_rl.distributed.service`), the one
role whose every client sends requests and closes. Each round (one per scoring call of the trainer)
every global rank sends its rows split over the reward ranks (:meth:`RewardLink.request`); the reward
ranks agree over their own group on the largest row count (FSDP needs the same number of forwards on
every rank) and on any error, score, and answer each global rank with its rows' scores. Between rounds a reward rank waits
in a blocking gloo receive: no busy CPU and, on GPU, nothing but the (optionally offloaded) model.

Failures: a reward rank whose model fails to load or to score answers with the error (rank, host
and message) instead of scores; the global ranks raise :class:`RewardError` and, leaving, send
``abort``; the server then returns 1. A global rank that fails anywhere else sends ``abort`` from
its exception path; the servers answer every global rank still sending rows with that error, and
return 1 once every global rank has stopped or aborted (or is gone). A server never waits longer
than the process group's timeout.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Protocol, Sequence

import torch.distributed as dist

from spmd_rl.distributed.comm import RemoteFailure, all_gather_objects
from spmd_rl.distributed.service import ABORT, STOP, Requests, ServiceLink, ServiceServer
from spmd_rl.reward.registry import RewardError

log = logging.getLogger("spmd_rl")


class RowScorer(Protocol):
    """What the server runs: :class:`spmd_rl.reward.model.RewardModel` or any object like it."""

    micro_batch_size: int

    def check(self, rows: Sequence[Sequence[int]]) -> None: ...

    def score(self, rows: Sequence[Sequence[int]], *, num_micro_batches: int) -> list[float]: ...


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class RewardLink(ServiceLink):
    """The reward role's client on :class:`~spmd_rl.distributed.service.ServiceLink`: every global
    rank sends its rows (:meth:`request`) and says ``stop`` or ``abort`` itself (:meth:`close`)."""

    def __init__(self, *, clients: Sequence[int], servers: Sequence[int], close_timeout_s: float = 60.0) -> None:
        super().__init__(role="reward", clients=clients, servers=servers, close_timeout_s=close_timeout_s,
                         every_client=True)


class RewardServer(ServiceServer):
    """The loop of a reward-pool rank, the reward role's server on
    :class:`~spmd_rl.distributed.service.ServiceServer` (see the module docstring)."""

    loading = "loading the reward model"

    def __init__(self, *, link: RewardLink, group: dist.ProcessGroup | None, build: Callable[[], RowScorer]) -> None:
        super().__init__(link)
        self.group = group
        self.build = build
        self.scorer: RowScorer | None = None
        self.round: tuple[Requests, list, list] | None = None  # the round being served: requests, rows, reports

    def setup(self) -> None:
        self.scorer = self.build()

    def next_command(self) -> tuple[str, Any]:
        """One round of rows from every global rank still running, and what every reward rank found:
        ``abort`` when a global rank aborted, ``stop`` when all stopped, else ``score``."""
        got = self.gather()
        rows = [row for c in sorted(got.rows) for row in got.rows[c]]
        error = self.error if self.scorer is None else None  # the model that failed to load
        if error is None and self.scorer is not None:
            try:
                self.scorer.check(rows)
            except Exception as e:  # noqa: BLE001
                error = f"{self.where}: {_describe(e)}"
        reports = all_gather_objects((len(rows), error, got.aborted, got.stopped), self.group)
        self.round = (got, rows, reports)
        aborted = {c: m for _, _, a, _ in reports for c, m in a.items()}
        if aborted:
            return ABORT, "; ".join(f"global rank {c}: {m}" for c, m in sorted(aborted.items()))
        if all(stopped for *_, stopped in reports):
            return STOP, None
        return "score", None

    def on_abort(self, error: str) -> None:
        assert self.round is not None
        self.drain(self.round[0], f"the run is stopping after an error on {error}")

    def handle(self, kind: str, payload: Any) -> None:
        if kind != "score":
            return super().handle(kind, payload)
        assert self.round is not None
        got, rows, reports = self.round
        errors = [err for _, err, _, _ in reports if err is not None]
        if errors:  # this rank's or another reward rank's: every global rank raises them
            self.error = self.error or "; ".join(errors)
            self.reply_error(got, "; ".join(errors))
            return
        assert self.scorer is not None
        most = max(n for n, *_ in reports)
        try:
            scores = self.scorer.score(rows, num_micro_batches=math.ceil(most / self.scorer.micro_batch_size))
        except Exception as e:  # noqa: BLE001 - the global ranks raise it
            log.exception("%s: scoring failed", self.where)
            message = f"{self.where}: {_describe(e)}"
            self.error = self.error or message
            self.reply_error(got, message)
            return
        self.reply(got, _by_client(got, scores))


def _by_client(got: Requests, scores: list[float]) -> dict[int, list[float]]:
    out, start = {}, 0
    for c in sorted(got.rows):
        n = len(got.rows[c])
        out[c] = scores[start:start + n]
        start += n
    return out


class RemoteModelReward:
    """The global ranks' side: rows to the reward pool, scores back (one round per call)."""

    def __init__(self, link: RewardLink) -> None:
        self.link = link

    def check(self, rows: Sequence[Sequence[int]]) -> None:
        """Nothing to check here: the reward ranks check the rows against their model."""

    def score(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """Every global rank calls this once per round; raises :class:`RewardError` naming the
        reward rank and its message when the reward pool failed."""
        try:
            return [float(s) for s in self.link.request(list(rows))]
        except RemoteFailure as e:
            raise RewardError(f"the reward model failed on the reward pool (answer from rank {e.rank}): "
                              f"{e.message}") from None

    def close(self, error: str | None = None) -> None:
        self.link.close(error)


__all__ = ["RemoteModelReward", "RewardLink", "RewardServer", "RowScorer"]
