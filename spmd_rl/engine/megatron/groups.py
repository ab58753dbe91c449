"""megatron-core's process groups for the actor, built from ``actor.megatron`` and checked against
our own pure layout (:class:`spmd_rl.distributed.dims.MegatronLayout`).

    init_model_parallel(layout, seed=cfg.trainer.seed)   # collective over the world, once per process
    tp_group = parallel_state.get_tensor_model_parallel_group()

megatron-core keeps its groups in module globals built over the WHOLE world, so the actor pool
must be the whole world: a separate reward pool (``pools.reward_ranks`` > 0) cannot be combined
with ``actor.engine=megatron``. A second call (the reference engine) reuses the groups after
checking they are the same layout.
"""

from __future__ import annotations

import torch.distributed as dist

from spmd_rl.distributed.dims import MegatronLayout


def init_model_parallel(layout: MegatronLayout, *, seed: int) -> None:
    """Initialise megatron-core's ``parallel_state`` for ``layout`` (idempotent for the same layout),
    seed its model-parallel RNG tracker and assert its groups equal ``layout.groups()``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    if layout.size != world:
        raise ValueError(
            f"actor.engine=megatron needs the actor pool to be the whole world: megatron-core builds its "
            f"process groups over all {world} ranks, but the global pool has {layout.size}; set "
            f"--pools.reward_ranks 0 (the reward model then runs colocated) or use --actor.engine fsdp"
        )
    if ps.model_parallel_is_initialized():
        current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if current != (layout.tp, layout.pp, layout.cp, layout.ep):
            raise RuntimeError(f"megatron-core is already initialised with (tp, pp, cp, ep) = {current}, "
                               f"not {(layout.tp, layout.pp, layout.cp, layout.ep)}")
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        order=layout.order.lower(),
    )
    check_groups(layout)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_groups() -> dict[str, list[int]]:
    """This rank's megatron-core groups as sorted global rank lists, under ``MegatronLayout.groups`` names."""
    from megatron.core import parallel_state as ps

    getters = {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "cp": ps.get_context_parallel_group,
        "dp": lambda: ps.get_data_parallel_group(with_context_parallel=False),
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "mp": ps.get_model_parallel_group,
        "ep": ps.get_expert_model_parallel_group,
        "expert_tp": ps.get_expert_tensor_parallel_group,
        "expert_dp": ps.get_expert_data_parallel_group,
    }
    return {name: sorted(dist.get_process_group_ranks(get())) for name, get in getters.items()}


def check_groups(layout: MegatronLayout) -> None:
    """Raise if megatron-core's groups for this rank differ from the pure layout's."""
    rank = dist.get_rank()
    ours = {name: next(g for g in groups if rank in g) for name, groups in layout.groups().items()}
    theirs = megatron_groups()
    diff = {k: (ours[k], theirs[k]) for k in ours if sorted(ours[k]) != theirs[k]}
    if diff:
        raise RuntimeError(f"megatron-core's groups differ from MegatronLayout on rank {rank} "
                           f"(name: ours, megatron-core's): {diff}")
