"""vLLM's process groups confined to the rollout's pool, when that pool is not the whole world.

    groups = VllmPoolGroups.create(pool_ranks=[2, 3], tp=2, pp=1, device_type="cpu")  # every rank of the world
    with groups.installed():                    # on the pool's ranks, around vllm.LLM(...)
        llm = LLM(..., distributed_executor_backend="external_launcher")

Why: vLLM in SPMD mode (``external_launcher``) takes torch.distributed's world as its own. Its
worker calls ``init_distributed_environment``, which makes the world group ``_WORLD`` over ranks
``0..world-1`` (and asserts an existing one spans the world), then ``initialize_model_parallel``,
which lays its tp / pp / dcp / pcp / dp (/ ep) groups over ``arange(world_size)``. With a rollout
pool of its own (``pools.rollout_ranks`` > 0), or the global pool next to a reward or teacher pool,
that would pull the other pools' ranks into vLLM's groups (and into the world all-reduce that sizes
its KV cache), and hang.

How (the only place that reaches into vLLM's internals):

1. :meth:`VllmPoolGroups.create`, in ``build_run_groups`` on every rank of the world (creating a
   process group is collective over the world, as for every other pool), creates the torch groups
   vLLM will ask for, over the pool's GLOBAL ranks: per vLLM group one device group (nccl / gloo)
   and one gloo group, with vLLM's own rank arithmetic (:func:`vllm_group_ranks`: tp fastest, then
   pp, as :class:`~spmd_rl.distributed.dims.RolloutLayout`). Size-1 groups (dcp, pcp, dp) too: vLLM
   destroys each coordinator's groups when it shuts down, so none may be shared.
2. :meth:`VllmPoolGroups.installed`, on the pool's ranks around ``vllm.LLM(...)``, swaps the
   worker's ``init_distributed_environment`` for :meth:`_init_groups`, which builds vLLM's own
   ``GroupCoordinator`` objects (``_WORLD``, ``_TP``, ``_ETP``, ``_DCP``, ``_PCP``, ``_PP``,
   ``_DP``, and ``_EP`` for MoE models) while ``torch.distributed.new_group`` hands out the groups
   of step 1; vLLM's ``ensure_model_parallel_initialized`` then finds them built and checks their
   sizes. ``RANK`` reads as the pool-local rank meanwhile: vLLM's ``parallel_config.rank`` is the
   rank in ITS world (it picks a pipeline stage's layers from it).

Everything else vLLM does goes through these coordinators (their global rank lists), so it stays
on the pool. The coordinators are written against vLLM's ``parallel_state`` of the versions in
:data:`TESTED_VLLM`; another version fails at start (:func:`check_vllm_version`) naming this
module and the test that shows it works (``tests/test_vllm_rollout.py -k pool``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

TESTED_VLLM = ("0.32",)
"""vLLM versions (major.minor) whose ``parallel_state`` this module was checked against."""

_PS_NAMES = ("_WORLD", "_TP", "_ETP", "_ENGRAM_DP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB", "_NODE_COUNT",
             "GroupCoordinator", "init_world_group", "init_model_parallel_group", "_node_count")
"""What :meth:`VllmPoolGroups._init_groups` sets or calls in ``vllm.distributed.parallel_state``."""

# vLLM's model-parallel coordinators in the order it builds them: name, with a message-queue broadcaster
_COORDINATORS = (("tp", True), ("dcp", True), ("pcp", False), ("pp", False), ("dp", False), ("ep", False))


def vllm_group_ranks(pool_ranks: list[int], tp: int, pp: int) -> dict[str, list[list[int]]]:
    """vLLM's groups over ``pool_ranks`` (global), as its ``initialize_model_parallel`` lays them over
    ``0..world-1``: axes ``(external dp, dp=1, pp, pcp=1, tp)``, tp fastest. ``world`` is the pool."""
    n = len(pool_ranks)
    if tp < 1 or pp < 1 or n % (tp * pp):
        raise ValueError(f"rollout.tp ({tp}) * rollout.pp ({pp}) does not divide the rollout's pool size ({n})")
    grid = torch.tensor(pool_ranks).reshape(-1, 1, pp, 1, tp)

    def lists(t: torch.Tensor, size: int) -> list[list[int]]:
        return [row.tolist() for row in t.reshape(-1, size).unbind(0)]

    return {"world": [list(pool_ranks)], "tp": lists(grid, tp), "dcp": lists(grid, 1),
            "pcp": lists(grid.transpose(3, 4), 1), "pp": lists(grid.transpose(2, 4), pp),
            "dp": lists(grid.transpose(1, 4), 1), "ep": lists(grid.transpose(1, 2), tp)}


def check_vllm_version(version: str) -> None:
    """Raise unless ``version`` is one this module was checked against (see the module docstring)."""
    if ".".join(version.split(".")[:2]) not in TESTED_VLLM:
        raise RuntimeError(
            f"rollout.backend=vllm on a pool that is not the whole world builds vLLM's process groups itself "
            f"(spmd_rl/rollout/vllm_groups.py), which was checked against vLLM {', '.join(TESTED_VLLM)}, not the "
            f"installed {version}: run tests/test_vllm_rollout.py -k pool with it and add it to TESTED_VLLM, or keep "
            f"vLLM on the whole world (--pools.rollout-ranks 0 and no reward / teacher pool)")


@dataclass
class VllmPoolGroups:
    """The torch groups vLLM needs over one pool, as this rank holds them (see the module docstring)."""

    pool_ranks: list[int]
    tp: int
    pp: int
    backend: str
    """The device groups' backend, vLLM's ``current_platform.dist_backend`` (``nccl`` / ``gloo``)."""
    ident: str = ""
    """This run's name for vLLM's CPU shared-memory segments (``VLLM_DIST_IDENT``): vLLM's own worker
    derives it from its init method, which left it empty here, so a crashed run's segments in
    /dev/shm made the next run's ``init_shm_manager`` fail (errno 17). Agreed by :meth:`create`."""
    mine: dict[tuple[int, ...], list[Any]] = field(default_factory=dict)
    """Per rank list holding this rank: its groups in creation order (device, gloo, device, gloo, ...)."""
    _served: dict[tuple[int, ...], int] = field(default_factory=dict)

    @classmethod
    def create(cls, *, pool_ranks: list[int], tp: int, pp: int, device_type: str) -> VllmPoolGroups:
        """Create the groups; collective over the WHOLE world (every rank calls it, in one order)."""
        backend = "nccl" if device_type == "cuda" else "gloo"
        token = [secrets.token_hex(6) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(token, src=0)  # one name per run, on every rank
        out = cls(pool_ranks=list(pool_ranks), tp=tp, pp=pp, backend=backend, ident=f"spmd_rl-{token[0]}")
        me = dist.get_rank()
        layout = vllm_group_ranks(out.pool_ranks, tp, pp)
        for ranks in (ranks for name in ("world", *(c for c, _ in _COORDINATORS)) for ranks in layout[name]):
            device = dist.new_group(ranks, backend=backend)
            cpu = dist.new_group(ranks, backend="gloo")
            if me in ranks:
                out.mine.setdefault(tuple(ranks), []).extend([device, cpu])
        return out

    @property
    def rank_in_pool(self) -> int:
        return self.pool_ranks.index(dist.get_rank())

    def _new_group(self, ranks: list[int] | None = None, backend: Any = None, **_: Any) -> Any:
        """``torch.distributed.new_group`` while vLLM's coordinators are built: the groups made by
        :meth:`create` over the same ranks, in the order they were made."""
        key = tuple(ranks) if ranks is not None else ()
        if dist.get_rank() not in key:
            return dist.GroupMember.NON_GROUP_MEMBER
        made = self.mine.get(key)
        i = self._served.get(key, 0)
        if made is None or i >= len(made):
            raise RuntimeError(f"vLLM asks for a process group over ranks {list(key)} that spmd_rl/rollout/vllm_groups.py "
                               f"did not make (its groups: {sorted(self.mine)}); this vLLM version builds other groups")
        self._served[key] = i + 1
        return made[i]

    def _init_groups(self, world_size: int = -1, rank: int = -1, distributed_init_method: str | None = None,
                     local_rank: int = -1, backend: str = "gloo", timeout: Any = None) -> None:
        """Stands in for vLLM's ``init_distributed_environment`` in its worker: vLLM's coordinators over
        the pool (world) and its model-parallel groups, from the groups of :meth:`create`."""
        from vllm.config import get_current_vllm_config
        from vllm.distributed import parallel_state as ps

        par = get_current_vllm_config().parallel_config
        model = get_current_vllm_config().model_config
        got = {"world_size": par.world_size, "tensor_parallel_size": par.tensor_parallel_size,
               "pipeline_parallel_size": par.pipeline_parallel_size, "data_parallel_size": par.data_parallel_size,
               "prefill_context_parallel_size": par.prefill_context_parallel_size,
               "decode_context_parallel_size": par.decode_context_parallel_size or 1,
               "enable_eplb": par.enable_eplb, "enable_elastic_ep": par.enable_elastic_ep}
        want = dict(got, world_size=len(self.pool_ranks), tensor_parallel_size=self.tp,
                    pipeline_parallel_size=self.pp, data_parallel_size=1, prefill_context_parallel_size=1,
                    decode_context_parallel_size=1, enable_eplb=False, enable_elastic_ep=False)
        if got != want:
            raise RuntimeError(f"vLLM on its pool supports tp and pp only: its parallel config {got} "
                               f"differs from {want} (spmd_rl/rollout/vllm_groups.py)")
        if ps._WORLD is not None or ps._TP is not None:
            raise RuntimeError("vLLM's process groups exist already in this process: close the other engine first")
        layout = vllm_group_ranks(self.pool_ranks, self.tp, self.pp)
        moe = model is None or model.is_moe
        os.environ["VLLM_DIST_IDENT"] = self.ident  # the CPU communicators name their shared memory from it
        real_new_group = dist.new_group
        dist.new_group = self._new_group  # vLLM's coordinators call torch.distributed.new_group for each rank list
        try:
            world = ps.init_world_group(layout["world"][0], local_rank, backend)
            made = {}
            for name, broadcaster in _COORDINATORS:
                if name == "ep" and not moe:  # vLLM leaves _EP unset for dense models
                    continue
                made[name] = ps.init_model_parallel_group(layout[name], local_rank, backend, group_name=name,
                                                          use_message_queue_broadcaster=broadcaster,
                                                          **({"use_all2all": par.use_all2all} if name == "ep" else {}))
        finally:
            dist.new_group = real_new_group
        ps._WORLD, ps._NODE_COUNT = world, ps._node_count(world.cpu_group)
        ps._TP = ps._ETP = made["tp"]
        ps._DCP, ps._PCP, ps._PP, ps._DP = made["dcp"], made["pcp"], made["pp"], made["dp"]
        ps._EP = made.get("ep")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Around ``vllm.LLM(...)`` on the pool's ranks: vLLM builds its groups from these (see above)."""
        import vllm
        from vllm.distributed import parallel_state as ps
        from vllm.v1.worker import gpu_worker

        check_vllm_version(vllm.__version__)
        missing = [n for n in _PS_NAMES if not hasattr(ps, n)]
        if missing or not hasattr(gpu_worker, "init_distributed_environment"):
            raise RuntimeError(f"vLLM {vllm.__version__} lacks {missing or ['gpu_worker.init_distributed_environment']}, "
                               f"which spmd_rl/rollout/vllm_groups.py sets up")
        saved_init, saved_rank = gpu_worker.init_distributed_environment, os.environ.get("RANK")
        gpu_worker.init_distributed_environment = self._init_groups  # the CPU and GPU workers both call it from here
        os.environ["RANK"] = str(self.rank_in_pool)  # vLLM's rank: in its world, the pool
        try:
            yield
        finally:
            gpu_worker.init_distributed_environment = saved_init
            if saved_rank is None:
                os.environ.pop("RANK", None)
            else:
                os.environ["RANK"] = saved_rank

    def release(self) -> None:
        """After the engine closed (``destroy_model_parallel``): drop vLLM's world group, which spans the
        pool only (a whole-world vLLM keeps it, as vLLM does)."""
        from vllm.distributed import parallel_state as ps

        if ps._WORLD is not None:
            ps._WORLD.destroy()
        ps._WORLD, ps._NODE_COUNT = None, None
        for path in glob.glob(f"/dev/shm/{glob.escape(self.ident)}-*"):  # vLLM leaves its CPU segments behind
            with contextlib.suppress(FileNotFoundError):  # each rank removes what is left; a mapping stays valid
                os.unlink(path)


__all__ = ["TESTED_VLLM", "VllmPoolGroups", "check_vllm_version", "vllm_group_ranks"]
