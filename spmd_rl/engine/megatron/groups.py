"""megatron-core's process groups for the actor, built from ``actor.megatron`` and checked against
our own pure layout (:class:`spmd_rl.distributed.dims.MegatronLayout`).

    init_model_parallel(layout, seed=cfg.trainer.seed)   # collective over the world, once per process
    tp_group = parallel_state.get_tensor_model_parallel_group()

megatron-core keeps its groups in module globals and builds them as if the actor were the whole
world (``torch.distributed.get_world_size()`` ranks from 0). The global pool always starts at rank 0,
so with pools of other roles (reward, rollout, teacher ranks after it) every rank of the world runs
:func:`create_model_parallel_groups` from ``build_run_groups`` (creating a group is collective over
the world) while megatron-core sees a world of the global pool's size (:func:`world_of`); ranks
outside the pool join no group and keep megatron-core uninitialised. The engine later finds the
groups built and only checks and seeds them. A second call (the reference engine) reuses the groups
after checking they are the same layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from spmd_rl.distributed.dims import MegatronLayout


@contextmanager
def world_of(size: int, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Inside: ``torch.distributed.get_world_size()`` answers ``size`` and ``all_gather_object`` without
    a group gathers over ``group``, for megatron-core calls that take the world to be the actor
    (``initialize_model_parallel``; ``get_megatron_optimizer`` gathers its parameter groups' keys
    over the default group). No-op when ``size`` is the world's."""
    if size == dist.get_world_size():
        yield
        return
    get_world_size, all_gather_object = dist.get_world_size, dist.all_gather_object

    def pool_world_size(group_=None):
        return size if group_ is None else get_world_size(group_)

    def pool_all_gather_object(object_list, obj, group_=None):
        return all_gather_object(object_list, obj, group=group if group_ is None else group_)

    dist.get_world_size, dist.all_gather_object = pool_world_size, pool_all_gather_object
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = get_world_size, all_gather_object


def create_model_parallel_groups(layout: MegatronLayout) -> None:
    """Build megatron-core's groups for an actor pool of global ranks ``0..layout.size-1``; collective
    over the WHOLE world (every rank calls it, in the same order of group creation)."""
    from megatron.core import parallel_state as ps

    with world_of(layout.size):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            order=layout.order.lower(),
        )


def init_model_parallel(layout: MegatronLayout, *, seed: int) -> None:
    """Initialise megatron-core's ``parallel_state`` for ``layout`` (idempotent for the same layout;
    built already by ``build_run_groups`` when the actor pool is not the whole world), seed its
    model-parallel RNG tracker and assert its groups equal ``layout.groups()``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    if not ps.model_parallel_is_initialized() and layout.size != world:
        raise RuntimeError(
            f"megatron-core's groups for an actor pool of {layout.size} of the {world} ranks must be built on every "
            f"rank of the world first (spmd_rl.world.build_run_groups does)")
    created = not ps.model_parallel_is_initialized()
    if not created:
        current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if current != (layout.tp, layout.pp, layout.cp, layout.ep):
            raise RuntimeError(f"megatron-core is already initialised with (tp, pp, cp, ep) = {current}, "
                               f"not {(layout.tp, layout.pp, layout.cp, layout.ep)}")
    else:
        create_model_parallel_groups(layout)
    check_groups(layout)
    # seeded once: by the engine that created the groups, or by the first engine on groups that
    # build_run_groups created (the reference reuses the actor's seeding)
    if created or not tensor_parallel.get_cuda_rng_tracker().get_states():
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
