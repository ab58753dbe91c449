"""The teacher of on-policy distillation: a frozen model scoring the student's sampled tokens.

    teacher = Teacher.colocated(...)         # pools.teacher_ranks = 0: FSDP on the actor's mesh
    teacher = TeacherLink(...)               # pools.teacher_ranks > 0: the teacher pool's ranks score
    batch["teacher_logprobs"] = teacher.logprobs(batch, temperature=T)      # every actor rank, [B, T]

With ``algo.distill_coef > 0`` the actor's objective adds that coefficient times the per-token
reverse KL(student || teacher) on the sampled tokens (:func:`spmd_rl.algo.objective.actor_objective`),
logged as ``actor/distill_kl``. Teacher and student must share a tokenizer (:func:`check_tokenizers`).

On its own pool (the teacher role on the service protocol, :mod:`spmd_rl.distributed.service`), one
round per step: the controller (global rank 0) sends ``score`` to every teacher rank; each actor data-parallel group's rows go (as tensors, once per group) to the teacher
ranks in even shares; each teacher rank runs the frozen FSDP model over its share (the engine
agrees on the micro-batch count over the pool) and sends the log-probs back to every actor rank
that holds those rows. A teacher rank that fails answers with its error; the actor ranks raise it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.bridge import RowRoute, pack_prompts, recv_rows, send_rows, unpack_prompts
from spmd_rl.distributed.comm import split_even
from spmd_rl.distributed.pools import PoolSpec
from spmd_rl.distributed.service import ServiceLink, ServiceServer

ROW_SPEC = {"prompt_ids": (torch.long, 0), "prompt_lengths": (torch.long, 0), "response_ids": (torch.long, 0),
            "response_mask": (torch.float32, 0.0)}
LOGPROB_SPEC = {"logprobs": (torch.float32, 0.0)}


def check_tokenizers(student: Any, teacher: Any, *, student_path: str, teacher_path: str) -> None:
    """The teacher scores the student's token ids: both must map text to the same ids."""
    if student.get_vocab() != teacher.get_vocab():
        raise ValueError(f"the teacher ({teacher_path}, {len(teacher.get_vocab())} tokens) and the student "
                         f"({student_path}, {len(student.get_vocab())} tokens) have different tokenizers: on-policy "
                         f"distillation scores the student's token ids under the teacher, so both must share one")


def _pack(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    return {**pack_prompts(batch.prompts), "response_ids": batch["response_ids"],
            "response_mask": batch["response_mask"].float()}


def _unpack(t: dict[str, torch.Tensor]) -> RolloutBatch:
    return RolloutBatch(prompts=unpack_prompts(t), tensors={"response_ids": t["response_ids"],
                                                            "response_mask": t["response_mask"]})


@dataclass(frozen=True)
class TeacherRoutes:
    """Rows of one step between the actor pool (in its dp layout) and the teacher pool (even shares)."""

    actor_pool: PoolSpec
    teacher_pool: PoolSpec
    actor_dp: tuple[int, ...]

    def actor_ranges(self, num_rows: int) -> dict[int, tuple[int, int]]:
        size = num_rows // (max(self.actor_dp) + 1)
        return {self.actor_pool.start + k: (d * size, (d + 1) * size) for k, d in enumerate(self.actor_dp)}

    def teacher_ranges(self, num_rows: int) -> dict[int, tuple[int, int]]:
        out, start = {}, 0
        for k, part in enumerate(split_even(range(num_rows), self.teacher_pool.size)):
            out[self.teacher_pool.start + k] = (start, start + len(part))
            start += len(part)
        return out


class TeacherLink(ServiceLink):
    """One rank's end of the actor pool <-> teacher pool link (built on the ranks of both): the teacher
    role's client on :class:`~spmd_rl.distributed.service.ServiceLink`."""

    def __init__(self, *, routes: TeacherRoutes, close_timeout_s: float = 60.0) -> None:
        super().__init__(role="teacher", clients=routes.actor_pool.ranks, servers=routes.teacher_pool.ranks,
                         close_timeout_s=close_timeout_s)
        self.routes = routes

    def logprobs(self, batch: RolloutBatch, *, temperature: float, num_rows: int) -> torch.Tensor:
        """Actor side, every actor rank: the teacher's log-probs of this rank's rows ``[B, T]``;
        ``num_rows``: the step's rows over all actor dp groups."""
        self.command("score", {"num_rows": num_rows, "temperature": temperature})
        mine = self.routes.actor_ranges(num_rows)
        send_rows(RowRoute(sources=mine, dests=self.routes.teacher_ranges(num_rows)), _pack(batch),
                  first_row=mine[self.rank][0])
        back = recv_rows(RowRoute(sources=self.routes.teacher_ranges(num_rows), dests=mine), LOGPROB_SPEC)
        lp = back["logprobs"]
        width = batch["response_ids"].shape[1]
        return torch.nn.functional.pad(lp, (0, width - lp.shape[1])) if lp.shape[1] < width else lp[:, :width]


class TeacherServer(ServiceServer):
    """The loop of a teacher-pool rank (the teacher role's server on
    :class:`~spmd_rl.distributed.service.ServiceServer`): ``score`` rounds until ``stop`` or ``abort``."""

    def __init__(self, *, link: TeacherLink, build: Any, micro_batch_size: int) -> None:
        super().__init__(link)
        self.link: TeacherLink = link
        self.build, self.micro_batch_size = build, micro_batch_size
        self.engine: Any = None

    def setup(self) -> None:
        self.engine = self.build()

    def handle(self, kind: str, payload: Any) -> None:
        if kind != "score":
            return super().handle(kind, payload)
        routes, num_rows = self.link.routes, payload["num_rows"]
        mine = routes.teacher_ranges(num_rows)
        rows = recv_rows(RowRoute(sources=routes.actor_ranges(num_rows), dests=mine), ROW_SPEC)
        out: dict[str, torch.Tensor] = {}
        if self.error is None:
            try:
                lp, _ = self.engine.compute_logprobs(_unpack(rows), temperature=payload["temperature"],
                                                     micro_batch_size=self.micro_batch_size)
                out = {"logprobs": lp.float().cpu()}
            except Exception as e:  # noqa: BLE001 - the actor ranks raise it
                self.fail("scoring", e)
        send_rows(RowRoute(sources=mine, dests=routes.actor_ranges(num_rows)), out,
                  first_row=mine[self.link.rank][0], error=self.error)


__all__ = ["LOGPROB_SPEC", "ROW_SPEC", "TeacherLink", "TeacherRoutes", "TeacherServer", "check_tokenizers"]
