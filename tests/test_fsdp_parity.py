"""FSDP2 engine parity: one GRPO update on N gloo processes equals the same update in one process.

The parent test process builds a fixed GRPO batch (prompts and responses of different lengths,
masks, random advantages, old and reference log-probs) and runs the update on a plain Hugging Face
model (no FSDP): micro-batch losses from ``actor_objective`` with the batch's token and sequence
counts, backward, gradient clipping, one AdamW step. Spawned processes run the same update through
``FSDPEngine.train_mini_batch``, each rank holding its contiguous share of the rows, with the
global counts all-reduced over the pool as ``Trainer.update`` does. Compared (fp32, relative):
the loss summed over micro-batches and ranks, the returned gradient norm, the clipped gradients
and the updated weights (full tensors from ``named_full_tensors``) within 1e-5, and the weight
change within 1e-3 (see CHANGE_TOL for why it is looser).

One 4-process world checks FSDP 1D over all 4 ranks, HSDP 2x2 (``FsdpConfig(fsdp_size=2)``),
FSDP 1D on 2 processes — two independent 2-rank pools (ranks 0-1 and 2-3, meshes built with
``start``), each doing the whole update — and four one-rank engines (the plain module of
``spmd_rl/engine/mixed.py``, no FSDP); one 8-process world checks FSDP 1D over 8 ranks and HSDP
2x4 (two replicas of a 4-way shard). A
1-process world checks that the engine's ``compute_logprobs`` equals the native rollout's sampling
log-probs for the same tokens.

Run: ``python -m pytest tests/test_fsdp_parity.py -q -s`` (``-s`` prints the measured differences).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spmd_rl.algo.objective import actor_objective
from spmd_rl.config import ActorConfig, AlgoConfig, FsdpConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.dims import FsdpLayout
from spmd_rl.distributed.testing import run_distributed
from support.numerics import max_rel, rel
from spmd_rl.engine.fsdp import FSDPEngine
from spmd_rl.models import load_causal_lm, resolve_model_path

ROWS = 16  # 8 prompts x 2 responses; divides 1, 2 and 4 ranks
PROMPTS = ROWS // 2
RESPONSE_LEN = 12
MICRO = 2  # micro-batches per rank: 8 (1 process), 4 (2 ranks), 2 (4 ranks)
TEMPERATURE = 0.8
PAD = 0
TOL = 1e-5
# Adam's first step moves each weight by lr * g / (|g| + eps): for the few elements with |g| near eps
# (1e-8) it amplifies fp32 rounding, so the weight CHANGE of one tensor differs by ~5e-5 relative even
# between two single-process runs that only split the micro-batches differently. A missing, doubled or
# misplaced step on a shard would be off by ~1, and shows in the weights themselves at ~1e-2 (the
# change is ~5% of a weight's norm), so the weights keep TOL and the change gets this looser bound.
CHANGE_TOL = 1e-3
ACTOR = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, grad_clip=0.5)
ALGO = dict(clip_low=0.2, clip_high=0.28, use_kl_loss=True, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)
# name -> (pool size, fsdp_size); a pool smaller than the world is repeated over it
# Worlds of 4 and 8 processes, each checking its layouts in one spawn.
WORLDS = {
    4: {"fsdp1": (1, -1), "fsdp2": (2, -1), "fsdp4": (4, -1), "hsdp2x2": (4, 2)},
    8: {"fsdp8": (8, -1), "hsdp2x4": (8, 4)},
}
LAYOUTS = {name: world for world, layouts in WORLDS.items() for name in layouts}


def tiny_folder() -> str:
    return resolve_model_path("tiny-random", cache_dir=None)  # $SPMD_RL_CACHE (conftest)


# --------------------------------------------------------------------------- the single-process reference


def response_logprobs(model: torch.nn.Module, micro: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy ``[B, T]`` of the responses from a full forward (no ``logits_to_keep``)."""
    inputs = micro.model_inputs(PAD)
    logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                   position_ids=inputs.position_ids).logits.float()
    p, t = inputs.prompt_width, inputs.response_len
    logp_all = torch.log_softmax(logits[:, p - 1:p + t - 1] / TEMPERATURE, dim=-1)  # position i predicts i + 1
    logp = logp_all.gather(-1, micro["response_ids"][..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make_batch(folder: str) -> RolloutBatch:
    """Deterministic GRPO batch; old / ref log-probs are the model's own plus noise, so the PPO ratio
    clips on some tokens and the KL term is not zero."""
    g = torch.Generator().manual_seed(1234)
    prompt_lens = torch.randint(3, 14, (PROMPTS,), generator=g).tolist()
    prompts = [torch.randint(3, 104, (n,), generator=g).tolist() for n in prompt_lens]
    lengths = torch.randint(1, RESPONSE_LEN + 1, (ROWS,), generator=g)
    lengths[3] = RESPONSE_LEN
    mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).float()
    ids = torch.where(mask.bool(), torch.randint(3, 104, (ROWS, RESPONSE_LEN), generator=g), PAD)
    batch = RolloutBatch(prompts=[prompts[i // 2] for i in range(ROWS)],
                         tensors={"response_ids": ids, "response_mask": mask,
                                  "group_index": torch.arange(ROWS) // 2})
    model = load_causal_lm(folder, dtype=torch.float32)
    with torch.no_grad():
        own, _ = response_logprobs(model, batch)
    batch["advantages"] = torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE_LEN) * mask
    batch["old_logprobs"] = (own + 0.3 * torch.randn(own.shape, generator=g)) * mask
    batch["ref_logprobs"] = (own + 0.5 * torch.randn(own.shape, generator=g)) * mask
    return batch


def micro_loss(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: RolloutBatch, *,
               algo: AlgoConfig, global_tokens: float, global_seqs: float) -> tuple[torch.Tensor, dict]:
    return actor_objective(
        logprobs, entropy, old_logprobs=micro["old_logprobs"], advantages=micro["advantages"],
        response_mask=micro["response_mask"], ref_logprobs=micro["ref_logprobs"], algo=algo,
        global_tokens=global_tokens, global_seqs=global_seqs)


def reference_update(folder: str, batch: RolloutBatch) -> dict[str, Any]:
    actor, algo = ActorConfig(**ACTOR), AlgoConfig(**ALGO)
    model = load_causal_lm(folder, dtype=torch.float32)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=actor.lr, betas=actor.betas, weight_decay=actor.weight_decay,
                                  foreach=False)
    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))
    loss = torch.zeros((), dtype=torch.float64)
    clipped = 0.0
    for micro in batch.split(MICRO):
        logp, entropy = response_logprobs(model, micro)
        part, metrics = micro_loss(logp, entropy, micro, algo=algo, global_tokens=tokens, global_seqs=seqs)
        part.backward()
        loss += part.detach().double()
        clipped += metrics["actor/pg_clipfrac"].item() * micro["response_mask"].sum().item() / tokens
    grad_norm = torch.nn.utils.clip_grad_norm_(params, actor.grad_clip, foreach=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    return dict(loss=loss.item(), grad_norm=grad_norm.item(), grads=grads, before=before, clipfrac=clipped,
                weights={n: p.detach().clone() for n, p in model.named_parameters()})


# --------------------------------------------------------------------------- the distributed side


def engine_update(folder: str, batch: RolloutBatch, *, mesh: Any, group: Any, fsdp_size: int) -> dict[str, Any]:
    """One update through the engine on this rank's contiguous rows; collective over ``group``."""
    actor, algo = ActorConfig(**ACTOR), AlgoConfig(**ALGO)
    engine = FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"),
                        fsdp=FsdpConfig(fsdp_size=fsdp_size), actor=actor, total_updates=1, trainable=True,
                        pad_token_id=PAD)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share = len(batch) // size
    mine = batch.select(range(rank * share, (rank + 1) * share))
    # as Trainer.update: token and sequence counts of the whole data-parallel mini-batch
    counts = torch.tensor([mine["response_mask"].sum().item(), float(len(mine))], dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    global_tokens, global_seqs = counts.tolist()
    losses: list[torch.Tensor] = []

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, micro: RolloutBatch):
        loss, _ = micro_loss(logprobs, entropy, micro, algo=algo, global_tokens=global_tokens, global_seqs=global_seqs)
        losses.append(loss.detach().double())
        return loss, {}

    stats = engine.train_mini_batch(list(mine.split(MICRO)), loss_fn, temperature=TEMPERATURE,
                                    need_entropy_grad=True)
    loss = torch.stack(losses).sum()
    dist.all_reduce(loss, group=group)
    # clipped, as stepped; numpy because tensors returned through run_distributed's queue go by shared
    # memory, which is gone once the worker exits
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy()  # plain on one rank
             for n, p in engine.model.named_parameters()}
    weights = {n: t.numpy().copy() for n, t in engine.named_full_tensors()}
    return dict(loss=loss.item(), grad_norm=stats["grad_norm"], grads=grads, weights=weights,
                micro_batches=len(losses), rows=len(mine))


