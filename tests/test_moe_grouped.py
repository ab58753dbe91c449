"""The MoE update's experts as grouped GEMMs (transformers' ``grouped_mm`` experts: the tokens sorted by
expert once, two grouped GEMMs forward and backward), against Hugging Face's reference loop over the
experts, in fp32 on the CPU: the same outputs and the same gradients within 1e-5, with padding tokens in
the batch and with experts that get no token; and the FSDP engine trains an MoE actor on them.

Run with ``python3 -m pytest tests/test_moe_grouped.py -q``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

CONFIG = dict(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=3, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
              max_position_embeddings=64, initializer_range=0.2)
TOL = 1e-5


def _pair(seed: int = 0) -> tuple[Qwen3MoeForCausalLM, Qwen3MoeForCausalLM]:
    """The same tiny Qwen3-MoE twice: transformers' grouped GEMMs, and its loop over the experts."""
    torch.manual_seed(seed)
    grouped = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).float()
    assert grouped.config._experts_implementation == "grouped_mm", "transformers' default experts changed"
    loop = copy.deepcopy(grouped)
    for module in loop.modules():
        if hasattr(module, "has_gate") and hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    loop.config._experts_implementation = "eager"
    return grouped, loop


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= TOL * max(1.0, b[name].abs().max().item()), f"{name}: max |diff| {diff:.2e}"


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_grouped_experts_equal_the_loop_forward_and_backward(padded: bool) -> None:
    grouped, loop = _pair()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (4, 12), generator=gen)
    mask = torch.ones_like(ids)
    if padded:  # rows of 12, 9, 5 and 12 tokens, padded on the left (as the rollout's prompts)
        for row, pad in enumerate((0, 3, 7, 0)):
            ids[row, :pad], mask[row, :pad] = 0, 0
    outs = {}
    for name, model in (("grouped", grouped), ("loop", loop)):
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        logp = torch.log_softmax(out.logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum() + 0.1 * out.aux_loss
        loss.backward()
        outs[name] = (out.logits.detach(), out.aux_loss.detach(), _grads(model))
    (lg, ag, gg), (ll, al, gl) = outs["grouped"], outs["loop"]
    assert (lg - ll).abs().max().item() <= TOL and abs(ag.item() - al.item()) <= TOL
    _close(gg, gl)
    assert any("experts" in n for n in gg) and any("gate" in n for n in gg)  # expert and router weights trained


def test_experts_that_get_no_token_get_a_zero_gradient() -> None:
    """Routing given by hand (experts 5-7 get no token, expert 0 gets every token once): the grouped
    GEMMs' empty groups leave no stale values in the output or in the unused experts' gradients."""
    grouped, loop = _pair()
    experts = {name: next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "config"))
               for name, model in (("grouped", grouped), ("loop", loop))}
    gen = torch.Generator().manual_seed(2)
    tokens = 10
    x = torch.randn(tokens, CONFIG["hidden_size"], generator=gen)
    index = torch.stack([torch.zeros(tokens, dtype=torch.long), torch.randint(1, 5, (tokens,), generator=gen)], 1)
    weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
    got = {}
    for name, module in experts.items():
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xi, index, wi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        got[name] = (out.detach(), xi.grad, wi.grad, {n: p.grad.clone() for n, p in module.named_parameters()})
    (og, xg, wg, pg), (ol, xl, wl, pl) = got["grouped"], got["loop"]
    assert (og - ol).abs().max().item() <= TOL
    assert (xg - xl).abs().max().item() <= TOL and (wg - wl).abs().max().item() <= TOL
    for name, grad in pg.items():
        loop_grad = pl[name] if pl[name] is not None else torch.zeros_like(grad)
        assert (grad - loop_grad).abs().max().item() <= TOL * max(1.0, loop_grad.abs().max().item()), name
        assert torch.isfinite(grad).all() and grad[5:].abs().max().item() == 0.0, f"{name}: unused experts' gradient"
        assert grad[0].abs().max().item() > 0.0


def test_the_engine_trains_the_moe_actor_on_grouped_gemms(tmp_path) -> None:
    """The FSDP engine's MoE actor runs the grouped experts (transformers' default, which the engine
    keeps), and an update through it moves the experts that got tokens."""
    from spmd_rl.distributed.testing import run_distributed

    folder = str(tmp_path / "moe")
    _pair()[0].save_pretrained(folder)
    res = run_distributed(_engine_body, 1, folder)[0]
    assert res["implementation"] == {"grouped_mm"}
    assert res["moved"] and res["grad_norm"] > 0


def _engine_body(rank: int, world_size: int, folder: str) -> dict:
    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 61, (5,), generator=gen).tolist() for _ in range(3)]
    batch = RolloutBatch(prompts=prompts, tensors={"response_ids": torch.randint(3, 61, (3, 4), generator=gen),
                                                   "response_mask": torch.ones(3, 4)})
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), actor=ActorConfig(lr=1e-3, grad_clip=0.0), trainable=True, pad_token_id=0)
    experts = [m for m in engine.model.modules() if hasattr(m, "has_gate") and hasattr(m, "config")]
    before = [m.gate_up_proj.detach().clone() for m in experts]
    stats = engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=3),
                                    lambda lp, ent, micro: (-lp.sum(), {}), temperature=1.0, need_entropy_grad=False)
    moved = all(not torch.equal(b, m.gate_up_proj.detach()) for b, m in zip(before, experts))
    return {"implementation": {m.config._experts_implementation for m in experts}, "moved": moved,
            "grad_norm": float(stats["grad_norm"])}
