"""Parallel layouts as pure data: every rank's coordinates and every group, with no process group.

Each layout is a frozen dataclass of degrees over one pool of ``size`` ranks (pool-local ranks
``0..size-1``). Construction resolves ``-1`` ("the rest") and raises ``ValueError`` naming the
flag and the numbers, so every rule is testable for any world size in one process::

    FsdpLayout(size=8, fsdp_size=4).groups()["fsdp"]    # [[0, 1, 2, 3], [4, 5, 6, 7]]
    UlyssesLayout(size=8, sp=2).coords(3)               # {'dp': 1, 'sp': 1}
    MegatronLayout(size=16, tp=2, pp=2).coords(5)       # tp=1, dp=2, pp=0, ...

:func:`spmd_rl.plan.plan` validates all layouts of a run together.

``build()`` creates the real objects later. It is collective over the WHOLE world even for a pool
that is a subset of it (``torch.distributed.new_group`` and ``DeviceMesh`` creation must be called
by every rank, for every group, in the same order), so every rank calls it; ranks outside the pool
get ``None`` (meshes) or ``{}`` (group dicts). ``start`` is the pool's first global rank.

How FSDP/HSDP and Ulysses compose (fsdp engine): they are two views of the same pool ranks.
The FSDP mesh (``[fsdp]``, or ``[ddp, fsdp]`` for HSDP) decides parameter sharding and always
covers every rank of the pool, i.e. all dp x sp ranks. The Ulysses mesh ``[dp, sp]`` decides the
data: ranks of one sp group hold the same samples, each a slice of the sequence, so the actor's
data-parallel ("batch") size is pool size / sp. Gradients are reduced over the FSDP mesh (all
ranks): each sp rank holds the gradient of its own tokens' share of the loss, so summing over sp
ranks, like summing over dp ranks, gives the full gradient when the loss is normalised by the
global token count. fsdp_size and sp need not nest; with sp dividing fsdp_size each sp group lies
inside one shard group (e.g. one node), which keeps the sp all-to-all local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from spmd_rl.distributed.pools import GLOBAL, build_groups, build_mesh

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

MEGATRON_AXES = ("tp", "cp", "ep", "dp", "pp")


class ActorLayout(Protocol):
    """The actor's data ("batch") view of its pool, whatever the engine: which rows a rank holds and
    whether it adds them to sums over the pool (token counts, summed metrics). Implemented by
    :class:`UlyssesLayout` (fsdp engine) and :class:`MegatronLayout`."""

    size: int

    @property
    def dp_size(self) -> int: ...

    @property
    def dp_formula(self) -> str:
        """How ``dp_size`` follows from the flags, for error messages."""
        ...

    def dp_rank(self, rank: int) -> int:
        """Data-parallel index of pool-local ``rank``."""
        ...

    def counts_in_sums(self, rank: int) -> bool:
        """Whether ``rank`` adds its rows to sums over the pool: exactly one rank per dp group does."""
        ...

    def coords(self, rank: int) -> dict[str, int]: ...

    def groups(self) -> dict[str, list[list[int]]]: ...


# --------------------------------------------------------------------------- grid helpers


@dataclass(frozen=True)
class _Grid:
    """Ranks laid out in C order over named axes; ``names[0]`` varies fastest."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        out, s = [], 1
        for z in self.sizes:
            out.append(s)
            s *= z
        return tuple(out)

    @property
    def total(self) -> int:
        return math.prod(self.sizes)

    def coords(self, rank: int) -> dict[str, int]:
        return {n: (rank // st) % z for n, z, st in zip(self.names, self.sizes, self.strides)}

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Groups of ranks that differ only along ``axes``; each sorted, listed by first rank."""
        rest = [n for n in self.names if n not in axes]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.total):
            c = self.coords(r)
            buckets.setdefault(tuple(c[n] for n in rest), []).append(r)
        return sorted(buckets.values(), key=lambda g: g[0])


class _Layout:
    """Shared part of the layouts: coordinates and groups read off the subclass's ``_grid()``."""

    size: int
    pool: str
    _coord_axes: ClassVar[tuple[str, ...]] = ()
    _group_axes: ClassVar[dict[str, tuple[str, ...]]] = {}

    def _grid(self) -> _Grid:
        raise NotImplementedError

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the {self.pool} pool of size {self.size}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of pool-local ``rank`` along every axis."""
        self._check_rank(rank)
        c = self._grid().coords(rank)
        return {a: c[a] for a in self._coord_axes}

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of pool-local ranks per axis; each group sorted, groups by first rank."""
        g = self._grid()
        return {name: g.groups(axes) for name, axes in self._group_axes.items()}


def _check_size(size: int, pool: str) -> None:
    if size < 1:
        raise ValueError(f"the {pool} pool size must be >= 1, got {size}")


# --------------------------------------------------------------------------- FSDP / HSDP


@dataclass(frozen=True)
class FsdpLayout(_Layout):
    """FSDP2 parameter sharding over a pool: ``[fsdp]`` when fsdp_size is the whole pool, else HSDP
    ``[ddp, fsdp]`` with ``rank = ddp * fsdp_size + fsdp`` (shard inside a block, replicate across)."""

    size: int
    fsdp_size: int = -1
    pool: str = GLOBAL

    def __post_init__(self) -> None:
        _check_size(self.size, self.pool)
        if self.fsdp_size == -1:
            object.__setattr__(self, "fsdp_size", self.size)
        if self.fsdp_size < 1:
            raise ValueError(f"actor.fsdp.fsdp_size must be -1 or >= 1, got {self.fsdp_size}")
        if self.size % self.fsdp_size:
            raise ValueError(
                f"actor.fsdp.fsdp_size ({self.fsdp_size}) does not divide the {self.pool} pool size ({self.size})"
            )

    @property
    def ddp_size(self) -> int:
        return self.size // self.fsdp_size

    @property
    def hsdp_enabled(self) -> bool:
        return self.ddp_size > 1

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("ddp", "fsdp") if self.hsdp_enabled else ("fsdp",)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.ddp_size, self.fsdp_size) if self.hsdp_enabled else (self.fsdp_size,)

    # groups: fsdp (shard groups) and ddp (replica groups; singletons without HSDP)
    _coord_axes = ("ddp", "fsdp")
    _group_axes = {"fsdp": ("fsdp",), "ddp": ("ddp",)}

    def _grid(self) -> _Grid:
        return _Grid(("fsdp", "ddp"), (self.fsdp_size, self.ddp_size))

    def build(self, device_type: str = "cpu", *, start: int = 0) -> DeviceMesh | None:
        """The DeviceMesh over global ranks ``start..start+size-1``; every rank of the world
        calls it; None on ranks outside the pool."""
        return build_mesh(device_type, start, self.mesh_shape, self.mesh_dim_names)


# --------------------------------------------------------------------------- Ulysses


@dataclass(frozen=True)
class UlyssesLayout(_Layout):
    """Ulysses sequence parallelism ``[dp, sp]``: sp ranks contiguous, ``rank = dp * sp + sp_idx``.
    Ranks of one sp group hold the same samples; dp is the actor's data-parallel (batch) axis."""

    size: int
    sp: int = 1
    pool: str = GLOBAL

    def __post_init__(self) -> None:
        _check_size(self.size, self.pool)
        if self.sp < 1:
            raise ValueError(f"actor.fsdp.ulysses_size must be >= 1, got {self.sp}")
        if self.size % self.sp:
            raise ValueError(f"actor.fsdp.ulysses_size ({self.sp}) does not divide the {self.pool} pool size ({self.size})")

    @property
    def dp_size(self) -> int:
        return self.size // self.sp

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    # --- the actor's batch view (ActorLayout), for the fsdp engine
    @property
    def dp_formula(self) -> str:
        return f"{self.pool} pool size ({self.size}) / actor.fsdp.ulysses_size ({self.sp})"

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"]

    def counts_in_sums(self, rank: int) -> bool:
        """The sp ranks of a dp group hold the same rows: sp rank 0 counts them."""
        return self.coords(rank)["sp"] == 0

    mesh_dim_names: ClassVar[tuple[str, str]] = ("dp", "sp")
    _coord_axes = ("dp", "sp")
    _group_axes = {"sp": ("sp",), "dp": ("dp",)}

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.dp_size, self.sp)

    def _grid(self) -> _Grid:
        return _Grid(("sp", "dp"), (self.sp, self.dp_size))

    def build(self, device_type: str = "cpu", *, start: int = 0) -> DeviceMesh | None:
        """The ``[dp, sp]`` DeviceMesh over global ranks ``start..``; collective over the world."""
        return build_mesh(device_type, start, self.mesh_shape, self.mesh_dim_names)


