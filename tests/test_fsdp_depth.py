"""FSDP engine in depth: Ulysses sequence parallel, Ulysses + HSDP, packed sequences and token-budget
micro-batches each give the same GRPO update as one plain process; plus their error messages,
the packing helpers, and one end-to-end run with Ulysses + packing.

The parent process builds a fixed GRPO batch (ragged prompts and responses, PPO clipping, KL and
entropy terms, gradient clipping on) and runs the update on a plain Hugging Face model with
transformers' stock SDPA and left/right padding: micro-batch losses divided by the batch's token
and sequence counts, backward, clip, one AdamW step. One spawned 4-process gloo world then runs
every case of CASES through ``FSDPEngine`` (a fresh engine per case), each dp rank holding its
contiguous rows, with the global counts all-reduced once per dp group (sp rank 0 only), as
``Trainer.update`` does. Compared, relative (fp32): the loss summed over micro-batches and dp
groups, the gradient norm, the updated weights and the weight change.

Why Ulysses gradients are exact: see ``spmd_rl/engine/ulysses.py`` (every sp rank computes the
same loss from all-gathered log-probs; the gather's backward keeps only the local slice, and FSDP
sums over all pool ranks). The ``ulysses2*`` cases are the proof.

Run: ``python -m pytest tests/test_fsdp_depth.py -q -s`` (``-s`` prints the measured differences).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spmd_rl.algo.objective import actor_objective
from spmd_rl.config import ActorConfig, AlgoConfig, FsdpConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.dims import FsdpLayout, UlyssesLayout
from spmd_rl.distributed.testing import run_distributed
from support.numerics import max_rel, rel
from spmd_rl.engine import packing
from spmd_rl.engine.fsdp import FSDPEngine
from spmd_rl.engine.ulysses import check_heads
from spmd_rl.models import load_causal_lm, resolve_model_path

ROWS, RESPONSE_LEN, MICRO = 16, 12, 2
TEMPERATURE, PAD, TOL = 0.8, 0, 1e-5
ACTOR = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, grad_clip=0.5)
ALGO = dict(clip_low=0.2, clip_high=0.28, use_kl_loss=True, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)
BUDGET = 28  # tokens per GPU for the dynamic cases; the longest row has 25
# name -> (ulysses_size, fsdp_size, use_packing, max_tokens_per_gpu); all on 4 ranks
CASES = {
    "ulysses2": (2, -1, False, None),
    "ulysses2+hsdp2x2": (2, 2, False, None),
    "packed": (1, -1, True, None),
    "dynamic": (1, -1, False, BUDGET),
    "ulysses2+packed+dynamic": (2, -1, True, BUDGET // 2),
}


def tiny_folder() -> str:
    return resolve_model_path("tiny-random", cache_dir=None)  # $SPMD_RL_CACHE (conftest)


# --------------------------------------------------------------------------- the single-process reference


def response_logprobs(model: torch.nn.Module, micro: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = micro.model_inputs(PAD)
    logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                   position_ids=inputs.position_ids).logits.float()
    p, t = inputs.prompt_width, inputs.response_len
    logp_all = torch.log_softmax(logits[:, p - 1:p + t - 1] / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, micro["response_ids"][..., None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def make_batch(folder: str) -> RolloutBatch:
    g = torch.Generator().manual_seed(4321)
    prompt_lens = torch.randint(3, 14, (ROWS // 2,), generator=g).tolist()
    prompt_lens[0] = 13
    prompts = [torch.randint(3, 104, (n,), generator=g).tolist() for n in prompt_lens]
    lengths = torch.randint(1, RESPONSE_LEN + 1, (ROWS,), generator=g)
    lengths[0], lengths[13] = RESPONSE_LEN, 1  # longest row 25 tokens; ranks get different totals
    mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).float()
    ids = torch.where(mask.bool(), torch.randint(3, 104, (ROWS, RESPONSE_LEN), generator=g), PAD)
    batch = RolloutBatch(prompts=[prompts[i // 2] for i in range(ROWS)],
                         tensors={"response_ids": ids, "response_mask": mask, "group_index": torch.arange(ROWS) // 2})
    with torch.no_grad():
        own, _ = response_logprobs(load_causal_lm(folder, dtype=torch.float32), batch)
    batch["advantages"] = torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE_LEN) * mask
    batch["old_logprobs"] = (own + 0.3 * torch.randn(own.shape, generator=g)) * mask
    batch["ref_logprobs"] = (own + 0.5 * torch.randn(own.shape, generator=g)) * mask
    return batch


def micro_loss(logprobs, entropy, micro, *, global_tokens: float, global_seqs: float):
    return actor_objective(
        logprobs, entropy, old_logprobs=micro["old_logprobs"], advantages=micro["advantages"],
        response_mask=micro["response_mask"], ref_logprobs=micro["ref_logprobs"], algo=AlgoConfig(**ALGO),
        global_tokens=global_tokens, global_seqs=global_seqs)


def reference_update(folder: str, batch: RolloutBatch) -> dict[str, Any]:
    actor = ActorConfig(**ACTOR)
    model = load_causal_lm(folder, dtype=torch.float32)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=actor.lr, betas=actor.betas, weight_decay=actor.weight_decay, foreach=False)
    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))
    loss = 0.0
    for micro in batch.split(MICRO):
        part, _ = micro_loss(*response_logprobs(model, micro), micro, global_tokens=tokens, global_seqs=seqs)
        part.backward()
        loss += part.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, actor.grad_clip, foreach=False).item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    model.eval()
    with torch.no_grad():
        logprobs, _ = response_logprobs(load_causal_lm(folder, dtype=torch.float32), batch)
    return dict(loss=loss, grad_norm=grad_norm, grads=grads, before=before, logprobs=logprobs * batch["response_mask"],
                weights={n: p.detach().clone() for n, p in model.named_parameters()})


# --------------------------------------------------------------------------- the 4-process world


def _case(folder: str, batch: RolloutBatch, *, sp: int, fsdp_size: int, packed: bool, budget: int | None,
          with_logprobs: bool) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = FsdpLayout(world, fsdp_size).build("cpu")
    ulysses = UlyssesLayout(world, sp)
    sp_mesh = ulysses.build("cpu") if ulysses.sp_enabled else None
    engine = FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(fsdp_size=fsdp_size),
                        actor=ActorConfig(**ACTOR), total_updates=1, trainable=True, pad_token_id=PAD,
                        group=None, sp_group=sp_mesh["sp"].get_group() if sp_mesh is not None else None,
                        use_packing=packed, max_tokens_per_gpu=budget)
    out: dict[str, Any] = {}
    if with_logprobs:  # every rank the whole batch: the forward of old / reference log-probs
        out["logprobs"] = engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=MICRO)[0].numpy()
    coords = ulysses.coords(rank)
    share = len(batch) // ulysses.dp_size
    mine = batch.select(range(coords["dp"] * share, (coords["dp"] + 1) * share))
    weight = 1.0 if coords["sp"] == 0 else 0.0  # the sp ranks of a dp group hold the same rows
    counts = torch.tensor([mine["response_mask"].sum().item(), float(len(mine))], dtype=torch.float64) * weight
    dist.all_reduce(counts)
    tokens, seqs = counts.tolist()
    losses: list[float] = []

    def loss_fn(logprobs, entropy, micro):
        loss, metrics = micro_loss(logprobs, entropy, micro, global_tokens=tokens, global_seqs=seqs)
        losses.append(loss.item())
        return loss, metrics

    micro_batches = engine.micro_batches(mine, micro_batch_size=MICRO)
    stats = engine.train_mini_batch(micro_batches, loss_fn, temperature=TEMPERATURE, need_entropy_grad=True)
    loss = torch.tensor(sum(losses) * weight, dtype=torch.float64)
    dist.all_reduce(loss)
    counts_seen = [None] * world
    own_need = packing.min_micro_batches(packing.row_tokens(mine), budget * sp) if budget else len(micro_batches)
    dist.all_gather_object(counts_seen, (len(micro_batches), own_need, max(len(m) for m in micro_batches)))
    grads = {n: p.grad.full_tensor().numpy() for n, p in engine.model.named_parameters()}  # clipped, as stepped
    weights = {n: t.numpy().copy() for n, t in engine.named_full_tensors()}
    out.update(loss=loss.item(), grad_norm=stats["grad_norm"], grads=grads, weights=weights, micro_batches=counts_seen)
    return out


def _world_body(rank: int, world_size: int, folder: str, batch: RolloutBatch) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (sp, fsdp_size, packed, budget) in CASES.items():
        results[name] = _case(folder, batch, sp=sp, fsdp_size=fsdp_size, packed=packed, budget=budget,
                              with_logprobs=name == "ulysses2+packed+dynamic")
    # a Ulysses degree that does not divide the heads fails on every rank, before any collective
    sp4 = UlyssesLayout(world_size, 4).build("cpu")["sp"].get_group()
    try:
        FSDPEngine(model_folder=folder, mesh=FsdpLayout(world_size).build("cpu"), device=torch.device("cpu"),
                   fsdp=FsdpConfig(ulysses_size=4), trainable=False, pad_token_id=PAD, sp_group=sp4)
        results["heads_error"] = None
    except ValueError as e:
        results["heads_error"] = str(e)
    return results if rank == 0 else {}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def folder() -> str:
    return tiny_folder()


@pytest.fixture(scope="module")
def batch(folder: str) -> RolloutBatch:
    return make_batch(folder)


@pytest.fixture(scope="module")
def reference(folder: str, batch: RolloutBatch) -> dict[str, Any]:
    return reference_update(folder, batch)


@pytest.fixture(scope="module")
def world4(folder: str, batch: RolloutBatch) -> dict[str, Any]:
    return run_distributed(_world_body, 4, folder, batch)[0]




# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", list(CASES))
def test_update_matches_single_process(case: str, world4: dict[str, Any], reference: dict[str, Any]) -> None:
    got = world4[case]
    delta = {n: torch.as_tensor(got["weights"][n]) - reference["before"][n] for n in reference["before"]}
    ref_delta = {n: reference["weights"][n] - reference["before"][n] for n in reference["before"]}
    diffs = {
        "loss": (rel(got["loss"], reference["loss"]), ""),
        "grad_norm": (rel(got["grad_norm"], reference["grad_norm"]), ""),
        "grads": max_rel(got["grads"], reference["grads"]),
        "weights": max_rel(got["weights"], reference["weights"]),
    }
    # AdamW's first step is lr * g / (|g| + eps): on entries whose gradient is near zero it turns
    # summation-order noise into visible update differences, so the change gets a looser bound.
    change = max_rel(delta, ref_delta)
    print(f"\n{case} (micro-batches, own need, largest per rank: {got['micro_batches']}): loss {got['loss']:.8f} vs "
          f"{reference['loss']:.8f}, grad_norm {got['grad_norm']:.6f} vs {reference['grad_norm']:.6f}; max relative "
          "diff " + ", ".join(f"{k} {v:.2e}{f' ({n})' if n else ''}" for k, (v, n) in {**diffs, "weight_change": change}.items()))
    bad = {k: v for k, v in diffs.items() if not v[0] <= TOL}
    assert change[0] <= 1e-3, f"{case}: weight change differs by {change}"
    assert not bad, f"{case} differs from the single-process update beyond {TOL}: {bad}"
    assert reference["grad_norm"] > ACTOR["grad_clip"], "gradient clipping should be active"
    assert len({c for c, _, _ in got["micro_batches"]}) == 1, "every rank must run the same number of micro-batches"


def test_dynamic_micro_batches_take_the_largest_count(world4: dict[str, Any]) -> None:
    """Ranks with fewer tokens needed fewer micro-batches, yet all ran the maximum, within the budget."""
    for case in ("dynamic", "ulysses2+packed+dynamic"):
        counts = world4[case]["micro_batches"]
        assert len({need for _, need, _ in counts}) > 1, f"{case}: the batch should give ranks different needs"
        assert all(count == max(need for _, need, _ in counts) for count, _, _ in counts), counts
    assert world4["dynamic"]["micro_batches"][0][0] > 1


def test_ulysses_packed_logprobs_match_padded_forward(world4: dict[str, Any], reference: dict[str, Any]) -> None:
    diff = (torch.as_tensor(world4["ulysses2+packed+dynamic"]["logprobs"]) - reference["logprobs"]).abs().max().item()
    print(f"\nUlysses 2 + packed + dynamic compute_logprobs vs padded single-process forward: max abs diff {diff:.2e}")
    assert diff < 1e-5


# --------------------------------------------------------------------------- one gather per pass


def _gather_once_body(rank: int, world_size: int, folder: str, batch: RolloutBatch) -> dict[str, Any]:
    """[ddp 2, fsdp 1]: shards of one rank. Two engines, FSDP's per-layer gathers and one gather per
    pass, each take two updates with a log-prob pass before and after; returns both runs, and
    whether layer 0's weights were still gathered while the last layer ran (and after the pass)."""
    from torch.distributed.tensor import DTensor

    mesh = FsdpLayout(world_size, 1).build("cpu")
    mine = batch.select(range(rank * len(batch) // 2, (rank + 1) * len(batch) // 2))
    counts = torch.tensor([mine["response_mask"].sum().item(), float(len(mine))], dtype=torch.float64)
    dist.all_reduce(counts)
    tokens, seqs = counts.tolist()
    runs: dict[str, Any] = {}
    for once in (False, True):
        engine = FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(fsdp_size=1, gather_once=once),
                            actor=ActorConfig(**ACTOR), total_updates=2, trainable=True, pad_token_id=PAD)
        first, last = engine.model.model.layers[0], engine.model.model.layers[-1]
        seen: list[bool] = []  # layer 0's weight is a plain tensor (gathered) while the last layer runs
        hook = last.register_forward_pre_hook(lambda *_: seen.append(not isinstance(first.mlp.up_proj.weight, DTensor)))
        root: list[bool] = []  # the root's own parameter is still gathered when a micro-batch's forward starts
        norm = engine.model.model.norm
        root_hook = engine.model.register_forward_pre_hook(lambda *_: root.append(not isinstance(norm.weight, DTensor)),
                                                           prepend=True)  # before FSDP's own gather

        def loss_fn(logprobs, entropy, micro):
            return micro_loss(logprobs, entropy, micro, global_tokens=tokens, global_seqs=seqs)

        out: dict[str, Any] = {"logprobs": [], "grad_norm": []}
        for _ in range(2):
            out["logprobs"].append(engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=MICRO)[0])
            root.append(None)  # a pass ends
            stats = engine.train_mini_batch(engine.micro_batches(mine, micro_batch_size=MICRO), loss_fn,
                                            temperature=TEMPERATURE, need_entropy_grad=True)
            root.append(None)
            out["grad_norm"].append(stats["grad_norm"])
        out["logprobs"].append(engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=MICRO)[0])
        root.append(None)
        hook.remove()
        root_hook.remove()
        out.update(enabled=engine.gather_once, gathered_during=seen, root_kept=root,
                   sharded_after=all(isinstance(p, DTensor) for p in engine.model.parameters()),
                   weights={n: t.clone() for n, t in engine.named_full_tensors()})
        runs["once" if once else "per_layer"] = out
    return runs if rank == 0 else {}


