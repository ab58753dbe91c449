"""Megatron engine state between phases and across layouts (gloo, fp32, 4 processes, one spawn):

* resume on another layout: a checkpoint saved at tp 2 x pp 2 loads at tp 1 x pp 2 (dp 2), which
  saves again and loads at dp 4; the three checkpoints hold the same global tensors bit for bit
  (weights, fp32 main weights, both AdamW moments, step counts), and the next update at dp 4 equals
  the next update at tp 2 x pp 2 (within the layouts' parity tolerance). Tied embeddings, so the
  last stage's copy of the embedding takes part.
* offload: with ``actor.megatron.param_offload`` and ``optimizer_offload`` the parameters,
  gradient buffers, main weights and AdamW moments are swapped out between phases (their storages
  are empty while parked, the load fills the host copies) and the update after the load and the
  log-probs equal those of the same run without offload bit for bit.

Run: ``python -m pytest tests/test_megatron_state.py -q -s``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.numerics import max_rel
from test_fsdp_parity import ACTOR, ALGO, MICRO, PAD, TEMPERATURE, TOL, micro_loss
from test_megatron_parity import _reset, make_pad_batch, tiny_tied_folder

from spmd_rl.config import AlgoConfig
from spmd_rl.distributed.testing import run_distributed

pytest.importorskip("megatron.core")

OFFLOAD = {"param_offload": True, "optimizer_offload": True}


def _engine(folder: str, layout_kw: dict, **megatron_kw):
    from support.megatron_cpu import install_megatron_cpu_shims

    install_megatron_cpu_shims()
    from spmd_rl.config import ActorConfig, MegatronConfig
    from spmd_rl.distributed.dims import MegatronLayout
    from spmd_rl.engine.megatron import MegatronEngine

    layout = MegatronLayout(dist.get_world_size(), **layout_kw)
    return MegatronEngine(model_folder=folder, device=torch.device("cpu"), layout=layout,
                          megatron=MegatronConfig(**layout_kw, **megatron_kw), actor=ActorConfig(**ACTOR),
                          total_updates=4, pad_token_id=PAD, seed=1), layout


def _update(engine, layout, batch) -> None:
    """One update of ``batch`` split over the layout's dp groups (as ``engine_update``)."""
    algo = AlgoConfig(**ALGO)
    coords = layout.coords(dist.get_rank())
    share = len(batch) // layout.dp_size
    mine = batch.select(range(coords["dp"] * share, (coords["dp"] + 1) * share))
    tokens, seqs = float(batch["response_mask"].sum()), float(len(batch))

    def loss_fn(logprobs, entropy, micro):
        return micro_loss(logprobs, entropy, micro, algo=algo, global_tokens=tokens, global_seqs=seqs)

    engine.train_mini_batch(engine.micro_batches(mine, micro_batch_size=MICRO), loss_fn, temperature=TEMPERATURE,
                            need_entropy_grad=True)
    engine.offload()  # as the trainer after its last mini-batch


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.named_full_tensors()}


def _save(engine, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"actor": engine.state_dict()}, checkpoint_id=path)


def _load(engine, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"actor": engine.state_dict()}
    dcp.load(state, checkpoint_id=path)
    engine.load_state_dict(state["actor"])


def _body(rank: int, world_size: int, folder: str, batch, root: str) -> dict[str, Any]:
    # tp 2 x pp 2: update, save A, update -> the reference for the next update
    engine, layout = _engine(folder, {"tp": 2, "pp": 2})
    _update(engine, layout, batch)
    _save(engine, os.path.join(root, "a"))
    _update(engine, layout, batch)
    want = _weights(engine)
    _reset()
    # tp 1 x pp 2 (dp 2) loads A and takes the next update, without and with offload (where the load
    # fills the host copies); the second saves B
    runs = []
    for megatron_kw in ({}, OFFLOAD):
        engine, layout = _engine(folder, {"pp": 2}, **megatron_kw)
        _load(engine, os.path.join(root, "a"))
        if megatron_kw:
            _save(engine, os.path.join(root, "b"))
        _update(engine, layout, batch)
        weight = next(engine.model[0].parameters())
        parked = weight.untyped_storage().nbytes() == 0 and engine._parked_optimizer.bytes_parked > 0
        logprobs, _ = engine.compute_logprobs(batch, temperature=TEMPERATURE, micro_batch_size=4)
        runs.append({"weights": _weights(engine), "logprobs": logprobs, "parked": parked})
        _reset()
    plain, off = runs
    out: dict[str, Any] = {
        "parked": (plain["parked"], off["parked"]),
        "offload_equal": all(torch.equal(plain["weights"][n], off["weights"][n]) for n in plain["weights"])
        and torch.equal(plain["logprobs"], off["logprobs"])}
    # dp 4 loads B, saves C, takes the next update
    engine, layout = _engine(folder, {})
    _load(engine, os.path.join(root, "b"))
    _save(engine, os.path.join(root, "c"))
    _update(engine, layout, batch)
    got = _weights(engine)
    _reset()
    out["next_update"] = max_rel({n: t.numpy() for n, t in got.items()}, want)
    return out


def _full(path: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path + ".pt")
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = torch.as_tensor(value)

    walk("", torch.load(path + ".pt", weights_only=False))
    return flat


def test_offload_and_resume_on_other_layouts(tmp_path) -> None:
    folder = tiny_tied_folder(str(tmp_path / "tiny-tied"))  # tied: pp 2 keeps a copy of the embedding
    results = run_distributed(_body, 4, folder, make_pad_batch(folder), str(tmp_path))
    for rank, r in enumerate(results):
        assert r["parked"] == (False, True), (rank, r["parked"])
        assert r["offload_equal"], f"rank {rank}: offload changed the updates or log-probs"
        print(f"\nrank {rank}: next update at dp 4 vs tp 2 x pp 2, max relative diff {r['next_update'][0]:.2e} "
              f"({r['next_update'][1]})")
        assert r["next_update"][0] <= TOL, r["next_update"]
    a, b, c = (_full(str(tmp_path / name)) for name in "abc")
    assert set(a) == set(b) == set(c), set(a) ^ set(c)
    for entry in ("weights.decoder.layers.3.mlp.linear_fc1.weight/up", "optim.exp_avg_sq/embedding.word_embeddings.weight",
                  "optim.param/embedding.word_embeddings.weight", "adam_step"):
        assert f"actor.{entry}" in a, (entry, sorted(a))
    for key in a:
        for name, other in (("tp1xpp2", b), ("dp4", c)):
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(other[key])), f"{key} differs after {name}"