# --------------------------------------------------------------------------- rollout


@dataclass(frozen=True)
class RolloutLayout(_Layout):
    """Rollout engine mesh (dp, pp, tp) in C order with tp fastest:
    ``rank = (dp * pp_size + pp) * tp_size + tp``; tp groups are contiguous blocks as in vLLM.
    Every rank of one model replica (its tp x pp group, ``mp``) gets the same prompts."""

    size: int
    tp: int = 1
    pp: int = 1
    pool: str = GLOBAL

    def __post_init__(self) -> None:
        _check_size(self.size, self.pool)
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"rollout.tp ({self.tp}) and rollout.pp ({self.pp}) must be >= 1")
        if self.size % (self.tp * self.pp):
            raise ValueError(
                f"rollout.tp ({self.tp}) * rollout.pp ({self.pp}) does not divide the {self.pool} pool size ({self.size})"
            )

    @property
    def dp_size(self) -> int:
        return self.size // (self.tp * self.pp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    # groups: tp, pp, dp and mp (one model replica: its tp x pp ranks)
    _coord_axes = ("dp", "pp", "tp")
    _group_axes = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "mp": ("tp", "pp")}

    def _grid(self) -> _Grid:
        return _Grid(("tp", "pp", "dp"), (self.tp, self.pp, self.dp_size))

    def build(self, *, start: int = 0, timeout: timedelta | None = None) -> dict[str, ProcessGroup]:
        """This rank's process group per axis; collective over the world ({} outside the pool)."""
        return build_groups(self.groups(), start, timeout)


