"""The FSDP engine on one rank runs the plain module (``spmd_rl/engine/mixed.py``) and computes what
FSDP2 computes there, bit for bit, in mixed precision too.

In one 1-process gloo world, two engines per case take the same two updates (two micro-batches each,
log-probs before, between and after): FSDP2 on the one-rank mesh (``actor.fsdp.wrap_one_rank``) and
the plain module with bf16 compute copies of its fp32 weights. bf16 compute runs on the CPU here, so
the copies, the tied head and the gradient accumulation in fp32 are exercised without a GPU. Cases:
full fine-tuning of a tied Qwen2-shaped model (q/k/v biases) and LoRA (a bf16 base, fp32 adapters).
A 2-process world checks that the plain engine's checkpoint (plain tensors) loads into FSDP shards.

Run: ``python -m pytest tests/test_fsdp_one_rank.py -q``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spmd_rl.config import ActorConfig, FsdpConfig, LoraConfig
from spmd_rl.data.batch import RolloutBatch
from spmd_rl.distributed.dims import FsdpLayout
from spmd_rl.distributed.testing import run_distributed
from spmd_rl.engine.fsdp import FSDPEngine
from spmd_rl.engine.mixed import ComputeCopies
from test_fsdp_depth import ACTOR, MICRO, PAD, TEMPERATURE, make_batch, micro_loss

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tied Qwen2-shaped model with q/k/v biases, vocabulary 104 like the batch's ids."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(7)
    config = Qwen2Config(vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=64, use_sliding_window=False)
    path = tmp_path_factory.mktemp("qwen2_tied") / "model"
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def _body(rank: int, world_size: int, folder: str, batch: RolloutBatch, lora: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))

    def loss_fn(logprobs, entropy, micro):
        return micro_loss(logprobs, entropy, micro, global_tokens=tokens, global_seqs=seqs)

    runs: dict[str, Any] = {}
    for name, wrap, dtype in (("fsdp", True, torch.bfloat16), ("plain", False, torch.bfloat16), ("plain_fp32", False, None)):
        torch.manual_seed(0)  # LoRA's initial A
        engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                            fsdp=FsdpConfig(wrap_one_rank=wrap), actor=ActorConfig(**ACTOR), total_updates=2,
                            trainable=True, pad_token_id=PAD, compute_dtype=dtype, lora=LORA if lora else None)
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        out: dict[str, Any] = {"logprobs": [], "grad_norm": [], "sharded": engine.sharded,
                               "fsdp_modules": any(isinstance(m, FSDPModule) for m in engine.model.modules()),
                               "dtensors": any(isinstance(p, DTensor) for p in engine.model.parameters())}
        copied = []  # the dtypes the layers computed with, seen from inside the pass
        hook = engine.model.model.layers[0].mlp.up_proj.register_forward_pre_hook(
            lambda module, _: copied.append(module.weight.dtype))
        for _ in range(2):
            out["logprobs"].append(engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=MICRO)[0])
            stats = engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=MICRO), loss_fn,
                                            temperature=TEMPERATURE, need_entropy_grad=True)
            out["grad_norm"].append(stats["grad_norm"])
        out["logprobs"].append(engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=MICRO)[0])
        hook.remove()
        out["compute_dtypes"] = sorted({str(d) for d in copied})
        out["weights"] = {n: t.clone() for n, t in engine.named_full_tensors()}
        out["changed"] = sorted(n for n, p in engine.model.named_parameters() if not torch.equal(p.detach(), before[n]))
        out["weight_dtypes"] = sorted({str(p.dtype) for p in engine.model.parameters() if p.requires_grad})
        runs[name] = out
    return runs


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rank_plain_module_equals_fsdp_bit_for_bit(folder: str, lora: bool) -> None:
    """Log-probs, gradient norms and weights after two bf16 updates are FSDP2's exactly; the plain
    engine holds no FSDP module or DTensor, computes with bf16 copies and keeps fp32 weights; fp32
    compute gives other numbers (so the copies were used)."""
    if lora:
        pytest.importorskip("peft")
    batch = make_batch(folder)
    (runs,) = run_distributed(_body, 1, folder, batch, lora)
    fsdp, plain, fp32 = runs["fsdp"], runs["plain"], runs["plain_fp32"]
    assert fsdp["sharded"] and fsdp["fsdp_modules"] and fsdp["dtensors"]
    assert not plain["sharded"] and not plain["fsdp_modules"] and not plain["dtensors"]
    assert plain["compute_dtypes"] == fsdp["compute_dtypes"] == ["torch.bfloat16"]
    assert fp32["compute_dtypes"] == ["torch.float32"]
    assert plain["weight_dtypes"] == fsdp["weight_dtypes"] == ["torch.float32"]
    assert plain["changed"] and plain["changed"] == fsdp["changed"]
    if lora:
        assert all("lora_" in n for n in plain["changed"]), plain["changed"][:4]  # the base stays
    assert plain["grad_norm"] == fsdp["grad_norm"]
    for got, want in zip(plain["logprobs"], fsdp["logprobs"]):
        assert torch.equal(got, want)
    assert plain["weights"].keys() == fsdp["weights"].keys()
    unequal = [n for n in plain["weights"] if not torch.equal(plain["weights"][n], fsdp["weights"][n])]
    assert not unequal, unequal[:4]
    assert not torch.equal(fp32["logprobs"][0], plain["logprobs"][0])


def test_compute_copies_swap_back_tie_and_accumulate() -> None:
    """Inside the block: one bf16 copy per weight (a tied weight's two names share it), leaves that
    record gradients only where the weight does and grad mode is on; after it, the fp32 weights
    again. Gradients of two backwards add up in fp32 on the weights."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    norm = torch.nn.LayerNorm(4)
    norm.weight.requires_grad_(False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "norm": norm})
    copies = ComputeCopies(model, torch.bfloat16)
    ids = torch.tensor([1, 2, 3])
    grads = []
    for _ in range(2):
        with copies.swapped():
            assert emb.weight is head.weight and emb.weight.dtype == torch.bfloat16
            assert emb.weight.requires_grad and not norm.weight.requires_grad and norm.bias.requires_grad
            loss = head(norm(emb(ids))).float().logsumexp(-1).sum()
            loss.backward()
            grads.append(emb.weight.grad.float().clone())
            copies.grads_to_weights()
            assert emb.weight.grad is None
        assert emb.weight.dtype == torch.float32 and emb.weight is head.weight
    assert torch.equal(emb.weight.grad, grads[0] + grads[1]) and norm.weight.grad is None
    assert norm.bias.grad is not None and norm.bias.grad.dtype == torch.float32
    with torch.no_grad(), copies.swapped():
        assert not emb.weight.requires_grad
    with copies.swapped(), pytest.raises(RuntimeError, match="does not nest"):
        with copies.swapped():
            pass


