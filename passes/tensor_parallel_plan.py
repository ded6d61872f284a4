"""Pin the parameters a ``tensor_parallel.plan`` names (module glob -> colwise / rowwise /
vocab) on the tp mesh dim.

A plan style is resolved by what the captured graph does with the weight, not by its module
class: each dim of the weight is tried as the sharded one and pushed through the weight's
first forward use (through transposes and views, by the SPMD rules) to the op that consumes
it. Colwise is the dim that shards one of that op's output dims (a linear's last, a
convolution's channels); rowwise and vocab the dim that makes it Partial. So a Conv1D that
stores ``[in, out]`` gets the right dim, as does ``nn.Linear`` with ``[out, in]``, and a
``Conv2d`` weight ``[out, in, kh, kw]`` dim 0 for colwise, dim 1 for rowwise.

A fused colwise projection (one linear computing q, k and v) is found the same way, from
what the program does to the op's output, followed through single-input ops:

* ``split`` along the sharded dim into k pieces: ``Shard(dim, groups=k)`` for equal pieces
  (Megatron's interleaved layout), groups of the pieces' relative widths otherwise;
* step-1 slices that are its only uses and tile the dim (Phi-3's ``qkv_proj``:
  ``[q: H*hd | k: G*hd | v: G*hd]``, grouped-query attention): groups of their widths
  (``S(0)x2:1:1`` for 4 query and 2 key/value heads);
* a reshape cutting the dim into ``(g, heads, ...)`` whose ``g`` dim is then unbound,
  selected or split (timm's ``reshape(B, N, 3, H, hd).permute(...).unbind(0)``): g groups.
  A reshape into ``(heads, 3 * hd)`` (GPT-NeoX) leaves heads leading: a plain shard.

Every rank then holds its chunk of each piece, so q, k and v come out sharded by heads with
no communication. Each piece must reach its consumer with whole heads on every rank: a
reshape into q or kv heads that the tp mesh dim does not divide is refused, naming it, its
module, the mesh and the placement. An explicit ``shard_tensor`` on a parameter wins over
the plan.
"""
from __future__ import annotations

import fnmatch
import itertools

from ..ir import Op, OpKind, Program, StateKind, Value
from ..ir.attrs import NAME
from ..ir.dist import (
    DistAttr,
    Groups,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    format_groups,
    normalize_groups,
)
from ..ir.ops import schema_args
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pass_infra.pinning import AnnotationError, pin
from ..spmd import lookup
from ..spmd.dim_transforms import view_groups
from ..spmd.rule_registry import tensor_inputs
from ..spmd.spec import UNSHARDABLE

__all__ = ["tensor_parallel_plan", "plan_entries", "style_placement"]


def tensor_parallel_plan(program: Program, ctx: PassContext) -> Program:
    tp = ctx.strategy.tensor_parallel
    mesh = ctx.state.mesh
    if mesh is None or tp is None or not tp.plan:
        return program
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    axis = mesh.dim_index(tp.axis)
    users = program.users()
    for pattern, style, matched in plan_entries(tp.plan, params):
        for name, value in matched.items():
            if value.dist is not None:
                continue   # an explicit shard_tensor wins over the plan
            dim, groups, how = _plan_dim(value, style, axis, mesh, users, name, pattern)
            placement = Replicate() if dim is None else Shard(dim, groups)
            dist = DistAttr.replicated(mesh).with_placement(axis, placement)
            what = ("replicated" if dim is None else f"dim {dim} sharded" + (
                f" in {format_groups(groups)} groups ({how})" if groups != 1 else ""))
            pin(value, dist, Reason("plan", f"tensor_parallel.plan {pattern!r}: {style}, "
                                            f"{what} on {tp.axis}"))
    return program


def style_placement(value: Value, style: str, axis: int, mesh: ProcessMesh,
                    users: dict[Value, list[Op]], name: str) -> DistAttr:
    """Where plan style ``style`` puts parameter ``name`` on mesh dim ``axis`` (what the pass
    would pin); AnnotationError if the style does not apply to it."""
    dim, groups, _ = _plan_dim(value, style, axis, mesh, users, name, name.rpartition(".")[0])
    placement = Replicate() if dim is None else Shard(dim, groups)
    return DistAttr.replicated(mesh).with_placement(axis, placement)


def plan_entries(plan: dict[str, str], params: dict[str, Value]
                  ) -> list[tuple[str, str, dict[str, Value]]]:
    """(pattern, style, the parameters of the modules it matches) per plan entry."""
    entries = []
    for pattern, style in plan.items():
        matched = {n: v for n, v in params.items()
                   if fnmatch.fnmatchcase(n.rpartition(".")[0], pattern)}
        if not matched:
            modules = sorted({n.rpartition(".")[0] for n in params})
            raise AnnotationError(
                f"tensor_parallel.plan entry {pattern!r} ({style}) matches no module with "
                f"parameters (a tied weight belongs to the module that registered it "
                f"first); modules are: {', '.join(modules[:40])}")
        entries.append((pattern, style, matched))
    return entries


