"""MegatronLayout against megatron-core's own rank generation, for many layouts and orders.

Needs megatron-core (pure Python for this use; in the ``test`` extra, skipped without it):
``pip install megatron-core==0.16.1``. Run: ``python -m pytest tests/test_megatron_ranks.py -q``.

``reference()`` forms the groups the way ``megatron.core.parallel_state.initialize_model_parallel``
does (one ``RankGenerator`` for dense layers with ep=1, one for expert layers with cp=1, and the
same checks), so no process group or GPU is needed.
"""

from __future__ import annotations

import itertools
import random
import warnings

import pytest

from spmd_rl.distributed.dims import MegatronLayout

with warnings.catch_warnings():  # megatron-core warns that Transformer Engine / Apex are absent
    warnings.simplefilter("ignore")
    RankGenerator = pytest.importorskip(
        "megatron.core.parallel_state", reason="needs megatron-core (in the test extra: pip install -e '.[test]')"
    ).RankGenerator

ORDERS = [
    "tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-dp-pp", "pp-tp-cp-ep-dp", "dp-tp-cp-ep-pp", "cp-ep-tp-dp-pp",
]

# our axis -> (generator, megatron-core token), as initialize_model_parallel builds its groups
TOKENS = {
    "tp": ("dense", "tp"), "cp": ("dense", "cp"), "pp": ("dense", "pp"), "dp": ("dense", "dp"),
    "dp_cp": ("dense", "dp-cp"), "mp": ("dense", "tp-pp"),
    "ep": ("expert", "ep"), "expert_tp": ("expert", "tp"), "expert_dp": ("expert", "dp"),
}


def reference(world: int, tp: int, pp: int, cp: int, ep: int, etp: int | None, order: str) -> dict[str, list[list[int]]]:
    """megatron-core's groups per axis; raises wherever initialize_model_parallel would refuse."""
    if world % (tp * pp * cp):
        raise RuntimeError("world_size is not divisible by tp * pp * cp")
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order, rank_offset=0)
    etp = tp if etp is None else etp
    if world % (etp * ep * pp):
        raise RuntimeError("world_size is not divisible by etp * ep * pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order, rank_offset=0)
    if not (order.endswith("pp") or pp == 1 or expert.dp == dense.dp):
        raise AssertionError("dense and expert data-parallel sizes differ without pp last")
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise AssertionError("dense and expert pipeline groups differ")
    gens = {"dense": dense, "expert": expert}
    return {axis: gens[gen].get_ranks(token) for axis, (gen, token) in TOKENS.items()}


def layouts(count: int = 3000) -> list[tuple[int, int, int, int, int, int | None, str]]:
    """A fixed random sample of (world, tp, pp, cp, ep, etp, order), valid and invalid ones."""
    out = []
    for world in (1, 2, 4, 6, 8, 12, 16, 24, 32):
        ds = sorted({d for d in (1, 2, 4, 8) if world % d == 0} | {3})  # 3 also makes invalid layouts
        for tp, pp, cp in itertools.product(ds, repeat=3):
            if tp * pp * cp > 2 * world:
                continue
            for ep, etp, order in itertools.product((1, 2, 4), (None, 1, 2), ORDERS):
                if etp != tp:
                    out.append((world, tp, pp, cp, ep, etp, order))
    return random.Random(0).sample(out, count)


CASES = layouts()


def normalise(groups: list[list[int]]) -> list[list[int]]:
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def test_case_count() -> None:
    assert len(set(CASES)) == 3000


@pytest.mark.parametrize("chunk", range(4))
def test_groups_and_coords_match_megatron_core(chunk: int) -> None:
    valid = invalid = 0
    for world, tp, pp, cp, ep, etp, order in CASES[chunk::4]:
        case = f"world={world} tp={tp} pp={pp} cp={cp} ep={ep} etp={etp} order={order}"
        try:
            ref = reference(world, tp, pp, cp, ep, etp, order)
        except (RuntimeError, AssertionError):
            with pytest.raises(ValueError, match=r"actor\.megatron\."):
                MegatronLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
            invalid += 1
            continue
        lay = MegatronLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
        ours = lay.groups()
        for axis, groups in ref.items():
            assert ours[axis] == normalise(groups), f"{case}: axis {axis}"
        for r in range(world):
            c = lay.coords(r)
            for axis in ("tp", "cp", "dp", "pp", "ep", "expert_tp", "expert_dp"):
                group = next(g for g in ref[axis] if r in g)
                assert c[axis] == group.index(r), f"{case}: rank {r} axis {axis}"
        valid += 1
    assert valid > 100 and invalid > 100


def test_examples_from_megatron_docstring() -> None:
    # parallel_state's own example: 16 ranks, tp=2, pp=4, dp=2 (order tp-cp-ep-dp-pp)
    lay = MegatronLayout(16, tp=2, pp=4)
    assert lay.groups()["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.groups()["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.groups()["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