def test_gather_once_on_one_rank_shards_equals_per_layer_gathers(folder: str, batch: RolloutBatch) -> None:
    """Shards of one rank gather once per pass (no per-layer copies), and the result is the same to
    the bit: log-probs before, between and after two updates, gradient norms and weights. A stale
    gathered copy after an optimizer step would show in the second update and the last log-probs."""
    (runs,) = run_distributed(_gather_once_body, 2, folder, batch)[:1]
    once, per_layer = runs["once"], runs["per_layer"]
    assert once["enabled"] and not per_layer["enabled"]
    micro = len(batch) // MICRO
    assert once["gathered_during"] == [True] * len(once["gathered_during"]), "layer 0 was resharded mid-pass"
    assert per_layer["gathered_during"] == [False] * len(per_layer["gathered_during"]) and len(per_layer["gathered_during"]) >= 3 * micro
    # per pass: the first micro-batch gathers the root, the others find it gathered (none with per-layer gathers)
    def passes(seen: list) -> list[list[bool]]:
        out, cur = [], []
        for x in seen:
            if x is None:
                out.append(cur)
                cur = []
            else:
                cur.append(x)
        return out

    assert len(passes(once["root_kept"])) == 5 and all(len(p) >= 2 for p in passes(once["root_kept"]))
    assert all(p[0] is False and all(p[1:]) for p in passes(once["root_kept"])), once["root_kept"]
    assert not any(x for p in passes(per_layer["root_kept"]) for x in p)
    assert once["sharded_after"] and per_layer["sharded_after"], "a pass must end with every module resharded"
    assert once["grad_norm"] == per_layer["grad_norm"]
    for a, b in zip(once["logprobs"], per_layer["logprobs"]):
        assert torch.equal(a, b)
    assert not torch.equal(once["logprobs"][0], once["logprobs"][2]), "the updates should move the log-probs"
    for name, w in per_layer["weights"].items():
        assert torch.equal(once["weights"][name], w), name


