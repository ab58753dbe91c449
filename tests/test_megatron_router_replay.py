"""MoE router replay (``--actor.router-replay``) in the megatron engine (gloo, fp32, CPU).

A tiny random Qwen3-MoE whose every layer is routed (4 layers of 8 experts, top 2: the megatron engine
converts no dense layers), with and without ``norm_topk_prob`` (megatron's two top-k paths); a batch of
rows with different prompt and response lengths, an environment token inside one response (context
mask: no record) and two micro-batches. Records are Hugging Face's own experts of every generated token
("own") or the two it ranks last ("forced"):

* with the own records, replay changes no log-prob (vs replay off), on 1 rank and on the 2-rank
  layouts tp 2 + sequence parallel, pp 2 x vpp 2, ep 2 and cp 2;
* the forced records are honoured: log-probs move away from replay off, and equal the FSDP engine's
  with the same records (:mod:`spmd_rl.engine.routing`, the reference), as does the gradient norm of an
  update through the replayed gate weights, on 1 rank and on every 2-rank layout;
* plan() accepts ``--actor.router-replay`` with ``--actor.engine megatron``, and a 2-step run of
  ``spmd_rl.train`` (tp 2 + sequence parallel) carries the records from the rollout to the actor.

Run: ``python -m pytest tests/test_megatron_router_replay.py -q -s`` (``-s`` prints the differences).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.testing import run_distributed
from test_router_replay import moe_folder

pytest.importorskip("megatron.core")

SHAPE = dict(num_hidden_layers=4, mlp_only_layers=[], num_key_value_heads=2)  # every layer routed; kv heads % tp
LAYERS, TOP_K = 4, 2
MICRO = 2  # two micro-batches of the 4 rows
LAYOUTS = {"tp2_sp": dict(tp=2, sequence_parallel=True), "pp2xvpp2": dict(pp=2, vpp=2), "ep2": dict(ep=2),
           "cp2": dict(cp=2)}
TOL = 1e-5  # fp32: the megatron engine's log-probs equal the FSDP engine's to ~1e-6 (test_megatron_parity)


def make_batch() -> RolloutBatch:
    gen = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0, 1.0, 0.0, 1.0, 1.0], [1.0] * 4 + [0.0]])
    ids = torch.randint(3, 40, (4, 5), generator=gen) * (mask > 0).long()  # the pad id (0) past each row's end
    ids[2, 2] = 20  # an environment token inside the response (context mask): no record, routed by own logits
    context = torch.zeros_like(mask)
    context[2, 2] = 1.0
    return RolloutBatch(prompts=prompts, tensors={"response_ids": ids, "response_mask": mask, "context_mask": context})


def make_routes(folder: str, batch: RolloutBatch, *, forced: bool) -> torch.Tensor:
    """``[B, T, layers, k]``: Hugging Face's own experts of each generated token (the response mask), or
    (``forced``) the experts its router ranks last; -1 elsewhere."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(folder).eval()
    b, t = batch["response_ids"].shape
    routes = torch.full((b, t, LAYERS, TOP_K), -1, dtype=torch.int16)
    for i, prompt in enumerate(batch.prompts):
        n = int(batch["response_mask"][i].nonzero().max()) + 1  # the row's last model token
        seq = prompt + batch["response_ids"][i, :n].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), output_router_logits=True).router_logits
        for j, lg in enumerate(logits):
            order = torch.softmax(lg.float(), -1).argsort(-1, descending=not forced)[:, :TOP_K]
            routes[i, :n, j] = order[len(prompt):].to(torch.int16)
        routes[i, batch["response_mask"][i] == 0] = -1
    return routes


def _loss(lp: torch.Tensor, ent: Any, micro: RolloutBatch) -> tuple[torch.Tensor, dict]:
    return -(lp * micro["response_mask"]).sum() / 16.0, {}