def _plan_dim(value: Value, style: str, axis: int, mesh: ProcessMesh,
              users: dict[Value, list[Op]], name: str, pattern: str
              ) -> tuple[int | None, Groups, str]:
    """(the weight dim the style shards or None: replicated, its groups, how the program
    cuts its output into the groups)."""
    tried = []
    for dim in range(len(value.type.shape)):
        dist = DistAttr.replicated(mesh).with_placement(axis, Shard(dim))
        consumer, placed = _probe(value, dist, users)
        if consumer is None:
            break
        if placed is None:
            tried.append(f"its first forward use, {consumer.target} "
                         f"({consumer.module or 'top level'}), has no SPMD rule")
            break
        tried.append(f"dim {dim} -> {consumer.target} output {placed}")
        if style == "colwise" and isinstance(placed, Shard):
            fused = _Fused(axis, mesh, users, f"tensor_parallel.plan {pattern!r} ({style}) "
                                              f"on {name!r}")
            return (dim, *fused.groups(consumer, placed))
        if style in ("rowwise", "vocab") and isinstance(placed, Partial):
            return dim, 1, ""
    if style == "rowwise" and len(value.type.shape) == 1:
        return None, 1, ""  # a row-parallel bias is added once, after the reduction
    raise AnnotationError(
        f"tensor_parallel.plan {pattern!r}: cannot apply {style} to parameter {name!r} "
        f"{list(value.type.shape)}: no dim gives a "
        f"{'sharded output dim' if style == 'colwise' else 'partial output'} "
        f"at its first use ({'; '.join(tried) or 'it has no forward use'})")


def _probe(value: Value, dist: DistAttr, users: dict[Value, list[Op]]
           ) -> tuple[Op | None, Placement | None]:
    """Where sharding ``value`` as ``dist`` lands: follow its first forward use through
    single-input ops (transposes, views, casts) to the op that combines it with something
    else, and read from that op's spec what becomes of the sharded dim (an output dim, or
    a contracted one: Partial). Costs play no part: this asks what the graph does. A consumer
    without an SPMD rule comes back with no placement."""
    axis = next(i for i, p in enumerate(dist.placements) if not p.is_replicate())
    while True:
        consumer = next((op for op in users.get(value, ()) if op.kind is OpKind.CALL
                         and op.role.value == "fwd"), None)
        if consumer is None:
            return None, None
        rule = lookup(consumer)
        if rule is None:
            return consumer, None
        ins = tensor_inputs(consumer)
        if len(ins) == 1 and len(consumer.outputs) == 1:
            value, dist = consumer.outputs[0], rule.forward(consumer, [dist], dist.mesh).outputs[0]
            continue
        return consumer, _landing(consumer, rule, ins.index(value), dist, axis)


_SPLITS = ("aten.split.Tensor", "aten.split_with_sizes.default")
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_TAKE_APART = ("aten.unbind.int", "aten.select.int", *_SPLITS)


