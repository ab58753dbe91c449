"""Pure tests of the parallel layouts, pool carving and ``plan()``: no process group, any world size.

Run: ``python -m pytest tests/test_dims.py -q``.
"""

from __future__ import annotations

import itertools

import pytest

from spmd_rl.config import (ActorConfig, Config, DataConfig, FsdpConfig, MegatronConfig, PoolsConfig, RewardConfig,
                            RewardModelConfig, RolloutConfig)
from spmd_rl.distributed.dims import FsdpLayout, MegatronLayout, RolloutLayout, UlyssesLayout
from spmd_rl.plan import plan
from spmd_rl.distributed.pools import PoolSpec, get_spec, gpu_of, member_of, plan_pools, pool_size

SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_axes(lay, families: list[tuple[str, ...]]) -> None:
    """Every axis's groups partition the pool; within a group the axis coordinate runs 0..len-1
    in rank order and the other coordinates of the same family are equal."""
    groups = lay.groups()
    coords = [lay.coords(r) for r in range(lay.size)]
    for family in families:
        for axis in family:
            seen = sorted(r for g in groups[axis] for r in g)
            assert seen == list(range(lay.size)), axis
            assert groups[axis] == sorted(groups[axis], key=lambda g: g[0])
            for g in groups[axis]:
                assert g == sorted(g)
                assert [coords[r][axis] for r in g] == list(range(len(g))), (axis, g)
                for other in family:
                    if other != axis:
                        assert len({coords[r][other] for r in g}) == 1, (axis, other, g)


# --------------------------------------------------------------------------- FSDP / HSDP


