"""A NaN/inf gradient norm: the update is dropped (weights and LR schedule untouched), the cause is
named (down to the module or autograd node that made it, by a replay under
``engine.nanwatch``), and the run stops unless ``actor.skip_nonfinite_updates`` allows that many in a row."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.config import ActorConfig, FsdpConfig
from spmd_rl.distributed.dims import FsdpLayout
from spmd_rl.distributed.testing import run_distributed
from spmd_rl.engine.fsdp import FSDPEngine
from spmd_rl.models import resolve_model_path
from test_fsdp_depth import PAD, make_batch


def _body(rank: int, world_size: int, folder: str, skip: int) -> dict:
    batch = make_batch(folder)
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(world_size).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), actor=ActorConfig(lr=1e-2, skip_nonfinite_updates=skip),
                        total_updates=10, trainable=True, pad_token_id=PAD)
    micros = engine.micro_batches(batch, micro_batch_size=8)
    poison = {"on": True}

    def loss_fn(logprobs, entropy, micro):
        loss = -(logprobs * micro["response_mask"]).sum() / 100.0
        # NaN only on rank 0's first micro-batch: the global norm is NaN on every rank
        bad = poison["on"] and rank == 0 and micro.prompts is micros[0].prompts  # loss_fn gets a device copy
        return (loss * float("nan") if bad else loss), {}

    def weights():
        return {n: t.clone() for n, t in engine.named_full_tensors()}

    out: dict = {"events": []}
    before = weights()
    for poisoned in (True, False, True, True):
        poison["on"] = poisoned
        lr_steps = engine.scheduler.last_epoch
        try:
            stats = engine.train_mini_batch(micros, loss_fn, temperature=1.0, need_entropy_grad=False)
        except FloatingPointError as e:
            out["events"].append(("raised", str(e)))
            out["unchanged_after_raise"] = all(torch.equal(before[n], t) for n, t in weights().items())
            break
        now = weights()
        changed = any(not torch.equal(before[n], t) for n, t in now.items())
        out["events"].append(("skipped" if stats["skipped"] else "stepped", changed,
                              engine.scheduler.last_epoch - lr_steps))
        before = now
    return out


@pytest.fixture(scope="module")
def folder() -> str:
    return resolve_model_path("tiny-random", cache_dir=None)


def test_first_nonfinite_update_stops_the_run_and_names_the_cause(folder):
    results = run_distributed(_body, 2, folder, 0)
    for out in results:
        (kind, message), = out["events"]
        assert kind == "raised" and out["unchanged_after_raise"]
        assert "1 update(s) in a row" in message and "--actor.skip-nonfinite-updates (now 0)" in message
    rank0 = results[0]["events"][0][1]
    assert "1 of 2 micro-batch losses non-finite on this rank" in rank0
    assert "first: model." in rank0  # the parameters with NaN gradients are named
    # the replay names the multiplication by NaN in loss_fn, where it was written
    assert "replayed: micro-batch 1 of 2" in rank0
    assert "backward: MulBackward0 returned a non-finite gradient" in rank0 and "test_nonfinite.py" in rank0
    assert "made no NaN/inf" in results[1]["events"][0][1]  # rank 1's own micro-batches are clean


def _poisoned_forward_body(rank: int, world_size: int, folder: str) -> str:
    """A NaN at one position the loss never reads (the last column of row 0, after the last layer's
    MLP) on rank 0: every loss is finite, the final norm's weight gradient is not."""
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(world_size).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), actor=ActorConfig(lr=1e-2), total_updates=10, trainable=True,
                        pad_token_id=PAD)
    mlp = engine.model.model.layers[-1].mlp
    clean = mlp.forward

    def poisoned(x):
        out = clean(x)
        if rank == 0:
            out = out.clone()
            out[0, -1] = float("nan")
        return out

    mlp.forward = poisoned
    micros = engine.micro_batches(make_batch(folder), micro_batch_size=8)

    def loss_fn(logprobs, entropy, micro):
        return -(logprobs * micro["response_mask"]).sum() / 100.0, {}

    with pytest.raises(FloatingPointError) as e:
        engine.train_mini_batch(micros, loss_fn, temperature=1.0, need_entropy_grad=False)
    return str(e.value)


def test_a_nan_the_loss_never_reads_is_traced_to_the_module_that_made_it(folder):
    rank0, rank1 = run_distributed(_poisoned_forward_body, 2, folder)
    assert "0 of 2 micro-batch losses non-finite on this rank" in rank0
    assert "forward: model.layers.1.mlp (LlamaMLP) turned finite inputs into a non-finite output" in rank0
    assert "first [(0, " in rank0  # row 0 of the grid
    assert "backward: " in rank0 and "modeling_llama.py" in rank0  # the node that spread it, with its source line
    assert "made no NaN/inf" in rank1


def test_skipped_updates_leave_weights_alone_until_the_streak_is_too_long(folder):
    for out in run_distributed(_body, 2, folder, 1):
        events = out["events"]
        assert events[0] == ("skipped", False, 0)    # NaN: no weight change, no LR-schedule step
        assert events[1] == ("stepped", True, 1)     # finite: a normal step, the streak resets
        assert events[2] == ("skipped", False, 0)    # NaN again: one in a row is allowed
        kind, message = events[3]                    # a second in a row is not
        assert kind == "raised" and "2 update(s) in a row" in message and out["unchanged_after_raise"]