class _Fused:
    """Follows a colwise op's output to how the program cuts it into pieces (module
    docstring); ``where`` names the plan entry and parameter for errors."""

    def __init__(self, axis: int, mesh: ProcessMesh, users: dict[Value, list[Op]], where: str):
        self.axis, self.mesh, self.users, self.where = axis, mesh, users, where

    def _uses(self, value: Value) -> list[Op]:
        return [u for u in self.users.get(value, ()) if u.kind is OpKind.CALL
                and u.role.value == "fwd"]

    def _chain(self, value: Value, placed: Placement):
        """(value, its first forward use, the value's placement, the use's output placement)
        from ``value`` (placed ``placed`` on the tp mesh dim) through single-input ops, by
        their SPMD rules; the last use yielded has another arity or no rule (after: None)."""
        dist = DistAttr.replicated(self.mesh).with_placement(self.axis, placed)
        while (uses := self._uses(value)):
            op = uses[0]
            rule = lookup(op)
            if rule is None or len(tensor_inputs(op)) != 1 or len(op.outputs) != 1:
                yield value, op, dist, None
                return
            after = rule.forward(op, [dist], self.mesh).outputs[0]
            yield value, op, dist, after
            value, dist = op.outputs[0], after

    def _kept(self, after: DistAttr | None) -> bool:
        return after is not None and after.placements[self.axis].is_shard()

    def groups(self, consumer: Op, placed: Shard) -> tuple[Groups, str]:
        """(the weight's groups, how the output is cut) for the colwise op ``consumer``
        whose output dim ``placed`` is sharded: 1 when nothing cuts it into pieces."""
        for value, op, before, after in self._chain(consumer.outputs[0], placed):
            d = before.placements[self.axis].dim
            found = self._slices(value, d) or self._cut(op, value, d)
            if found:
                return found
            if not self._kept(after):
                break
        return 1, ""

    def _slices(self, value: Value, d: int) -> tuple[Groups, str] | None:
        """Step-1 slices along ``d`` that are the value's only uses and tile it (Phi-3's
        ``qkv[..., :q]``, ``qkv[..., q:q+kv]``, ``qkv[..., q+kv:]``): groups of their widths."""
        size = value.type.shape[d]
        spans = []
        for op in self._uses(value):
            a = schema_args(op) if op.target == "aten.slice.Tensor" else None
            if a is None or a["dim"] % len(value.type.shape) != d or (a["step"] or 1) != 1:
                return None
            start = a["start"] or 0
            start = min(max(start + size if start < 0 else start, 0), size)
            spans.append((start, op.outputs[0].type.shape[d], op))
        spans.sort(key=lambda span: span[0])
        if len(spans) < 2 or [lo for lo, _, _ in spans] != list(
                itertools.accumulate([w for _, w, _ in spans[:-1]], initial=0)) or \
                sum(w for _, w, _ in spans) != size or any(w == 0 for _, w, _ in spans):
            return None
        for _, _, op in spans:
            self._check_heads(op.outputs[0], d)
        widths = tuple(w for _, w, _ in spans)
        return normalize_groups(widths), \
            f"its output is sliced into pieces of {'/'.join(map(str, widths))}"

    def _cut(self, op: Op, value: Value, d: int) -> tuple[Groups, str] | None:
        if op.target in _SPLITS and schema_args(op)["dim"] % len(value.type.shape) == d \
                and len(op.outputs) > 1:
            widths = tuple(o.type.shape[d] for o in op.outputs)
            if 0 in widths:
                return None
            for piece in op.outputs:
                self._check_heads(piece, d)
            groups = normalize_groups(widths)
            equal = "equal " if isinstance(groups, int) else ""
            return groups, f"its output is split in {len(widths)} {equal}pieces"
        if op.target in _VIEWS:
            return self._view_groups(op, value, d)
        return None

    def _view_groups(self, op: Op, value: Value, d: int) -> tuple[Groups, str] | None:
        """A reshape cutting ``d`` into ``(g, heads, ...)`` whose leading dim the program
        then takes apart (timm's ``qkv.reshape(B, N, 3, H, hd)...unbind(0)``): g groups."""
        src, dst = value.type.shape, op.outputs[0].type.shape
        ins, outs = next(g for g in view_groups(src, dst) if d in g[0])
        if ins != (d,) or len(outs) < 2 or dst[outs[0]] < 2 or \
                not self._taken_apart(op.outputs[0], outs[0]):
            return None
        n = self.mesh.shape[self.axis]
        if dst[outs[1]] % n:
            grouped = DistAttr.replicated(self.mesh).with_placement(
                self.axis, Shard(d, dst[outs[0]]))
            self._refuse(op, "the", grouped, f"{dst[outs[0]]} groups of ", dst[outs[1]])
        return dst[outs[0]], (f"its output is viewed as {dst[outs[0]]} groups of heads "
                              f"({op.target}) and taken apart")

    def _taken_apart(self, value: Value, dim: int) -> bool:
        """Whether dim ``dim`` of ``value``, followed through single-input ops, is unbound,
        selected or split along (it holds q, k and v, not heads)."""
        for value, op, before, after in self._chain(value, Shard(dim)):
            if op.target in _TAKE_APART:
                d = before.placements[self.axis].dim
                return schema_args(op)["dim"] % len(value.type.shape) == d
            if not self._kept(after):
                break
        return False

    def _check_heads(self, piece: Value, d: int) -> None:
        """A piece followed through single-input ops keeps its shard up to the op that
        uses it with something else; a reshape into heads that do not divide over the tp
        mesh dim would lose it (attention on gathered heads): refused by name."""
        for value, op, before, after in self._chain(piece, Shard(d)):
            if self._kept(after):
                continue
            if after is not None and op.target in _VIEWS:
                shard = before.placements[self.axis].dim
                src, dst = value.type.shape, op.outputs[0].type.shape
                ins, outs = next(g for g in view_groups(src, dst) if shard in g[0])
                if ins == (shard,) and len(outs) >= 2:
                    self._refuse(op, "a piece of the", before, "", dst[outs[0]])
            return

    def _refuse(self, op: Op, whose: str, placed: DistAttr, what: str, heads: int) -> None:
        n, name = self.mesh.shape[self.axis], self.mesh.dim_names[self.axis]
        raise AnnotationError(
            f"{self.where}: {op.target} ({op.module or 'top level'}) views {whose} fused "
            f"projection's output {list(op.inputs[0].type.shape)}, placed {placed}, as "
            f"{what}{heads} heads {list(op.outputs[0].type.shape)}: {heads} heads do not "
            f"divide over mesh dim {name!r} of size {n} of {self.mesh}, so a rank would not "
            "hold whole heads of q, k and v; use a tp size that divides every head count")


def _landing(op: Op, rule, index: int, dist: DistAttr, axis: int) -> Placement:
    placement = dist.placements[axis]
    if not isinstance(placement, Shard):
        return placement
    if hasattr(rule, "spec"):
        spec = rule.spec(op)
        letter = spec.inputs[index][placement.dim]
        out = spec.outputs[0]
        if letter == UNSHARDABLE:
            return Replicate()
        if letter in out:
            return Shard(out.index(letter))
        return Partial(spec.reduce[0]) if spec.shardable(letter) else Replicate()
    others = [dist if i == index else None for i in range(len(tensor_inputs(op)))]
    return rule.forward(op, others, dist.mesh).outputs[0].placements[axis]