# --------------------------------------------------------------------------- errors


def test_heads_not_divisible_message() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(ValueError, match=re.escape(
            "actor.fsdp.ulysses_size (4) must divide num_attention_heads (9) and num_key_value_heads (3)")):
        check_heads(config, 4)
    check_heads(config, 3)


def test_engine_refuses_ulysses_that_splits_kv_heads(world4: dict[str, Any]) -> None:
    assert world4["heads_error"] is not None, "FSDPEngine accepted ulysses 4 with 2 KV heads"
    assert "actor.fsdp.ulysses_size (4) must divide num_attention_heads (4) and num_key_value_heads (2)" in world4["heads_error"]


# --------------------------------------------------------------------------- packing helpers


def test_packed_layout_restarts_positions_and_predicts_every_response_token(batch: RolloutBatch) -> None:
    micro = batch.select(range(6))
    flat = packing.flatten(micro, pad_token_id=PAD, packed=True, multiple=2)
    lengths = packing.row_tokens(micro)
    assert flat.width % 2 == 0 and flat.width >= max(lengths)
    assert flat.input_ids.shape[0] < len(micro), "several sequences should share a row"
    assert int((flat.segment_ids >= 0).sum()) == sum(lengths), "no padding inside the packed tokens"
    for b in range(len(micro)):
        n = int(micro["response_mask"][b].sum())
        r, c = flat.target_rows[b, :n], flat.target_cols[b, :n]
        assert torch.equal(flat.labels[r, c], micro["response_ids"][b, :n])  # the logits at (r, c) predict token t
        start = int(c[0]) - len(micro.prompts[b]) + 1
        assert flat.position_ids[r[0], start] == 0 and flat.position_ids[r[0], int(c[-1]) + 1] == len(micro.prompts[b]) + n - 1


