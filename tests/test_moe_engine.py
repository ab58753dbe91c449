"""The FSDP engine on a mixture-of-experts actor (tiny random Qwen3-MoE): the router's load-balancing loss
is reported (``moe_aux_loss``) and, with ``moe_aux_coef``, trained on.

Run with ``python3 -m pytest tests/test_moe_engine.py -q``. Rows of one length with full responses, so
the engine's grid is exactly the tokens HF's own forward sees; the reference is HF's ``aux_loss`` and
its gradient on a copy of the same weights.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from spmd_rl.config import AlgoConfig

CONFIG = dict(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=3, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              max_position_embeddings=64, initializer_range=0.2)
COEF = 0.5


def _body(rank: int, world_size: int, folder: str) -> dict:
    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 61, (5,), generator=gen).tolist() for _ in range(3)]
    batch = RolloutBatch(prompts=prompts, tensors={"response_ids": torch.randint(3, 61, (3, 4), generator=gen),
                                                   "response_mask": torch.ones(3, 4)})
    out = {}
    for coef in (0.0, COEF):
        engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(1).build("cpu"), device=torch.device("cpu"),
                            fsdp=FsdpConfig(), actor=ActorConfig(grad_clip=0.0), trainable=True, pad_token_id=0,
                            moe_aux_coef=coef)
        # no policy loss: the update's gradient is the router loss's alone
        stats = engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=3),
                                        lambda lp, ent, micro: (lp.sum() * 0, {}), temperature=1.0,
                                        need_entropy_grad=False)
        out[coef] = stats
    out["ids"] = torch.tensor([p + r for p, r in zip(prompts, batch["response_ids"].tolist())])
    return out


def test_router_loss_is_reported_and_trained_with_its_coefficient(tmp_path) -> None:
    from spmd_rl.distributed.testing import run_distributed

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    model.save_pretrained(tmp_path)
    (got,) = run_distributed(_body, 1, str(tmp_path))
    ref = model(input_ids=got["ids"], output_router_logits=True)
    ref.aux_loss.backward()
    ref_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None)).item()
    for coef in (0.0, COEF):
        assert got[coef]["moe_aux_loss"] == pytest.approx(ref.aux_loss.item(), rel=1e-5)
    assert got[0.0]["grad_norm"] == 0.0  # reported only
    assert got[COEF]["grad_norm"] == pytest.approx(COEF * ref_norm, rel=1e-4)


def test_moe_aux_coef_is_checked() -> None:
    with pytest.raises(ValueError, match=r"algo.moe_aux_coef must be >= 0, got -0.1"):
        AlgoConfig(moe_aux_coef=-0.1)
