"""Host memory per rank of a CPU run: the peak stays within a budget per parameter (docs/PERF.md,
"Memory per rank").

A tiny run under the real launcher (2 gloo ranks, 2 steps, the reference on, a 42.5M-parameter Llama
shape so that the model's bytes stand well above the noise of an interpreter that imported torch)
reports each rank's resident memory after the imports and its peak (``support/memory_run.py``). What
the model may add on top of the imports, per parameter in fp32 (4 bytes), on each of the 2 ranks:

==============================  =============  ===================================================
what                            bytes / param  how
==============================  =============  ===================================================
actor weights (FSDP shard)      2              sharded over the 2 ranks
reference weights (shard)       2              sharded
AdamW state (2 moments)         4              sharded; gradients (2) are dropped between phases
rollout weights, while it runs  4              a full copy; dropped at its level-2 sleep (CPU)
==============================  =============  ===================================================

12 bytes per parameter, plus what does not scale with the model (activations of a few hundred tokens,
the KV cache, the data, loading transients): :data:`SLACK`. Measured: 15 bytes per parameter (613 MiB
above the imports, budget 744 MiB); with the rollout keeping its weights (`--rollout.sleep-level 1`),
activations kept (`--model.gradient-checkpointing False`) and malloc's dynamic threshold, 36-38 bytes
per parameter (1.5 GiB): the test fails.

Memory, not time: the numbers do not depend on how busy the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import HERE, REPO
from spmd_rl.checkpoint_files import model_parameters
from spmd_rl.distributed.testing import cpu_env, free_port, run_distributed
from spmd_rl.models.builtin import TinyShape, cache_root, materialise_tiny_random

SHAPE = TinyShape(layers=8, hidden=768, heads=4, kv_heads=2)
BYTES_PER_PARAM = 12
"""The model's share of a rank's peak (module docstring)."""
SLACK = 256 * 2**20
"""What does not scale with the model, with room for the allocator (the run takes ~3 bytes per parameter
of it: loading transients)."""
FLAGS = [
    "--data.task", "arithmetic", "--data.train-batch-size", "8", "--data.val-size", "16",
    "--rollout.n", "4", "--rollout.max-new-tokens", "8", "--actor.ppo-mini-batch-size", "8",
    "--actor.micro-batch-size", "8", "--reward.fn", "support.rewards:digit_fraction",
    "--logging.wandb", "off", "--logging.no-console", "--trainer.val-every", "0", "--trainer.total-steps", "2",
    "--checkpoint.no-save-final",
]


def memory_run(tmp_path, *flags: str) -> tuple[int, list[dict[str, int]]]:
    """A tiny run's parameters and each rank's ``{"base", "peak"}`` bytes (``support/memory_run.py``)."""
    folder = str(materialise_tiny_random(cache_root(None), SHAPE))
    prefix = str(tmp_path / "memory_rank")
    env = cpu_env(PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "support.memory_run", prefix, "--model.path", folder, *FLAGS,
           "--trainer.output-dir", str(tmp_path / "run"), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR\n{proc.stderr[-6000:]}"
    ranks = []
    for rank in range(2):
        with open(f"{prefix}{rank}.json") as f:
            ranks.append(json.load(f))
    return model_parameters(folder), ranks


def test_peak_memory_per_rank_stays_within_its_budget(tmp_path) -> None:
    params, ranks = memory_run(tmp_path)
    budget = BYTES_PER_PARAM * params + SLACK
    for rank, m in enumerate(ranks):
        grown = m["peak"] - m["base"]
        mib = {k: round(v / 2**20) for k, v in m.items()}
        assert grown <= budget, (
            f"rank {rank}: peak {mib['peak']} MiB is {grown / 2**20:.0f} MiB above the {mib['base']} MiB after "
            f"imports, over the budget of {budget / 2**20:.0f} MiB ({BYTES_PER_PARAM} bytes x {params / 1e6:.1f}M "
            f"parameters + {SLACK / 2**20:.0f} MiB): a copy of the weights too many, the rollout's kept "
            "through the update, activations kept (model.gradient_checkpointing) or freed memory kept by malloc?")
        # the fp32 model itself is there: the budget is not so loose that anything passes
        assert grown >= 8 * params, f"rank {rank}: only {grown / 2**20:.0f} MiB above the imports"


def _update(rank: int, world_size: int, folder: str, batch, checkpointing: bool) -> dict:
    from spmd_rl.config import ActorConfig, FsdpConfig
    from spmd_rl.distributed.dims import FsdpLayout
    from spmd_rl.engine.fsdp import FSDPEngine
    from test_fsdp_depth import ACTOR, MICRO, PAD, TEMPERATURE, micro_loss

    mine = batch.select(list(range(rank, len(batch), world_size)))
    tokens, seqs = batch["response_mask"].sum().item(), float(len(batch))
    engine = FSDPEngine(model_folder=folder, mesh=FsdpLayout(world_size).build("cpu"), device=torch.device("cpu"),
                        fsdp=FsdpConfig(), actor=ActorConfig(**ACTOR), total_updates=2, trainable=True,
                        pad_token_id=PAD, gradient_checkpointing=checkpointing)

    def loss_fn(logprobs, entropy, micro):
        return micro_loss(logprobs, entropy, micro, global_tokens=tokens, global_seqs=seqs)

    stats = engine.train_mini_batch(engine.micro_batches(mine, micro_batch_size=MICRO), loss_fn,
                                    temperature=TEMPERATURE, need_entropy_grad=True)
    grads = {n: p.grad.full_tensor().numpy() for n, p in engine.model.named_parameters()}
    weights = {n: t.numpy().copy() for n, t in engine.named_full_tensors()}
    return dict(grad_norm=stats["grad_norm"], grads=grads, weights=weights)


def test_checkpointing_changes_no_bit_of_an_update() -> None:
    """Recomputed activations (the CPU default, ``model.gradient_checkpointing``) give the same
    gradients and weights, bit for bit, as kept ones: FSDP over 2 ranks, several micro-batches."""
    from test_fsdp_depth import make_batch, tiny_folder

    folder = tiny_folder()
    batch = make_batch(folder)
    kept, recomputed = (run_distributed(_update, 2, folder, batch, on)[0] for on in (False, True))
    assert kept["grad_norm"] == recomputed["grad_norm"]
    for name in kept["grads"]:
        assert (kept["grads"][name] == recomputed["grads"][name]).all(), name
        assert (kept["weights"][name] == recomputed["weights"][name]).all(), name