def _reshard_body(rank: int, world_size: int, folder: str, batch: RolloutBatch, ckpt: str) -> dict[str, Any]:
    """Rank 0's plain engine takes an update and saves (DCP, its own group); a 2-rank FSDP engine loads
    that state; both take the same second update (the FSDP one with half the rows per rank)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    one_rank_mesh = FsdpLayout(1).build("cpu")  # every rank calls it; rank 1 gets None

    def update(engine: FSDPEngine, rows: RolloutBatch, group: Any) -> float:
        counts = torch.tensor([rows["response_mask"].sum().item(), float(len(rows))], dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        tokens, seqs = counts.tolist()
        return engine.train_mini_batch(
            engine.micro_batches(rows, micro_batch_size=MICRO),
            lambda lp, ent, micro: micro_loss(lp, ent, micro, global_tokens=tokens, global_seqs=seqs),
            temperature=TEMPERATURE, need_entropy_grad=True)["grad_norm"]

    def engine_on(mesh: Any) -> FSDPEngine:
        return FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(),
                          actor=ActorConfig(**ACTOR), total_updates=2, trainable=True, pad_token_id=PAD)

    out: dict[str, Any] = {}
    if rank == 0:
        plain = engine_on(one_rank_mesh)
        update(plain, batch, alone)
        dcp.save(plain.state_dict(), checkpoint_id=ckpt, process_group=alone)
        out["plain_norm"] = update(plain, batch, alone)
        out["plain"] = {n: t.clone() for n, t in plain.named_full_tensors()}
        out["plain_sharded"] = plain.sharded
    dist.barrier()
    two = engine_on(FsdpLayout(world_size).build("cpu"))
    state = two.state_dict()
    dcp.load(state, checkpoint_id=ckpt)
    two.load_state_dict(state)
    half = len(batch) // world_size
    norm = update(two, batch.select(range(rank * half, (rank + 1) * half)), dist.group.WORLD)
    weights = {n: t.clone() for n, t in two.named_full_tensors()}  # a collective per tensor: every rank
    if rank == 0:
        out.update(two_norm=norm, two=weights, two_sharded=two.sharded, step=two.scheduler.last_epoch)
    return out


def test_a_one_rank_checkpoint_resumes_sharded(folder: str, tmp_path) -> None:
    """The plain engine's checkpoint (plain tensors) loads into FSDP shards on two ranks, optimizer state
    and LR step included: the next update equals the plain engine's own (fp32, 1e-5)."""
    batch = make_batch(folder)
    out = run_distributed(_reshard_body, 2, folder, batch, str(tmp_path / "ckpt"))[0]
    assert not out["plain_sharded"] and out["two_sharded"] and out["step"] == 2
    assert abs(out["two_norm"] - out["plain_norm"]) <= 1e-5 * out["plain_norm"]
    for name, want in out["plain"].items():
        torch.testing.assert_close(out["two"][name], want, rtol=1e-5, atol=1e-6, msg=name)