def _packed_by_sequence(micro: RolloutBatch, pad: int, multiple: int) -> dict[str, torch.Tensor]:
    """The packed layout written one sequence at a time (the test's oracle for the vectorised one)."""
    resp = micro["response_mask"].sum(1).long().tolist()
    lengths = [len(p) + n for p, n in zip(micro.prompts, resp)]
    width = -(-max(lengths) // multiple) * multiple
    bins = packing.first_fit_decreasing(lengths, width)
    rows, t = micro["response_ids"].shape
    out = {"input_ids": torch.full((len(bins), width), pad), "position_ids": torch.zeros(len(bins), width, dtype=torch.long),
           "segment_ids": torch.full((len(bins), width), -1), "target_rows": torch.zeros(rows, t, dtype=torch.long),
           "target_cols": torch.zeros(rows, t, dtype=torch.long)}
    for r, members in enumerate(bins):
        col = 0
        for s, i in enumerate(members):
            p, n = len(micro.prompts[i]), resp[i]
            out["input_ids"][r, col:col + p + n] = torch.tensor(micro.prompts[i] + micro["response_ids"][i, :n].tolist())
            out["position_ids"][r, col:col + p + n] = torch.arange(p + n)
            out["segment_ids"][r, col:col + p + n] = s
            out["target_rows"][i, :n] = r
            out["target_cols"][i, :n] = torch.arange(n) + col + p - 1
            col += p + n
    return out


@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_layout_equals_the_sequence_by_sequence_layout(batch: RolloutBatch, multiple: int) -> None:
    g = torch.Generator().manual_seed(multiple)
    rows = 40
    prompts = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (rows,), generator=g)]
    lengths = torch.randint(0, 17, (rows,), generator=g)  # a response may be empty
    mask = (torch.arange(16)[None] < lengths[:, None]).float()
    micro = RolloutBatch(prompts=prompts, tensors={"response_ids": torch.randint(3, 100, (rows, 16), generator=g) * mask.long(),
                                                   "response_mask": mask})
    for m in (micro, batch):
        flat = packing.flatten(m, pad_token_id=PAD, packed=True, multiple=multiple)
        for name, want in _packed_by_sequence(m, PAD, multiple).items():
            assert torch.equal(getattr(flat, name), want), name
        assert torch.equal(flat.labels[:, :-1], flat.input_ids[:, 1:])