def _layouts_body(rank: int, world_size: int, folder: str, batch: RolloutBatch) -> dict[str, Any]:
    """Every layout of this world (WORLDS); every rank returns what it sees (under HSDP each
    replica gathers its own copy of the weights, so all ranks are compared, not only rank 0)."""
    out: dict[str, Any] = {}
    for name, (pool_size, fsdp_size) in WORLDS[world_size].items():
        starts = range(0, world_size, pool_size)
        # new_group and DeviceMesh construction are collective over the world: every rank makes all
        groups = [dist.new_group(list(range(s, s + pool_size))) for s in starts]
        meshes = [FsdpLayout(pool_size, fsdp_size).build("cpu", start=s) for s in starts]
        pool = rank // pool_size
        result = engine_update(folder, batch, mesh=meshes[pool], group=groups[pool], fsdp_size=fsdp_size)
        out[f"{name}@rank{rank}(pool {starts[pool]}-{starts[pool] + pool_size - 1})"] = result
    return out




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
def worlds(folder: str, batch: RolloutBatch) -> dict[int, dict[str, Any]]:
    """Results per world size, each world spawned once, on first use."""
    cache: dict[int, dict[str, Any]] = {}

    def get(world_size: int) -> dict[str, Any]:
        if world_size not in cache:
            cache[world_size] = {}
            for part in run_distributed(_layouts_body, world_size, folder, batch):
                cache[world_size].update(part)
        return cache[world_size]

    return get  # type: ignore[return-value]


