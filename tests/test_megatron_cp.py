"""Context parallelism in the megatron engine (gloo, fp32), in one 4-process spawn:

* the cp attention alone (:func:`context_parallel_attention`, cp 2 on the groups {0, 1} and
  {2, 3}) equals full causal attention, forward and the gradients of q, k and v;
* log-probs of the batch from ``compute_logprobs`` with cp 2, cp 2 x tp 2 (+ sequence parallel)
  and cp 2 x pp 2 equal one Hugging Face process's, in sequence order;
* two GRPO updates with each of those layouts equal two updates in one plain Hugging Face process:
  summed loss of each update, gradient norms and the weights after both within 1e-5 relative.

In the parent process: the cp-1 chunked path (the two halves of one sequence, as
``bench/megatron_cp.py`` measures it) equals full causal attention, and the chunk columns are
megatron's load-balanced split. The batch and objective are ``test_megatron_parity``'s (padding
tokens inside responses, rows of different lengths, so some micro-batches leave a cp rank no
response position).

Run: ``python -m pytest tests/test_megatron_cp.py -q -s`` (``-s`` prints the differences).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from spmd_rl.config import ActorConfig, AlgoConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.testing import run_distributed
from support.numerics import max_rel, rel
from test_fsdp_parity import ACTOR, ALGO, MICRO, TEMPERATURE, TOL, micro_loss, response_logprobs
from test_megatron_parity import _engine, _reset, make_pad_batch, rank_rows, run_updates, tiny4_folder, tiny_moe_folder

pytest.importorskip("megatron.core")

LAYOUTS = {
    "cp2": dict(cp=2),
    "cp2xtp2_sp": dict(cp=2, tp=2, sequence_parallel=True),
    "cp2xpp2": dict(cp=2, pp=2),
}
MOE = {"cp2xep2": dict(cp=2, ep=2)}  # on the tiny Mixtral: experts over ep ranks, expert dp folds cp in
UPDATES = 2
WORLD = 4


def _qkv(seq: int, *, heads: int = 4, groups: int = 2, batch: int = 2, dim: int = 8) -> list[torch.Tensor]:
    """q, k, v and the weights of a linear loss on the output, in float64 (the check is structural:
    the chunked path must equal full attention to rounding, 1e-6 leaves no room for a wrong mask)."""
    g = torch.Generator().manual_seed(7)
    shapes = [(seq, batch, heads, dim), (seq, batch, groups, dim), (seq, batch, groups, dim), (seq, batch, heads * dim)]
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s, b, h, d = q.shape
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         scale=d ** -0.5, enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _attention_check(rank: int) -> dict[str, float]:
    """cp 2 attention over {0, 1} / {2, 3} against full attention: output, dq, dk, dv (max abs diff)."""
    from spmd_rl.engine.megatron.context import chunk_columns, context_parallel_attention

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every rank makes both
    group = groups[rank // 2]
    width = 24  # chunks of 6
    q, k, v, w = _qkv(width)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _full_attention(*full)
    (want * w).sum().backward()
    cols = chunk_columns(width, 2, dist.get_rank(group))
    mine = [t[cols].clone().requires_grad_() for t in (q, k, v)]
    got = context_parallel_attention(*mine, group=group, scale=q.shape[-1] ** -0.5)
    (got * w[cols]).sum().backward()  # the sum over both ranks is the full loss
    out = {"out": (got - want[cols]).abs().max().item()}
    for name, a, b in zip(("dq", "dk", "dv"), mine, full):
        out[name] = (a.grad - b.grad[cols]).abs().max().item()
    return out


def reference_updates(folder: str, batch: RolloutBatch) -> dict[str, Any]:
    """``UPDATES`` updates of the whole batch in one process (as ``test_fsdp_parity.reference_update``)."""
    from spmd_rl.models import load_causal_lm

    actor, algo = ActorConfig(**ACTOR), AlgoConfig(**ALGO)
    model = load_causal_lm(folder, dtype=torch.float32)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=actor.lr, betas=actor.betas, weight_decay=actor.weight_decay,
                                  foreach=False)
    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))
    with torch.no_grad():
        logprobs = torch.cat([response_logprobs(model, m)[0] for m in batch.split(MICRO)]) * batch["response_mask"]
    losses, norms = [], []
    for _ in range(UPDATES):
        loss = torch.zeros((), dtype=torch.float64)
        for micro in batch.split(MICRO):
            logp, entropy = response_logprobs(model, micro)
            part, _ = micro_loss(logp, entropy, micro, algo=algo, global_tokens=tokens, global_seqs=seqs)
            part.backward()
            loss += part.detach().double()
        norms.append(torch.nn.utils.clip_grad_norm_(params, actor.grad_clip, foreach=False).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, grad_norms=norms, logprobs=logprobs,
                weights={n: p.detach().clone() for n, p in model.named_parameters()})


def _updates(folder: str, batch: RolloutBatch, layout_kw: dict) -> dict[str, Any]:
    """Log-probs, then ``UPDATES`` updates with this rank's rows (as ``Trainer.update``)."""
    algo = AlgoConfig(**ALGO)
    engine, layout = _engine(folder, layout_kw)
    logprobs, _ = engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=MICRO)
    mine, weight = rank_rows(batch, layout)
    losses, norms = run_updates(engine, mine, algo=algo, weight=weight, updates=UPDATES)
    weights = {n: t.numpy().copy() for n, t in engine.named_full_tensors()}
    _reset()
    return dict(losses=losses, grad_norms=norms, weights=weights, logprobs=logprobs.numpy().copy())


