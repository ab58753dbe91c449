"""A resume with changed optimizer settings trains with the new ones (FSDP engine, one gloo process).

The saving run trains 3 updates of a cosine schedule over 10 updates. Each resume changes one field
of the actor's optimizer settings (or ``trainer.total_steps``, which sets the schedule's length);
after the load the optimizer must hold the new lr / betas / weight decay, and the next two updates
must use this run's schedule at updates 3 and 4. Before the fix the saved param groups and the
scheduler's saved base LR won: ``actor.lr 1e-05 -> 0.001`` was logged and ``actor/lr`` stayed 1e-05.
"""

from __future__ import annotations

import pytest

from spmd_rl.config import ActorConfig
from spmd_rl.distributed.testing import run_distributed
from spmd_rl.engine.base import lr_lambda

SAVED_UPDATES = 3
BASE = dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, lr_schedule="cosine",
            min_lr_ratio=0.0, grad_clip=1.0)
TOTAL = 10
CHANGES = {  # field -> (actor overrides, total updates)
    "unchanged": ({}, TOTAL),
    "lr": ({"lr": 1e-3}, TOTAL),
    "betas": ({"betas": (0.8, 0.95)}, TOTAL),
    "weight_decay": ({"weight_decay": 0.1}, TOTAL),
    "warmup_steps": ({"warmup_steps": 6}, TOTAL),
    "lr_schedule": ({"lr_schedule": "constant"}, TOTAL),
    "min_lr_ratio": ({"min_lr_ratio": 0.5}, TOTAL),
    "grad_clip": ({"grad_clip": 0.25}, TOTAL),
    "total_steps": ({}, 4 * TOTAL),
}


def _body(rank: int, world_size: int, tmp: str) -> dict:
    import torch

    from spmd_rl.checkpoint import Checkpointer
    from spmd_rl.config import CheckpointConfig, FsdpConfig
    from spmd_rl.data.batch import RolloutBatch
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from spmd_rl.models import resolve_model_path

    folder = resolve_model_path("tiny-random", cache_dir=None)
    mesh = FsdpLayout(1).build("cpu")
    table = [{"rank": 0, "host": "h", "device": "cpu"}]
    batch = RolloutBatch(prompts=[[5, 6, 7], [8, 9]],
                         tensors={"response_ids": torch.tensor([[10, 11, 12], [13, 14, 0]]),
                                  "response_mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])})

    def loss_fn(logprobs, entropy, micro):
        mask = micro["response_mask"]
        return -(logprobs * mask).sum() / mask.sum(), {}

    def build(actor: ActorConfig, total: int) -> FSDPEngine:
        return FSDPEngine(model_folder=folder, mesh=mesh, device=torch.device("cpu"), fsdp=FsdpConfig(),
                          actor=actor, total_updates=total, trainable=True, pad_token_id=0)

    def update(engine: FSDPEngine) -> float:
        return engine.train_mini_batch(engine.micro_batches(batch, micro_batch_size=2), loss_fn,
                                       temperature=1.0, need_entropy_grad=False)["lr"]

    saver_engine = build(ActorConfig(**BASE), TOTAL)
    for _ in range(SAVED_UPDATES):
        update(saver_engine)
    saver = Checkpointer(checkpoint=CheckpointConfig(), output_dir=f"{tmp}/saver", total_steps=5, rank_table=table)
    saver.track(actor=saver_engine)
    saved = saver.save(1)
    saver.close()
    out = {}
    for field, (overrides, total) in CHANGES.items():
        engine = build(ActorConfig(**{**BASE, **overrides}), total)
        ckpt = Checkpointer(checkpoint=CheckpointConfig(resume=str(saved)), output_dir=f"{tmp}/{field}",
                            total_steps=5, rank_table=table)
        ckpt.track(actor=engine)
        ckpt.resume()
        ckpt.close()
        group = engine.optimizer.param_groups[0]
        loaded = {key: group[key] for key in ("lr", "initial_lr", "weight_decay")}
        loaded["betas"] = tuple(group["betas"])
        loaded["base_lrs"] = list(engine.scheduler.base_lrs)
        loaded["grad_clip"] = engine.grad_clip
        loaded["next_lrs"] = [update(engine), update(engine)]  # the lr each of the next two updates used
        out[field] = loaded
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    (result,) = run_distributed(_body, 1, str(tmp_path_factory.mktemp("settings")))
    return result


@pytest.mark.parametrize("field", list(CHANGES))
def test_changed_optimizer_setting_takes_effect_on_resume(resumed, field):
    overrides, total = CHANGES[field]
    new = ActorConfig(**{**BASE, **overrides})
    loaded = resumed[field]

    def lr_at(update: int) -> float:
        return new.lr * lr_lambda(update, warmup=new.warmup_steps, total=total, schedule=new.lr_schedule,
                                  min_ratio=new.min_lr_ratio)

    assert loaded["betas"] == pytest.approx(tuple(new.betas)), loaded
    assert loaded["weight_decay"] == new.weight_decay, loaded
    assert loaded["initial_lr"] == new.lr and loaded["base_lrs"] == [new.lr], loaded
    assert loaded["grad_clip"] == new.grad_clip, loaded
    assert loaded["lr"] == pytest.approx(lr_at(SAVED_UPDATES), rel=1e-12), loaded
    assert loaded["next_lrs"] == pytest.approx([lr_at(SAVED_UPDATES), lr_at(SAVED_UPDATES + 1)], rel=1e-12), loaded