def test_fixed_batch_exercises_the_objective(batch: RolloutBatch, reference: dict[str, Any]) -> None:
    """The batch is not degenerate: ragged prompts and responses, PPO clipping and gradient clipping on."""
    assert len({len(p) for p in batch.prompts}) > 3
    lengths = batch["response_mask"].sum(1)
    assert lengths.min() < lengths.max() == RESPONSE_LEN
    assert 0.05 < reference["clipfrac"] < 0.95, reference["clipfrac"]
    assert reference["grad_norm"] > ACTOR["grad_clip"], "gradient clipping should be active in the parity update"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_matches_single_process(layout: str, worlds, reference: dict[str, Any]) -> None:
    results = worlds(LAYOUTS[layout])
    runs = {k: v for k, v in results.items() if k.split("@")[0] == layout}
    assert runs, f"no result for {layout}: {sorted(results)}"
    for key, got in runs.items():
        deltas = {n: torch.as_tensor(got["weights"][n]) - reference["before"][n] for n in reference["before"]}
        ref_deltas = {n: reference["weights"][n] - reference["before"][n] for n in reference["before"]}
        diffs = {
            "loss": (rel(got["loss"], reference["loss"]), ""),
            "grad_norm": (rel(got["grad_norm"], reference["grad_norm"]), ""),
            "grads": max_rel(got["grads"], reference["grads"]),
            "weights": max_rel(got["weights"], reference["weights"]),
            "weight_change": max_rel(deltas, ref_deltas),
        }
        print(f"\n{key} ({got['rows']} rows x {got['micro_batches']} micro-batches per rank): loss "
              f"{got['loss']:.8f} vs {reference['loss']:.8f}, grad_norm {got['grad_norm']:.6f} vs "
              f"{reference['grad_norm']:.6f}; max relative diff "
              + ", ".join(f"{k} {v:.2e}{f' ({n})' if n else ''}" for k, (v, n) in diffs.items()))
        bad = {k: v for k, v in diffs.items() if not v[0] <= (CHANGE_TOL if k == "weight_change" else TOL)}
        assert not bad, f"{key} differs from the single-process update beyond {TOL}: {bad}"


