"""The reward pool: its ranks serve reward-model scores to the global pool until training ends.

    # reward-pool ranks (spmd_rl.train dispatches by pool membership)
    code = serve_reward_pool(rm=cfg.reward.model, cache_dir=cfg.model.cache_dir, device=env.device,
                             exchange=groups.exchange, group=reward_pool.group, mesh=groups.reward_mesh)
    # = RewardServer(exchange=..., group=..., build=lambda: RewardModel(...)).serve(); 0 after a normal stop
    # global-pool ranks
    scores = RemoteModelReward(groups.exchange).score(rows)        # one float per row
    groups.exchange.close(error)                                   # stop, or abort with the error

Each round (one per scoring call of the trainer) every global rank sends its rows split over the
reward ranks (:class:`spmd_rl.distributed.comm.PoolExchange`); the reward ranks agree over their own
group on the largest row count (FSDP needs the same number of forwards on every rank) and on any
error, score, and answer each global rank with its rows' scores. Between rounds a reward rank waits
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
import socket
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmd_rl.config import RewardModelConfig
from spmd_rl.distributed.comm import Inbound, PoolExchange, RemoteFailure, all_gather_objects
from spmd_rl.reward.model import RewardModel, resolve_reward_model
from spmd_rl.reward.registry import RewardError

log = logging.getLogger("spmd_rl")


class RowScorer(Protocol):
    """What the server runs: :class:`spmd_rl.reward.model.RewardModel` or any object like it."""

    micro_batch_size: int

    def check(self, rows: Sequence[Sequence[int]]) -> None: ...

    def score(self, rows: Sequence[Sequence[int]], *, num_micro_batches: int) -> list[float]: ...


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class RewardServer:
    """The loop of a reward-pool rank (see the module docstring)."""

    def __init__(self, *, exchange: PoolExchange, group: dist.ProcessGroup | None,
                 build: Callable[[], RowScorer]) -> None:
        self.exchange = exchange
        self.group = group
        self.build = build
        self.rank = dist.get_rank()
        self.where = f"reward rank {self.rank} ({socket.gethostname()})"

    def serve(self) -> int:
        """Serve rounds until every global rank says stop (returns 0) or one aborts (returns 1).
        Returns 1 too when a round failed here or on another reward rank."""
        scorer: RowScorer | None = None
        setup_error: str | None = None
        try:
            scorer = self.build()
        except Exception as e:  # noqa: BLE001 - answered to the global pool at its first request
            setup_error = f"loading the reward model failed: {_describe(e)}"
            log.error("%s: %s", self.where, setup_error)
        failed = setup_error is not None
        while True:
            inbound = self.exchange.receive()
            clients = sorted(inbound.rows)
            rows = [row for c in clients for row in inbound.rows[c]]
            error = setup_error
            if error is None and scorer is not None:
                try:
                    scorer.check(rows)
                except Exception as e:  # noqa: BLE001
                    error = _describe(e)
            reports = all_gather_objects((self.where, len(rows), error, inbound.aborted, inbound.stopped), self.group)
            aborted = {c: m for _, _, _, a, _ in reports for c, m in a.items()}
            if aborted:
                why = "; ".join(f"global rank {c}: {m}" for c, m in sorted(aborted.items()))
                log.error("%s: stopping, the trainer failed (%s)", self.where, why)
                self._drain(inbound, f"the run is stopping after an error on {why}")
                return 1
            if all(stopped for *_, stopped in reports):
                return 1 if failed else 0
            errors = [f"{where}: {err}" for where, _, err, _, _ in reports if err is not None]
            if errors:
                failed = True
                self.exchange.reply_error(inbound, "; ".join(errors))
                continue
            assert scorer is not None
            most = max(n for _, n, *_ in reports)
            try:
                scores = scorer.score(rows, num_micro_batches=math.ceil(most / scorer.micro_batch_size))
            except Exception as e:  # noqa: BLE001 - the global ranks raise it
                failed = True
                log.exception("%s: scoring failed", self.where)
                self.exchange.reply_error(inbound, f"{self.where}: {_describe(e)}")
                continue
            self.exchange.reply(inbound, _by_client(inbound, clients, scores))

    def _drain(self, inbound: Inbound, message: str) -> None:
        """Answer this round's and any later rows with ``message`` until every global rank has
        stopped or aborted (or a receive fails: a global rank died, or the timeout passed)."""
        self.exchange.reply_error(inbound, message)
        while not self.exchange.all_done:
            try:
                inbound = self.exchange.receive(drain=True)
            except RuntimeError as e:
                log.warning("%s: stopped waiting for the global ranks: %s", self.where, e)
                return
            self.exchange.reply_error(inbound, message)


def _by_client(inbound: Inbound, clients: list[int], scores: list[float]) -> dict[int, list[float]]:
    out, start = {}, 0
    for c in clients:
        n = len(inbound.rows[c])
        out[c] = scores[start:start + n]
        start += n
    return out


def serve_reward_pool(*, rm: RewardModelConfig, cache_dir: str | None, device: torch.device, exchange: PoolExchange,
                      group: dist.ProcessGroup | None, mesh: DeviceMesh | None) -> int:
    """Load ``reward.model.path`` with FSDP over the reward pool's mesh and serve it; the exit code."""
    def build() -> RewardModel:
        if mesh is None:
            raise ValueError("this rank is not in the reward pool's FSDP mesh")
        return RewardModel(folder=resolve_reward_model(rm, cache_dir=cache_dir), mesh=mesh, device=device,
                           micro_batch_size=rm.micro_batch_size, param_offload=rm.param_offload,
                           trust_remote_code=rm.trust_remote_code)

    return RewardServer(exchange=exchange, group=group, build=build).serve()


class RemoteModelReward:
    """The global ranks' side: rows to the reward pool, scores back (one round per call)."""

    def __init__(self, exchange: PoolExchange) -> None:
        self.exchange = exchange

    def check(self, rows: Sequence[Sequence[int]]) -> None:
        """Nothing to check here: the reward ranks check the rows against their model."""

    def score(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """Every global rank calls this once per round; raises :class:`RewardError` naming the
        reward rank and its message when the reward pool failed."""
        try:
            return [float(s) for s in self.exchange.request(list(rows))]
        except RemoteFailure as e:
            raise RewardError(f"the reward model failed on the reward pool (answer from rank {e.rank}): "
                              f"{e.message}") from None

    def close(self, error: str | None = None) -> None:
        self.exchange.close(error)


__all__ = ["RemoteModelReward", "RewardServer", "RowScorer", "serve_reward_pool"]