# --------------------------------------------------------------------------- Megatron


@dataclass(frozen=True)
class MegatronLayout(_Layout):
    """megatron-core's rank layout (``parallel_state.RankGenerator``), computed without it.

    Dense layers: axes ``order`` (fastest first) with sizes tp, cp, ep=1, dp, pp where
    ``dp = size / (tp * pp * cp)``. Expert layers: the same order with sizes etp, cp=1, ep,
    expert_dp, pp where ``expert_dp = size / (etp * ep * pp)``. Axes left out of ``order`` are
    appended last (allowed only for size 1), as megatron-core does.
    """

    size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    pool: str = GLOBAL
    _tokens: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        _check_size(self.size, self.pool)
        etp_note = "" if self.etp is not None else ", = actor.megatron.tp"
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("tp", "pp", "cp", "ep", "etp", "vpp"):
            if getattr(self, name) < 1:
                raise ValueError(f"actor.megatron.{name} must be >= 1, got {getattr(self, name)}")
        dense = self.tp * self.pp * self.cp
        if self.size % dense:
            raise ValueError(
                f"actor.megatron.tp ({self.tp}) * actor.megatron.pp ({self.pp}) * actor.megatron.cp ({self.cp}) "
                f"= {dense} does not divide the {self.pool} pool size ({self.size})"
            )
        expert = self.etp * self.ep * self.pp  # type: ignore[operator]
        if self.size % expert:
            raise ValueError(
                f"actor.megatron.etp ({self.etp}{etp_note}) * actor.megatron.ep ({self.ep}) * actor.megatron.pp "
                f"({self.pp}) = {expert} does not divide the {self.pool} pool size ({self.size})"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"actor.megatron.vpp ({self.vpp}) > 1 needs actor.megatron.pp > 1, got {self.pp}")
        object.__setattr__(self, "_tokens", self._resolve_order())
        if self.pp > 1 and not self.order.lower().endswith("pp") and self.expert_dp_size != self.dp_size:
            raise ValueError(
                f"actor.megatron.order ({self.order!r}) does not end with pp, so dense and expert layers need the "
                f"same data-parallel size, but {self.pool} pool size ({self.size}) / (tp {self.tp} * pp {self.pp} * "
                f"cp {self.cp}) = {self.dp_size} and / (etp {self.etp} * ep {self.ep} * pp {self.pp}) = {self.expert_dp_size}"
            )
        dense_pp, expert_pp = self._dense().groups(("pp",)), self._expert().groups(("pp",))
        if dense_pp != expert_pp:
            raise ValueError(
                f"actor.megatron.order ({self.order!r}) gives dense and expert layers different pipeline groups "
                f"(dense {dense_pp[0]}, expert {expert_pp[0]}, ...) with tp {self.tp} * cp {self.cp} vs "
                f"etp {self.etp} * ep {self.ep}; put pp last in the order"
            )

    def _resolve_order(self) -> tuple[str, ...]:
        tokens = self.order.lower().split("-")
        bad = [t for t in tokens if t not in MEGATRON_AXES]
        if bad or len(set(tokens)) != len(tokens):
            raise ValueError(
                f"actor.megatron.order must name each of {', '.join(MEGATRON_AXES)} at most once separated by '-', "
                f"got {self.order!r}"
            )
        # like megatron-core: a left-out axis is appended last, and only allowed with size 1 in
        # both the dense and the expert layout
        sizes = {
            "tp": [("actor.megatron.tp", self.tp), ("actor.megatron.etp", self.etp)],
            "cp": [("actor.megatron.cp", self.cp)],
            "ep": [("actor.megatron.ep", self.ep)],
            "dp": [("the data-parallel size", self.dp_size), ("the expert data-parallel size", self.expert_dp_size)],
            "pp": [("actor.megatron.pp", self.pp)],
        }
        for name in MEGATRON_AXES:
            if name in tokens:
                continue
            for what, value in sizes[name]:
                if value != 1:
                    raise ValueError(f"actor.megatron.order ({self.order!r}) leaves out {name}, but {what} is {value}")
            tokens.append(name)
        return tuple(tokens)

    @property
    def dp_size(self) -> int:
        """Data-parallel size of the dense layers: size / (tp * pp * cp)."""
        return self.size // (self.tp * self.pp * self.cp)

    # --- the actor's batch view (ActorLayout)
    @property
    def dp_formula(self) -> str:
        return (f"{self.pool} pool size ({self.size}) / (actor.megatron.tp ({self.tp}) * actor.megatron.pp "
                f"({self.pp}) * actor.megatron.cp ({self.cp}))")

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)["dp"]

    def counts_in_sums(self, rank: int) -> bool:
        """The tp / cp / pp ranks of a dp group hold the same rows; the loss runs on the last stage:
        tp 0, cp 0 of the last stage counts them."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["cp"] == 0 and c["pp"] == self.pp - 1

    @property
    def expert_dp_size(self) -> int:
        """Data-parallel size of the expert layers: size / (etp * ep * pp)."""
        return self.size // (self.etp * self.ep * self.pp)  # type: ignore[operator]

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def vpp_enabled(self) -> bool:
        return self.vpp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def _dense(self) -> _Grid:
        sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp_size, "pp": self.pp}
        return _Grid(self._tokens, tuple(sizes[t] for t in self._tokens))

    def _expert(self) -> _Grid:
        sizes = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.expert_dp_size, "pp": self.pp}
        return _Grid(self._tokens, tuple(sizes[t] for t in self._tokens))  # type: ignore[misc]

    def coords(self, rank: int) -> dict[str, int]:
        """Dense coordinates tp, cp, dp, pp and expert coordinates ep, expert_tp, expert_dp."""
        self._check_rank(rank)
        d, e = self._dense().coords(rank), self._expert().coords(rank)
        return {"tp": d["tp"], "cp": d["cp"], "dp": d["dp"], "pp": d["pp"],
                "ep": e["ep"], "expert_tp": e["tp"], "expert_dp": e["dp"]}

    def groups(self) -> dict[str, list[list[int]]]:
        """Dense ``tp``, ``cp``, ``pp``, ``dp``, ``dp_cp``, ``mp`` (tp x pp) and expert ``ep``,
        ``expert_tp``, ``expert_dp`` groups, as megatron-core forms them (sorted)."""
        d, e = self._dense(), self._expert()
        return {
            "tp": d.groups(("tp",)), "cp": d.groups(("cp",)), "pp": d.groups(("pp",)),
            "dp": d.groups(("dp",)), "dp_cp": d.groups(("dp", "cp")), "mp": d.groups(("tp", "pp")),
            "ep": e.groups(("ep",)), "expert_tp": e.groups(("tp",)), "expert_dp": e.groups(("dp",)),
        }

    def build(self, *, start: int = 0, timeout: timedelta | None = None) -> dict[str, ProcessGroup]:
        """This rank's process group per axis, with our own ``new_group`` calls (not megatron-core's);
        collective over the world ({} outside the pool)."""
        return build_groups(self.groups(), start, timeout)


__all__ = ["ActorLayout", "FsdpLayout", "MegatronLayout", "RolloutLayout", "UlyssesLayout"]
