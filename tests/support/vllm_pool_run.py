"""``spmd_rl.train`` with two taps, for ``tests/test_vllm_rollout.py`` (run with the Python that has vLLM):

    TAP_DIR=OUT torchrun --nproc-per-node 4 tests/support/vllm_pool_run.py <spmd_rl.train flags>

* actor rank 0: the actor's full tensors of every weight sync to the rollout pool -> ``OUT/sync<k>.pt``;
* with ``--actor.engine megatron``, the actor ranks install the megatron-core CPU shims first;
* each rollout rank: vLLM's own parameters (its tp shard, fused q/k/v and gate/up) after every
  ``load_weights`` -> ``OUT/vllm-rank<R>-load<k>.pt`` with its tp rank and size (see ``weights_held``).

The pytest side compares them bit for bit; nothing else of the run changes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spmd_rl import train
from spmd_rl.rollout import vllm_engine
from spmd_rl.rollout.pool import RolloutLink

TAP = Path(os.environ["TAP_DIR"])
_sync, _load = RolloutLink.sync_weights, vllm_engine.VllmRollout.load_weights
counts = {"sync": 0, "load": 0}


def sync_weights(self, named_tensors, version):
    if dist.get_rank() != 0:
        return _sync(self, named_tensors, version)
    kept = {}

    def tee():
        for name, t in named_tensors:
            kept[name] = t.detach().clone()
            yield name, t

    _sync(self, tee(), version)
    counts["sync"] += 1
    torch.save(kept, TAP / f"sync{counts['sync']}.pt")


@torch.no_grad()
def weights_held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """vLLM's parameters as it computes with them. The CPU backend packs a linear layer's weight for
    oneDNN and empties the parameter, so those are read through the layer's own GEMM applied to the
    identity (``eye @ W.T`` is ``W.T`` exactly: every product is ``w * 1`` or ``w * 0``)."""
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            method = getattr(module, "quant_method", None)
            if pname == "weight" and p.numel() == 0 and method is not None:
                k = getattr(module, "input_size_per_partition", None) or module.input_size
                out[name] = method.apply(module, torch.eye(k, dtype=torch.float32)).T.contiguous()
            else:
                out[name] = p.detach().clone()
    return out


def load_weights(self, named_tensors):
    _load(self, named_tensors)
    from vllm.distributed import parallel_state as ps

    params = self.llm.apply_model(weights_held)[0]
    counts["load"] += 1
    tp = ps.get_tp_group()
    torch.save({"params": params, "tp_rank": tp.rank_in_group, "tp": tp.world_size, "tp_ranks": tp.ranks,
                "world_ranks": ps.get_world_group().ranks},
               TAP / f"vllm-rank{dist.get_rank()}-load{counts['load']}.pt")


RolloutLink.sync_weights = sync_weights
vllm_engine.VllmRollout.load_weights = load_weights


def actor_rank_of_megatron(argv: list[str]) -> bool:
    """Whether this process builds the megatron engine on the CPU (an actor-pool rank of a
    ``--actor.engine megatron`` run): it then needs the megatron-core CPU shims, which the rollout
    pool's vLLM ranks must not get."""
    engine = argv[argv.index("--actor.engine") + 1] if "--actor.engine" in argv else "fsdp"
    if engine != "megatron":
        return False
    rollout = int(argv[argv.index("--pools.rollout-ranks") + 1]) if "--pools.rollout-ranks" in argv else 0
    return int(os.environ["RANK"]) < int(os.environ["WORLD_SIZE"]) - rollout


if __name__ == "__main__":
    if actor_rank_of_megatron(sys.argv[1:]):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
        from support.megatron_cpu import install_megatron_cpu_shims

        install_megatron_cpu_shims()
    train.run(sys.argv[1:])