def test_fsdp_hsdp_example() -> None:
    lay = FsdpLayout(8, 4)
    assert lay.hsdp_enabled and lay.ddp_size == 2
    assert lay.groups() == {"fsdp": [[0, 1, 2, 3], [4, 5, 6, 7]], "ddp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert lay.mesh_dim_names == ("ddp", "fsdp") and lay.mesh_shape == (2, 4)
    assert lay.coords(6) == {"ddp": 1, "fsdp": 2}


def test_fsdp_whole_pool_is_1d() -> None:
    for fsdp_size in (-1, 8):
        lay = FsdpLayout(8, fsdp_size)
        assert lay.fsdp_size == 8 and not lay.hsdp_enabled
        assert lay.mesh_dim_names == ("fsdp",) and lay.mesh_shape == (8,)
        assert lay.groups()["fsdp"] == [list(range(8))]
        assert lay.groups()["ddp"] == [[r] for r in range(8)]
    assert FsdpLayout(8, -1) == FsdpLayout(8, 8)


@pytest.mark.parametrize("size", SIZES)
def test_fsdp_all_divisors(size: int) -> None:
    for f in divisors(size):
        lay = FsdpLayout(size, f)
        for r in range(size):
            c = lay.coords(r)
            assert r == c["ddp"] * f + c["fsdp"]
        check_axes(lay, [("ddp", "fsdp")])


@pytest.mark.parametrize(("size", "fsdp_size", "match"), [
    (8, 3, r"actor\.fsdp\.fsdp_size \(3\) does not divide the global pool size \(8\)"),
    (6, 4, r"actor\.fsdp\.fsdp_size \(4\) does not divide the global pool size \(6\)"),
    (4, 8, r"actor\.fsdp\.fsdp_size \(8\) does not divide the global pool size \(4\)"),
    (4, 0, r"actor\.fsdp\.fsdp_size must be -1 or >= 1, got 0"),
    (0, -1, r"the global pool size must be >= 1, got 0"),
])
def test_fsdp_errors(size: int, fsdp_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FsdpLayout(size, fsdp_size)


def test_coords_outside_pool() -> None:
    with pytest.raises(ValueError, match=r"rank 8 is outside the global pool of size 8"):
        FsdpLayout(8).coords(8)


# --------------------------------------------------------------------------- Ulysses


def test_ulysses_example() -> None:
    lay = UlyssesLayout(8, 2)
    assert lay.sp_enabled and lay.dp_size == 4
    assert lay.groups() == {"sp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]]}
    assert lay.coords(5) == {"dp": 2, "sp": 1}
    assert not UlyssesLayout(8, 1).sp_enabled


@pytest.mark.parametrize("size", SIZES)
def test_ulysses_all_divisors(size: int) -> None:
    for sp in divisors(size):
        lay = UlyssesLayout(size, sp)
        assert all(r == lay.coords(r)["dp"] * sp + lay.coords(r)["sp"] for r in range(size))
        check_axes(lay, [("dp", "sp")])


@pytest.mark.parametrize(("size", "sp", "match"), [
    (8, 3, r"actor\.fsdp\.ulysses_size \(3\) does not divide the global pool size \(8\)"),
    (4, 8, r"actor\.fsdp\.ulysses_size \(8\) does not divide the global pool size \(4\)"),
    (4, 0, r"actor\.fsdp\.ulysses_size must be >= 1, got 0"),
])
def test_ulysses_errors(size: int, sp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UlyssesLayout(size, sp)


# --------------------------------------------------------------------------- rollout


def test_rollout_example() -> None:
    lay = RolloutLayout(8, tp=2, pp=2)
    assert lay.dp_size == 2 and lay.tp_enabled and lay.pp_enabled
    assert lay.groups()["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups()["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups()["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups()["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.coords(6) == {"dp": 1, "pp": 1, "tp": 0}


@pytest.mark.parametrize("size", SIZES)
def test_rollout_all_degrees(size: int) -> None:
    for tp, pp in itertools.product(divisors(size), repeat=2):
        if size % (tp * pp):
            with pytest.raises(ValueError, match=rf"rollout\.tp \({tp}\) \* rollout\.pp \({pp}\) does not divide"):
                RolloutLayout(size, tp, pp)
            continue
        lay = RolloutLayout(size, tp, pp)
        for r in range(size):
            c = lay.coords(r)
            assert r == (c["dp"] * pp + c["pp"]) * tp + c["tp"]
        check_axes(lay, [("dp", "pp", "tp")])
        for g in lay.groups()["mp"]:  # one replica = one dp index
            assert len({lay.coords(r)["dp"] for r in g}) == 1 and len(g) == tp * pp


def test_rollout_error_message() -> None:
    with pytest.raises(ValueError, match=r"^rollout\.tp \(4\) \* rollout\.pp \(1\) does not divide the global pool size \(6\)$"):
        RolloutLayout(6, tp=4, pp=1)


# --------------------------------------------------------------------------- Megatron


def test_megatron_tp2_dp4() -> None:
    lay = MegatronLayout(8, tp=2)
    assert lay.dp_size == 4
    c = lay.coords(5)
    assert (c["tp"], c["dp"], c["pp"], c["cp"]) == (1, 2, 0, 0)
    assert lay.groups()["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups()["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_megatron_tp2_pp2_dp4() -> None:
    lay = MegatronLayout(16, tp=2, pp=2)
    assert lay.dp_size == 4 and lay.pp_enabled
    c = lay.coords(5)
    assert (c["tp"], c["dp"], c["pp"]) == (1, 2, 0)
    assert lay.groups()["pp"] == [[r, r + 8] for r in range(8)]
    assert lay.groups()["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert lay.coords(13)["pp"] == 1


def test_megatron_moe_tp2_ep4_edp2() -> None:
    lay = MegatronLayout(16, tp=2, ep=4)
    assert lay.etp == 2 and lay.expert_dp_size == 2 and lay.dp_size == 8
    g = lay.groups()
    assert g["expert_tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["expert_dp"] == [[r, r + 8] for r in range(8)]
    assert g["dp"] == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert lay.coords(11) == {"tp": 1, "cp": 0, "dp": 5, "pp": 0, "ep": 1, "expert_tp": 1, "expert_dp": 1}


def test_megatron_cp_groups() -> None:
    lay = MegatronLayout(8, tp=2, cp=2)
    g = lay.groups()
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("size", [1, 2, 4, 8, 12, 16])
def test_megatron_many_degrees(size: int) -> None:
    ds = divisors(size)
    for tp, pp, cp, ep in itertools.product(ds, ds, ds, [1, 2, 4]):
        try:
            lay = MegatronLayout(size, tp=tp, pp=pp, cp=cp, ep=ep)
        except ValueError:
            assert size % (tp * pp * cp) or size % (tp * ep * pp)
            continue
        check_axes(lay, [("tp", "cp", "dp", "pp"), ("expert_tp", "ep", "expert_dp", "pp")])


@pytest.mark.parametrize(("kw", "match"), [
    (dict(size=6, tp=4), r"actor\.megatron\.tp \(4\) \* actor\.megatron\.pp \(1\) \* actor\.megatron\.cp \(1\) = 4 "
                         r"does not divide the global pool size \(6\)"),
    (dict(size=16, tp=2, pp=2, cp=3), r"= 12 does not divide the global pool size \(16\)"),
    (dict(size=12, tp=2, ep=4), r"actor\.megatron\.etp \(2, = actor\.megatron\.tp\) \* actor\.megatron\.ep \(4\) \* "
                                r"actor\.megatron\.pp \(1\) = 8 does not divide the global pool size \(12\)"),
    (dict(size=8, tp=1, etp=4, ep=4), r"actor\.megatron\.etp \(4\) \* actor\.megatron\.ep \(4\) .* = 16"),
    (dict(size=8, vpp=2), r"actor\.megatron\.vpp \(2\) > 1 needs actor\.megatron\.pp > 1, got 1"),
    (dict(size=8, order="tp-cp-ep-dp-xx"), r"actor\.megatron\.order must name each of tp, cp, ep, dp, pp"),
    (dict(size=8, order="tp-tp-dp"), r"actor\.megatron\.order must name each"),
    (dict(size=8, tp=2, order="dp-pp"), r"actor\.megatron\.order \('dp-pp'\) leaves out tp, but actor\.megatron\.tp is 2"),
    (dict(size=8, order="tp-pp"), r"leaves out dp, but the data-parallel size is 8"),
    (dict(size=16, tp=2, pp=2, ep=4, order="tp-cp-ep-pp-dp"),
     r"does not end with pp, so dense and expert layers need the same data-parallel size, .* = 4 and .* = 1"),
    (dict(size=8, tp=2, pp=2, ep=2, etp=1, order="tp-pp-cp-ep-dp"), r"different pipeline groups"),
    (dict(size=8, ep=0), r"actor\.megatron\.ep must be >= 1, got 0"),
])
def test_megatron_errors(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MegatronLayout(**kw)


def test_megatron_partial_order_and_vpp() -> None:
    lay = MegatronLayout(8, tp=2, pp=4, vpp=2, order="tp-pp-dp")
    assert lay.vpp_enabled and lay.groups()["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


# --------------------------------------------------------------------------- pools


def test_pools_default_and_reward() -> None:
    assert plan_pools(8) == [PoolSpec("global", 0, 8)]
    specs = plan_pools(4, reward_ranks=1)
    assert specs == [PoolSpec("global", 0, 3), PoolSpec("reward", 3, 1)]
    g, r = specs
    assert g.contains(2) and not g.contains(3) and r.contains(3)
    assert r.local_rank(3) == 0 and g.local_rank(2) == 2 and r.global_rank(0) == 3
    assert g.ranks == [0, 1, 2] and r.end == 4
    assert member_of(specs, 3) == ["reward"] and member_of(specs, 0) == ["global"]
    with pytest.raises(ValueError, match=r"global rank 3 is not in pool 'global' \(global ranks 0\.\.2\)"):
        g.local_rank(3)
    with pytest.raises(ValueError, match=r"no pool named 'rollout'; pools of this run: global, reward"):
        get_spec(specs, "rollout")


def test_pools_in_world_order() -> None:
    """global, rollout, teacher, reward: contiguous, in that order, whichever are asked for."""
    specs = plan_pools(16, rollout_ranks=4, teacher_ranks=2, reward_ranks=2)
    assert specs == [PoolSpec("global", 0, 8), PoolSpec("rollout", 8, 4), PoolSpec("teacher", 12, 2),
                     PoolSpec("reward", 14, 2)]
    assert plan_pools(4, teacher_ranks=1) == [PoolSpec("global", 0, 3), PoolSpec("teacher", 3, 1)]


def test_pool_fractions_follow_the_world() -> None:
    """A fraction in (0, 1) is a share of the world (floor, at least 1): one flag plans every world an
    elastic run restarts at; a world too small for it is refused naming the new size."""
    assert [s.size for s in plan_pools(8, rollout_ranks=0.5)] == [4, 4]
    assert [s.size for s in plan_pools(4, rollout_ranks=0.5)] == [2, 2]
    assert [s.size for s in plan_pools(3, rollout_ranks=0.5)] == [2, 1]
    assert [s.size for s in plan_pools(8, rollout_ranks=0.25, reward_ranks=0.125)] == [5, 2, 1]
    assert [s.size for s in plan_pools(3, reward_ranks=0.1)] == [2, 1]  # at least one rank
    assert pool_size(2, 16, "rollout") == 2 and pool_size(0, 16, "rollout") == 0
    with pytest.raises(ValueError, match=r"pools\.rollout_ranks \(0\.5: 1 of 1\) must be smaller than the world "
                                         r"size \(1\)"):
        plan_pools(1, rollout_ranks=0.5)
    with pytest.raises(ValueError, match=r"pools\.teacher_ranks must be a count \(0, 1, 2, \.\.\.\) or a fraction "
                                         r"of the world in \(0, 1\), got 1\.5"):
        plan_pools(8, teacher_ranks=1.5)


def test_pool_fractions_from_the_command_line() -> None:
    from spmd_rl.config import load_config

    assert load_config(["--pools.rollout-ranks", "0.5"]).pools.rollout_ranks == 0.5
    assert type(load_config(["--pools.reward-ranks", "2"]).pools.reward_ranks) is int
    with pytest.raises(ValueError, match=r"pools\.rollout_ranks must be a count .* got -0\.5"):
        load_config(["--pools.rollout-ranks", "-0.5"])


def test_gpu_of_colocated_processes() -> None:
    """K processes per GPU: local ranks 0..G-1 on GPUs 0..G-1, then again."""
    assert [gpu_of(r, 8, 2) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [gpu_of(r, 4, 1) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"pools\.colocate \(3\) must divide the processes per node \(8\)"):
        gpu_of(0, 8, 3)


@pytest.mark.parametrize(("world", "n"), [(4, 4), (4, 5), (1, 1)])
def test_pools_reward_too_big(world: int, n: int) -> None:
    with pytest.raises(ValueError, match=rf"pools\.reward_ranks \({n}\) must be smaller than the world size \({world}\)"):
        plan_pools(world, reward_ranks=n)


# --------------------------------------------------------------------------- plan


def make_cfg(*, train: int = 8, mini: int = 8, fsdp_size: int = -1, sp: int = 1, rtp: int = 1, rpp: int = 1,
             engine: str = "fsdp", reward: int = 0, **mega: int) -> Config:
    return Config(
        data=DataConfig(train_batch_size=train),
        rollout=RolloutConfig(tp=rtp, pp=rpp, backend="vllm" if rtp * rpp > 1 else "native"),  # native: tp = pp = 1
        actor=ActorConfig(engine=engine, ppo_mini_batch_size=mini,
                          fsdp=FsdpConfig(fsdp_size=fsdp_size, ulysses_size=sp), megatron=MegatronConfig(**mega)),
        pools=PoolsConfig(reward_ranks=reward),
        reward=RewardConfig(model=RewardModelConfig(path="tiny-random-rm" if reward else None)),
    )


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_plan_defaults(world: int) -> None:
    p = plan(make_cfg(), world)
    assert p.dp_size == world and p.rollout_dp_size == world
    assert p.fsdp == FsdpLayout(world) and p.megatron == MegatronLayout(world) and p.reward_fsdp is None
    assert p.node(0) is None and p.unavailable == {}


def test_plan_nodes_and_reward_pool() -> None:
    p = plan(make_cfg(train=6, mini=6, fsdp_size=3, sp=3, reward=2), 8, nproc_per_node=4)
    assert p.pools == (PoolSpec("global", 0, 6), PoolSpec("reward", 6, 2))
    assert p.fsdp == FsdpLayout(6, 3) and p.ulysses == UlyssesLayout(6, 3) and p.reward_fsdp == FsdpLayout(2, pool="reward")
    assert p.dp_size == 2 and p.rollout_dp_size == 6
    assert [p.node(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [p.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert p.num_nodes == 2 and p.member_of(7) == ["reward"]
    assert [p.dp_rank(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert set(p.layouts()) == {"fsdp", "ulysses", "megatron", "rollout", "reward.fsdp"}
    with pytest.raises(ValueError, match=r"nproc_per_node \(3\) must be >= 1 and divide the world size \(8\)"):
        plan(make_cfg(), 8, nproc_per_node=3)


def test_plan_megatron_engine() -> None:
    p = plan(make_cfg(train=16, mini=8, engine="megatron", tp=2, pp=2), 16, nproc_per_node=8)
    assert p.dp_size == 4 and p.megatron == MegatronLayout(16, tp=2, pp=2)
    assert [p.dp_rank(r) for r in (0, 5, 8, 15)] == [0, 2, 0, 3]
    with pytest.raises(ValueError, match=r"actor\.megatron\.tp \(4\) \* .* = 4 does not divide the global pool size \(6\)"):
        plan(make_cfg(train=6, mini=6, engine="megatron", tp=4), 6)


def test_plan_inactive_engine_is_na() -> None:
    p = plan(make_cfg(train=6, mini=6, tp=4), 6)
    assert p.megatron is None and "does not divide the global pool size (6)" in p.unavailable["megatron"]
    q = plan(make_cfg(train=8, mini=8, engine="megatron", fsdp_size=3), 8)
    assert q.fsdp is None and "actor.fsdp.fsdp_size (3)" in q.unavailable["fsdp"]
    with pytest.raises(ValueError, match=r"actor\.fsdp\.fsdp_size \(3\) does not divide the global pool size \(8\)"):
        plan(make_cfg(fsdp_size=3), 8)
    with pytest.raises(ValueError, match=r"pools\.reward_ranks \(8\) must be smaller than the world size \(8\)"):
        plan(make_cfg(reward=8), 8)


@pytest.mark.parametrize(("cfg_kw", "world", "match"), [
    (dict(train=4, mini=4), 8,
     r"data\.train_batch_size \(4\) must be divisible by the rollout data-parallel size \(8\) = global pool size \(8\) "
     r"/ \(rollout\.tp \(1\) \* rollout\.pp \(1\)\)"),
    (dict(train=3, mini=3, rtp=2, rpp=2), 8, r"data\.train_batch_size \(3\) must be divisible by the rollout data-parallel size \(2\)"),
    (dict(train=4, mini=4, rtp=4), 8,
     r"data\.train_batch_size \(4\) must be divisible by the actor data-parallel size \(8\) = global pool size \(8\) "
     r"/ actor\.fsdp\.ulysses_size \(1\)"),
    (dict(train=16, mini=4, rtp=8), 8,
     r"actor\.ppo_mini_batch_size \(4\) must be divisible by the actor data-parallel size \(8\) .* so that all "
     r"rollout\.n \(4\) responses of a prompt stay on one rank"),
    (dict(train=8, mini=2, sp=2, rtp=2), 8, r"actor\.ppo_mini_batch_size \(2\) must be divisible by the actor data-parallel size \(4\)"),
    (dict(train=8, mini=2, engine="megatron", tp=2, rtp=2), 8,
     r"actor\.ppo_mini_batch_size \(2\) must be divisible by the actor data-parallel size \(4\) = global pool size \(8\) "
     r"/ \(actor\.megatron\.tp \(2\) \* actor\.megatron\.pp \(1\) \* actor\.megatron\.cp \(1\)\)"),
    (dict(train=2, mini=2, reward=2), 5,
     r"data\.train_batch_size \(2\) must be divisible by the rollout data-parallel size \(3\) = global pool size \(3\)"),
])
def test_plan_batch_rules(cfg_kw: dict, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(make_cfg(**cfg_kw), world)


def test_plan_rollout_replica_rules() -> None:
    cfg = make_cfg(train=2, mini=2, sp=4, rtp=4)  # one replica of tp 4 on 4 ranks
    cfg.rollout.n = 3
    with pytest.raises(ValueError, match=r"data\.train_batch_size \(2\) / rollout data-parallel size \(1\) \* "
                                         r"rollout\.n \(3\) = 6 responses per rollout replica must be divisible by "
                                         r"rollout\.tp \(4\) \* rollout\.pp \(1\)"):
        plan(cfg, 4)
    cfg.rollout.n = 2
    assert plan(cfg, 4).rollout_dp_size == 1  # 4 rows: one per rank
    cfg = make_cfg(train=2, mini=2, sp=8, rtp=4, rpp=2)
    cfg.rollout.n = 3
    with pytest.raises(ValueError, match=r"= 6 responses per rollout replica must be divisible by rollout\.tp \(4\) "
                                         r"\* rollout\.pp \(2\)"):
        plan(cfg, 8)
    vllm = make_cfg(train=6, mini=6, reward=2)
    vllm.rollout.backend = "vllm"
    assert plan(vllm, 8).rollout_pool.ranks == list(range(6))  # vLLM confined to the global pool


def test_plan_batch_rules_pass() -> None:
    assert plan(make_cfg(train=8, mini=4, sp=2, rtp=2), 8).actor_prompts_per_mini_batch == 1
    p = plan(make_cfg(train=8, mini=4, engine="megatron", tp=2, rtp=2), 8)
    assert p.dp_size == 4 and p.rollout_prompts_per_replica == 2
