"""The planner's search space: which parallel layouts of ``auto.devices`` ranks to consider,
and each as a strategy a user could have written by hand.

A layout is the degrees (data, tensor, pipeline parallel) whose product is the device count,
a ZeRO stage over the data-parallel axis, the pipeline's micro-batches, and whether the
repeated layers are recomputed. Its strategy names the mesh dims ``[pp, dp, tp]`` (dims of
one rank left out; tensor parallel last: the fastest link). What the user wrote beside
``auto`` is kept: a section present is a constraint (``Constraints``), and parameters
annotated with ``shard_tensor`` fix the mesh to the annotations' one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..ir.dist import DistAttr
from ..strategy import Strategy
from ..strategy.sections import AutoConfig
from .truncate import RepeatedStack

__all__ = ["Layout", "Constraints", "degree_triples", "base_layouts", "memory_variants",
           "layout_strategy"]

ROLES = ("pp", "dp", "tp")      # mesh dim order of a layout's strategy
SECTIONS = {"data_parallel": "dp", "tensor_parallel": "tp", "pipeline": "pp"}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 0
    micro_batches: int = 1
    recompute: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def name(self) -> str:
        parts = [f"{role}{n}" for role, n in (("dp", self.dp), ("tp", self.tp),
                                               ("pp", self.pp)) if n > 1] or ["serial"]
        text = " x ".join(parts)
        if self.zero:
            text += f" zero{self.zero}"
        if self.pp > 1:
            text += f" mb{self.micro_batches}"
        if self.recompute:
            text += " recompute"
        return text


@dataclass(frozen=True)
class Constraints:
    """What the search may not change: degrees fixed by a mesh (the strategy's, or the one
    the annotations use, with its dim names), a ZeRO stage, recompute, micro-batches, a
    tensor-parallel plan."""

    mesh_names: dict[str, str] | None = None    # role -> the user's dim name, when fixed
    mesh_dims: tuple[tuple[int, str], ...] | None = None   # (size, name) of a fixed mesh
    degrees: tuple[int, int, int] | None = None  # (dp, tp, pp) when the mesh is fixed
    zero: int | None = None
    recompute: bool | None = None
    micro_batches: int | None = None
    tp_plan: dict[str, str] | None = None

    @classmethod
    def of(cls, strategy: Strategy, annotations: dict[str, DistAttr]) -> "Constraints":
        names = degrees = dims = None
        dp = strategy.data_parallel
        if dp is not None and len(dp.mesh_axes) > 1:
            raise ValueError(f"auto: data_parallel.axis {list(dp.mesh_axes)} spans several mesh "
                             "dims (HSDP), which the auto search does not cover yet: give a "
                             "single data_parallel axis, or plan HSDP by hand (without auto)")
        if strategy.mesh is not None:
            dims = tuple(zip(strategy.mesh.shape, strategy.mesh.dim_names))
            names = {role: getattr(strategy, section).axis for role, section in
                     (("dp", "data_parallel"), ("tp", "tensor_parallel"), ("pp", "pipeline"))
                     if getattr(strategy, section) is not None}
            degrees = (strategy.degree("data_parallel"), strategy.degree("tensor_parallel"),
                       strategy.degree("pipeline"))
        elif annotations:
            names, degrees, dims = _annotated_mesh(annotations)
        pipe, tp = strategy.pipeline, strategy.tensor_parallel
        return cls(
            names, dims, degrees,
            zero=strategy.sharding.stage if strategy.sharding is not None else None,
            recompute=True if strategy.recompute.is_enabled else None,
            micro_batches=pipe.micro_batches if pipe is not None
            and "micro_batches" in pipe.model_fields_set else None,
            tp_plan=dict(tp.plan) if tp is not None and tp.plan else None)


def _annotated_mesh(annotations: dict[str, DistAttr]) -> tuple[dict[str, str], tuple, tuple]:
    """The one mesh every annotation uses, its dims given roles by name (``dp``/``data``:
    data parallel, anything else: tensor parallel)."""
    meshes = {a.mesh for a in annotations.values()}
    if len(meshes) != 1:
        raise ValueError(f"auto: parameters are annotated on {len(meshes)} different meshes "
                         f"({sorted(str(m) for m in meshes)}); the auto search keeps annotations "
                         "as constraints and needs them on one mesh")
    mesh = meshes.pop()
    names, sizes = {}, {"dp": 1, "tp": 1, "pp": 1}
    for dim, size in zip(mesh.dim_names, mesh.shape):
        role = "dp" if dim in ("dp", "data") else "tp"
        if role in names:
            raise ValueError(f"auto: the annotated mesh {mesh} has two dims the auto search would "
                             f"use for {role!r} ({names[role]!r}, {dim!r}); name the "
                             "data-parallel dim 'dp' and the other the tensor-parallel one")
        names[role], sizes[role] = dim, size
    return names, (sizes["dp"], sizes["tp"], sizes["pp"]), tuple(zip(mesh.shape, mesh.dim_names))


def degree_triples(devices: int, axes: tuple[str, ...]) -> Iterator[tuple[int, int, int]]:
    """Every (dp, tp, pp) with product ``devices``, a degree above 1 only on ``axes``."""
    for dp in range(1, devices + 1):
        for tp in range(1, devices // dp + 1):
            if devices % (dp * tp):
                continue
            pp = devices // (dp * tp)
            if all(n == 1 or role in axes for role, n in (("dp", dp), ("tp", tp), ("pp", pp))):
                yield dp, tp, pp


def base_layouts(auto: AutoConfig, fixed: Constraints, rows: int) -> tuple[list[Layout],
                                                                          list[str]]:
    """The layouts searched first (no ZeRO, no recompute unless fixed; every micro-batch
    count), and why the triples left out were (the batch does not split)."""
    # cheapest to plan first (the time budget may end the search): pipelines last
    triples = [fixed.degrees] if fixed.degrees else sorted(
        degree_triples(auto.devices, auto.axes), key=lambda t: (t[2], t[1]))
    layouts, skipped = [], []
    per_node = auto.devices // auto.nodes
    for dp, tp, pp in triples:
        if per_node % tp and not fixed.degrees:
            skipped.append(f"tp{tp}: would cross a node ({auto.devices} devices on "
                           f"{auto.nodes} nodes: {per_node} per node)")
            continue
        if rows % dp:
            skipped.append(f"{_degrees(dp, tp, pp)}: the batch of {rows} rows does not split "
                           f"into {dp}")
            continue
        for mb in _micro_batches(auto, fixed, pp, rows // dp):
            layouts.append(Layout(dp, tp, pp, fixed.zero or 0, mb, bool(fixed.recompute)))
        if pp > 1 and not _micro_batches(auto, fixed, pp, rows // dp):
            skipped.append(f"dp{dp} x pp{pp}: {rows // dp} rows per replica split into no "
                           "micro-batch count the schedule can use")
    return layouts, skipped


def _degrees(dp: int, tp: int, pp: int) -> str:
    """``dp512 x pp2``: the degrees above 1 (``dp1`` when none is)."""
    named = [f"{axis}{n}" for axis, n in (("dp", dp), ("tp", tp), ("pp", pp)) if n > 1]
    return " x ".join(named) or "dp1"


def _micro_batches(auto: AutoConfig, fixed: Constraints, pp: int, rows: int) -> list[int]:
    if pp == 1:
        return [1]
    if fixed.micro_batches is not None:
        options = (fixed.micro_batches,)
    else:
        options = auto.micro_batches or (pp, 2 * pp)
    return [mb for mb in options if rows % mb == 0 and mb >= pp]


def memory_variants(layout: Layout, auto: AutoConfig, fixed: Constraints,
                    stack: RepeatedStack | None) -> list[Layout]:
    """Variants of ``layout`` that hold less per rank, in the order they cost time: ZeRO
    stages above its own (when data parallel), then recomputing the repeated layers on the
    most sharded of them."""
    out = []
    zeros = [] if fixed.zero is not None or layout.dp == 1 else \
        [z for z in sorted(auto.zero_stages) if z > layout.zero]
    for z in zeros:
        out.append(_with(layout, zero=z))
    if auto.recompute and fixed.recompute is None and stack is not None and not layout.recompute:
        out.append(_with(out[-1] if out else layout, recompute=True))
    return out


def _with(layout: Layout, **change) -> Layout:
    return Layout(**{**layout.__dict__, **change})


def layout_strategy(layout: Layout, base: Strategy, fixed: Constraints,
                    tp_plan: dict[str, str] | None, stack: RepeatedStack | None,
                    memory_limit_gb: float | None) -> Strategy:
    """The strategy YAML of ``layout``: ``base``'s sections kept, ``auto`` dropped."""
    data = {name: value for name, value in base.model_dump(exclude={"auto"}).items()
            if value is not None}
    names = fixed.mesh_names or {role: role for role in ROLES}
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    if fixed.mesh_dims is not None:
        dims = list(fixed.mesh_dims)
    else:
        dims = [(sizes[r], names[r]) for r in ROLES if sizes[r] > 1 and r in names]
    if dims:
        data["mesh"] = {"shape": [n for n, _ in dims], "dim_names": [d for _, d in dims]}
    for section, role in SECTIONS.items():
        given = data.pop(section, None)
        if sizes[role] > 1:
            data[section] = {**(given or {}), "axis": names[role]}
    if layout.tp > 1:
        data["tensor_parallel"]["plan"] = data["tensor_parallel"].get("plan") or dict(
            tp_plan or {})
    if layout.pp > 1:
        data["pipeline"].setdefault("schedule", base.auto.schedule if base.auto else "1F1B")
        data["pipeline"]["micro_batches"] = layout.micro_batches
    given = data.pop("sharding", None)
    if layout.zero and layout.dp > 1:
        data["sharding"] = {**(given or {}), "axis": names["dp"], "stage": layout.zero}
    if layout.recompute and not base.recompute.is_enabled and stack is not None:
        data["recompute"] = {"enable": True, "modules": [f"{stack.path}.*"], "policy": "full"}
    if memory_limit_gb is not None:
        data["memory_limit_gb"] = memory_limit_gb
    return Strategy.model_validate(data)
