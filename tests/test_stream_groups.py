"""The controller's side of ``rollout.stream`` (spmd_rl/rollout/pool_stream.py), in process on 3 gloo
ranks: 2 actor ranks and 1 rollout rank that sends groups in a chosen completion order.

The step takes the first ``count`` complete groups in the order they arrived, drops one more than S
versions old (the controller issues its prompt again as a new round, and every actor rank learns of
it), lays the taken groups out sorted by (round, position), and each
actor rank receives exactly its data-parallel share of their rows. A failure on the rollout rank
reaches every actor rank, not the controller alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.distributed.bridge import settle
from spmd_rl.distributed.comm import RemoteFailure
from spmd_rl.distributed.dims import RolloutLayout
from spmd_rl.distributed.pools import PoolSpec
from spmd_rl.distributed.testing import run_distributed
from spmd_rl.rollout.pool import RolloutLink, RolloutRoutes
from spmd_rl.rollout.pool_stream import GroupStream, StreamServer

N = 2
# (round, position, policy version of its tokens), in completion order; (1, 3) is 2 versions behind
SENT = [(2, 0, 1), (1, 3, 0), (1, 1, 1), (2, 1, 2), (1, 0, 1), (2, 2, 2)]


def tokens_of(round_: int, position: int, j: int) -> torch.Tensor:
    return torch.arange(3 + j) + 100 * round_ + 10 * position


def prompt_of(round_: int, position: int) -> list[int]:
    return [round_, position, 7]


def body(rank: int, world_size: int) -> dict:
    routes = RolloutRoutes(rollout=RolloutLayout(1, pool="rollout"), rollout_pool=PoolSpec("rollout", 2, 1),
                           actor_pool=PoolSpec("global", 0, 2), actor_dp=(0, 1))
    link = RolloutLink(routes=routes, bridge=None)
    actors = dist.new_group([0, 1])
    if rank == 2:
        server = StreamServer(link=link, engine=None, replica=0, sleep_level=0, max_prompt_length=8)
        issued = []
        for _ in range(2):  # rounds 1 and 2 into the stream
            kind, payload = server.receive()
            issued.append((kind, payload["round"], server.prompts_of(payload)))
        server.sampling, server.versions = {"n": N}, [0, 1, 2]
        for round_, position, version in SENT:
            rows = [(j, tokens_of(round_, position, j), -torch.rand(3 + j), torch.full((3 + j,), version), j == 0)
                    for j in range(N)]
            server.send_group(round_, position, rows)
        server.send_error("rollout rank 2: generation failed: boom")
        kind, payload = server.receive()  # the stale group's prompt, issued again
        issued.append((kind, payload["round"], server.prompts_of(payload)))
        settle(server.pending, block=True)
        return {"issued": issued}
    stream = GroupStream(link, pad_token_id=0)
    for round_, count in ((1, 4), (2, 3)):
        stream.issue([prompt_of(round_, i) for i in range(count)] if rank == 0 else None, {"n": N, "seed": round_},
                     round_=round_, num_prompts=count)
    taken = stream.take(count=4, policy_version=2, max_staleness=1, actor_group=actors)
    try:
        stream.take(count=2, policy_version=2, max_staleness=1, actor_group=actors)
        error = None
    except RemoteFailure as e:
        error = str(e)
    return {"taken": taken, "error": error, "last_round": stream.last_round}


def test_controller_takes_the_first_complete_groups_drops_stale_ones_and_lays_them_out() -> None:
    results = run_distributed(body, 3)
    for rank in (0, 1):
        t = results[rank]["taken"]
        assert t.groups == [(1, 0), (1, 1), (2, 0), (2, 1)]  # the first 4 fresh to arrive, sorted
        assert t.dropped == [(1, 3)] and t.reissued == [(3, [(1, 3)])]  # issued again as round 3, on every rank
        assert t.rows == ((0, 4) if rank == 0 else (4, 8))  # its data-parallel share of 4 groups x 2
        lengths = t.tensors["response_mask"].sum(1).long().tolist()
        for i, row in enumerate(range(*t.rows)):
            round_, position = t.groups[row // N]
            expected = tokens_of(round_, position, row % N)
            assert lengths[i] == len(expected)
            assert torch.equal(t.tensors["response_ids"][i, :lengths[i]], expected)
            assert bool(t.tensors["truncated"][i]) == (row % N == 0)
        assert results[rank]["error"] == "rank 2: rollout rank 2: generation failed: boom"
        assert results[rank]["last_round"] == 3
    assert results[2]["issued"] == [("stream", 1, [prompt_of(1, i) for i in range(4)]),
                                    ("stream", 2, [prompt_of(2, i) for i in range(3)]),
                                    ("stream", 3, [prompt_of(1, 3)])]  # only the controller sent it


def test_a_group_issued_again_can_complete_in_the_same_take() -> None:
    """The trainer's bookkeeping of streamed prompts: the controller drops a stale group and issues its
    prompt again as a new round; that round's group can complete and be taken before the take ends.
    Its prompt index is known then, and every taken or dropped group leaves the flight."""
    from spmd_rl.source import GroupsInFlight

    flight = GroupsInFlight()
    flight.add(1, [10, 11, 12])
    flight.add(2, [20, 21])
    # (1, 1) too stale: its prompt 11 issued again as round 3
    taken = flight.take(groups=[(1, 0), (2, 1), (3, 0)], dropped=[(1, 1)], reissued=[(3, [(1, 1)])])
    assert taken == [10, 21, 11]
    assert flight.rounds == {1: {2: 12}, 2: {0: 20}} and flight.outstanding == 2 and flight.next_round == 4