def _measure(engine: Any, batch: RolloutBatch, routes: dict[str, torch.Tensor], *, dp: int = 0, dp_size: int = 1,
             ) -> dict[str, Any]:
    """Log-probs of the whole batch with no records and with each set of records; the gradient norm of one
    update with the forced records on this data-parallel rank's rows (``dp`` of ``dp_size``: the ranks'
    gradients are summed; grad clip off, the step itself is not compared)."""
    def with_routes(name: str, rows: range) -> RolloutBatch:
        return RolloutBatch(batch.prompts, {**batch.tensors, "routed_experts": routes[name]}, batch.extras).select(rows)

    everything = range(len(batch))
    out: dict[str, Any] = {"off": engine.compute_logprobs(batch, temperature=1.0, micro_batch_size=MICRO)[0]}
    for name in routes:
        out[name] = engine.compute_logprobs(with_routes(name, everything), temperature=1.0, micro_batch_size=MICRO)[0]
    share = len(batch) // dp_size
    mine = with_routes("forced", range(dp * share, (dp + 1) * share))
    out["grad_norm"] = engine.train_mini_batch(engine.micro_batches(mine, micro_batch_size=MICRO), _loss,
                                               temperature=1.0, need_entropy_grad=False)["grad_norm"]
    return out


def _megatron(folder: str, layout_kw: dict) -> tuple[Any, dict[str, int]]:
    """The actor on ``layout_kw`` with router replay, and this rank's data-parallel place."""
    from support.megatron_cpu import install_megatron_cpu_shims

    install_megatron_cpu_shims()
    from spmd_rl.config import ActorConfig, MegatronConfig
    from spmd_rl.distributed.dims import MegatronLayout
    from spmd_rl.engine.megatron import MegatronEngine

    kw = dict(layout_kw)
    sp = kw.pop("sequence_parallel", False)
    layout = MegatronLayout(dist.get_world_size(), **kw)
    engine = MegatronEngine(model_folder=folder, device=torch.device("cpu"), layout=layout,
                            megatron=MegatronConfig(**kw, sequence_parallel=sp),
                            actor=ActorConfig(grad_clip=0.0, router_replay=True), trainable=True, pad_token_id=0,
                            seed=1)
    return engine, dict(dp=layout.coords(dist.get_rank())["dp"], dp_size=layout.dp_size)


def _one_rank_body(rank: int, world_size: int, folder: str, batch: RolloutBatch, routes: dict) -> dict[str, Any]:
    """The FSDP engine (the reference) and the megatron engine on one process."""
    from megatron.core import parallel_state as ps

    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    fsdp = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                      fsdp=FsdpConfig(), actor=ActorConfig(grad_clip=0.0, router_replay=True), trainable=True,
                      pad_token_id=0)
    out = {"fsdp": _measure(fsdp, batch, routes)}
    del fsdp
    engine, dp = _megatron(folder, {})
    out["megatron"] = _measure(engine, batch, routes, **dp)
    ps.destroy_model_parallel()
    return out