def _world_body(rank: int, world_size: int, folder: str, moe_folder: str, batch: RolloutBatch) -> dict[str, Any]:
    import time

    start = time.perf_counter()
    out: dict[str, Any] = {"attention": _attention_check(rank)}
    out.update({name: _updates(folder, batch, kw) for name, kw in LAYOUTS.items()})
    out.update({name: _updates(moe_folder, batch, kw) for name, kw in MOE.items()})
    out["seconds"] = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def folder() -> str:
    return tiny4_folder()


@pytest.fixture(scope="module")
def batch(folder: str) -> RolloutBatch:
    return make_pad_batch(folder)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    return tiny_moe_folder(str(tmp_path_factory.mktemp("tiny-mixtral")))


@pytest.fixture(scope="module")
def world(folder: str, moe_folder: str, batch: RolloutBatch) -> list[dict[str, Any]]:
    results = run_distributed(_world_body, WORLD, folder, moe_folder, batch)
    print(f"\ncp world: {max(r['seconds'] for r in results):.1f} s in the 4 processes")
    return results


@pytest.fixture(scope="module")
def reference(folder: str, batch: RolloutBatch) -> dict[str, Any]:
    return reference_updates(folder, batch)


def test_chunk_columns_and_one_rank_chunked_attention() -> None:
    """megatron's split (rank r: chunks r and 2cp-1-r); with cp 1 the chunked path is plain causal."""
    from spmd_rl.engine.megatron.context import chunk_columns, context_parallel_attention

    assert chunk_columns(8, 2, 0).tolist() == [0, 1, 6, 7] and chunk_columns(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_columns(4, 1, 0).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"row of 10 tokens must be a multiple of 2 \* cp = 4"):
        chunk_columns(10, 2, 0)
    q, k, v, w = _qkv(20)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    (_full_attention(*full) * w).sum().backward()
    got = context_parallel_attention(*mine, group=None, scale=q.shape[-1] ** -0.5)
    assert (got - _full_attention(q, k, v)).abs().max().item() <= 1e-6
    (got * w).sum().backward()
    for a, b in zip(mine, full):
        assert (a.grad - b.grad).abs().max().item() <= 1e-6


def test_cp_attention_matches_full_attention(world) -> None:
    for rank, result in enumerate(world):
        print(f"\ncp2 attention@rank{rank}: max abs diff " + ", ".join(f"{k} {v:.1e}" for k, v in result["attention"].items()))
        assert all(v <= 1e-6 for v in result["attention"].values()), (rank, result["attention"])


@pytest.fixture(scope="module")
def moe_reference(moe_folder: str, batch: RolloutBatch) -> dict[str, Any]:
    return reference_updates(moe_folder, batch)


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(MOE))
def test_cp_updates_match_single_process(layout: str, world, request) -> None:
    reference = request.getfixturevalue("moe_reference" if layout in MOE else "reference")
    for rank, result in enumerate(world):
        got = result[layout]
        logprob_diff = (torch.as_tensor(got["logprobs"]) - reference["logprobs"]).abs().max().item()
        diffs = {f"loss{i + 1}": rel(a, b) for i, (a, b) in enumerate(zip(got["losses"], reference["losses"]))}
        diffs.update({f"grad_norm{i + 1}": rel(a, b) for i, (a, b) in enumerate(zip(got["grad_norms"], reference["grad_norms"]))})
        weights, where = max_rel(got["weights"], reference["weights"])
        diffs["weights"] = weights
        print(f"\n{layout}@rank{rank}: losses {got['losses']} vs {reference['losses']}; max |logp diff| "
              f"{logprob_diff:.1e}; relative " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()) + f" ({where})")
        assert logprob_diff <= 1e-5, (layout, rank, logprob_diff)
        assert all(v <= TOL for v in diffs.values()), (layout, rank, diffs)