# --------------------------------------------------------------------------- other model families


def family_folders(root) -> dict[str, str]:
    """Tiny random Gemma 3 (a local layer of window 4, shorter than most rows, then a global one) and
    Qwen3-MoE (4 experts, top 2) folders; vocabularies hold make_batch's ids."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=112, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2)
    models = {"gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8,
                  **common)),
              "qwen3-moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **common))}
    out = {}
    for name, build in models.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _families_body(rank: int, world_size: int, folders: dict[str, str], batches: dict[str, RolloutBatch]) -> dict:
    mesh = FsdpLayout(world_size).build("cpu")
    return {name: engine_update(folder, batches[name], mesh=mesh, group=dist.group.WORLD, fsdp_size=-1)
            for name, folder in folders.items()}


def test_gemma3_and_qwen3_moe_update_on_two_ranks_matches_single_process(tmp_path) -> None:
    """The same update as the dense parity, on a 2-rank FSDP pool, for Gemma 3 (norms, q/k norms, local
    and global layers) and Qwen3-MoE (routed experts through HF's forward, the engine's attention)."""
    folders = family_folders(tmp_path)
    batches = {name: make_batch(folder) for name, folder in folders.items()}
    got = run_distributed(_families_body, 2, folders, batches)[0]
    for name, folder in folders.items():
        ref, mine = reference_update(folder, batches[name]), got[name]
        diffs = {"loss": rel(mine["loss"], ref["loss"]), "grad_norm": rel(mine["grad_norm"], ref["grad_norm"]),
                 "grads": max_rel(mine["grads"], ref["grads"])[0], "weights": max_rel(mine["weights"], ref["weights"])[0]}
        print(f"\n{name}: {diffs}")
        assert all(v <= TOL for v in diffs.values()), (name, diffs)


# --------------------------------------------------------------------------- engine vs rollout log-probs


def _logprob_body(rank: int, world_size: int, folder: str) -> list[dict[str, float]]:
    from spmd_rl.rollout.native import NativeRollout

    rollout = NativeRollout(folder, device=torch.device("cpu"), dtype=torch.float32, batch_size=4,
                            pad_token_id=PAD, eos_token_ids=[2])
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), trainable=False, pad_token_id=PAD)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 104, (n,), generator=g).tolist() for n in (4, 11, 7)]
    out = []
    for top_k, top_p in ((0, 1.0), (20, 0.9)):  # log-probs are of the full distribution, before filtering
        gen = rollout.generate(prompts, n=2, temperature=TEMPERATURE, top_p=top_p, top_k=top_k,
                               max_new_tokens=16, seed=11)
        batch = RolloutBatch(prompts=gen.prompt_ids,
                             tensors={"response_ids": gen.response_ids, "response_mask": gen.response_mask})
        logprobs, _ = engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=3)
        mask = gen.response_mask
        diff = (logprobs - gen.logprobs).abs() * mask
        out.append(dict(top_k=top_k, top_p=top_p, mean=(diff.sum() / mask.sum()).item(), max=diff.max().item(),
                        tokens=mask.sum().item(), lengths=len(set(mask.sum(1).tolist()))))
    return out


def test_compute_logprobs_matches_rollout_sampling_logprobs(folder: str) -> None:
    (results,) = run_distributed(_logprob_body, 1, folder)
    for r in results:
        print(f"\nengine vs rollout log-probs (T={TEMPERATURE}, top_k={r['top_k']}, top_p={r['top_p']}, "
              f"{r['tokens']:.0f} tokens): mean abs diff {r['mean']:.2e}, max {r['max']:.2e}")
        assert r["tokens"] > 6 * 4, "responses too short to compare"
        assert r["mean"] <= 1e-4, r