def _layouts_body(rank: int, world_size: int, folder: str, batch: RolloutBatch, routes: dict) -> dict[str, Any]:
    """Every layout of :data:`LAYOUTS` on the same 2-process world, one after the other; every rank
    feeds the whole batch (ep / dp ranks route their own copy)."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, kw in LAYOUTS.items():
        engine, dp = _megatron(folder, kw)
        out[name] = _measure(engine, batch, routes, **dp)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["softmax_topk", "renormalised"])
def setup(request, tmp_path_factory) -> tuple[str, RolloutBatch, dict[str, torch.Tensor]]:
    """Qwen3-MoE's two routers: the top-k of the softmax as it is (megatron's pre-softmax top-k: the gate
    weights are gathered probabilities) and renormalised (``norm_topk_prob``: megatron's softmax over the
    gathered logits)."""
    folder = moe_folder(tmp_path_factory.mktemp("models"), **SHAPE, norm_topk_prob=request.param)
    batch = make_batch()
    routes = {"own": make_routes(folder, batch, forced=False), "forced": make_routes(folder, batch, forced=True)}
    return folder, batch, routes


@pytest.fixture(scope="module")
def one_rank(setup) -> dict[str, Any]:
    return run_distributed(_one_rank_body, 1, *setup)[0]


@pytest.fixture(scope="module")
def two_ranks(setup) -> list[dict[str, Any]]:
    return run_distributed(_layouts_body, 2, *setup)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check(name: str, got: dict[str, Any], fsdp: dict[str, Any]) -> None:
    own, forced_vs_off = _diff(got["own"], got["off"]), _diff(got["forced"], got["off"])
    vs_fsdp, off_vs_fsdp = _diff(got["forced"], fsdp["forced"]), _diff(got["off"], fsdp["off"])
    norm = abs(got["grad_norm"] - fsdp["grad_norm"]) / fsdp["grad_norm"]
    print(f"\n{name}: own records vs off {own:.1e}; forced vs off {forced_vs_off:.3f}; forced vs FSDP forced "
          f"{vs_fsdp:.1e} (off vs FSDP off {off_vs_fsdp:.1e}); grad norm {got['grad_norm']:.6f} vs FSDP "
          f"{fsdp['grad_norm']:.6f} (rel {norm:.1e})")
    assert own <= 1e-6, f"{name}: replaying the model's own experts moved a log-prob by {own}"
    assert forced_vs_off > 1e-2, f"{name}: the forced experts changed nothing ({forced_vs_off})"
    assert vs_fsdp <= TOL and off_vs_fsdp <= TOL, (name, vs_fsdp, off_vs_fsdp)
    assert norm <= TOL, (name, got["grad_norm"], fsdp["grad_norm"])


def test_the_reference_honours_the_records(one_rank) -> None:
    """The FSDP engine: own records change nothing, forced ones move the log-probs (the test's premise)."""
    fsdp = one_rank["fsdp"]
    assert _diff(fsdp["own"], fsdp["off"]) <= 1e-6
    assert _diff(fsdp["forced"], fsdp["off"]) > 1e-2


def test_one_rank_replays_as_the_fsdp_engine(one_rank) -> None:
    _check("megatron 1 rank", one_rank["megatron"], one_rank["fsdp"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_replay_as_the_fsdp_engine(layout: str, one_rank, two_ranks) -> None:
    for rank, result in enumerate(two_ranks):
        _check(f"megatron {layout}@rank{rank}", result[layout], one_rank["fsdp"])


def test_plan_accepts_router_replay_with_the_megatron_engine() -> None:
    from spmd_rl.config import Config
    from spmd_rl.engine import ENGINES
    from spmd_rl.models.shape import ModelShape
    from spmd_rl.plan import plan

    assert ENGINES["megatron"].router_replay
    cfg = Config()
    cfg.actor.engine = "megatron"
    cfg.actor.router_replay = True
    plan(cfg, 2, model_shape=ModelShape("a model", heads=4, kv_heads=2, layers=2, experts=8))


def test_a_megatron_run_replays_the_recorded_experts(tmp_path) -> None:
    """``spmd_rl.train`` on 2 processes with tp 2 + sequence parallel and the built-in rollout: the rows carry
    the records to the megatron actor, which replays them in its log-prob and update forwards."""
    from test_train_e2e import _check, launch, read_metrics

    folder = moe_folder(tmp_path, tokenizer=True, mlp_only_layers=[], num_hidden_layers=2, num_key_value_heads=2)
    out = str(tmp_path / "run")
    _check(launch(out, "--model.path", folder, "--actor.router-replay", "--trainer.total-steps", "2",
                  "--rollout.max-new-tokens", "6", "--algo.rollout-is", "token", "--actor.engine", "megatron",
                  "--actor.megatron.tp", "2", "--actor.megatron.sequence-parallel", nproc=2,
                  module="support.megatron_cpu_train"))
    steps = [m for m in read_metrics(out) if "rollout_corr/kl" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # fp32 rollout and trainer on the CPU, the same experts: the two log-probs agree to rounding
    assert all(m["perf/router_replay_mb"] > 0 and abs(m["rollout_corr/kl"]) < 1e-5 for m in steps)