def test_balanced_partition_and_budget() -> None:
    lengths = [25, 4, 9, 17, 12, 6, 20, 3]
    groups = packing.balanced_partition(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(8)) and all(g == sorted(g) for g in groups)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lengths) // 2
    count = packing.min_micro_batches(lengths, 40)
    assert count == 3 and all(sum(lengths[i] for i in g) <= 40 for g in packing.balanced_partition(lengths, count))
    assert packing.min_micro_batches([50, 5], 40) == 2  # an over-long row goes alone
    assert packing.micro_batch_rows(lengths, micro_batch_size=3, max_tokens=None, group=None) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert packing.first_fit_decreasing([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]


# --------------------------------------------------------------------------- end to end


def test_ulysses_packing_trains_end_to_end(tmp_path) -> None:
    from test_train_e2e import _check, launch, read_metrics

    out = str(tmp_path / "run")
    proc = launch(out, "--trainer.total-steps", "3", "--actor.fsdp.ulysses-size", "2", "--actor.use-packing",
                    "--algo.kl-coef", "0.01")
    _check(proc)
    steps = [m for m in read_metrics(out) if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert all(isinstance(v, (int, float)) and v == v for v in m.values()), m  # no NaN
        assert m["actor/kl_loss"] >= 0 and m["actor/grad_norm"] > 0
