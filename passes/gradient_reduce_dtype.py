"""Mixed precision: sum parameter gradients across ranks in ``amp.reduce_dtype``.

Under amp a parameter's gradient is made in the half dtype and reaches its fp32 parameter
through a cast (the backward of the forward's cast of the parameter: autocast's under O1,
the top-of-step one under O2). Under data parallelism the half gradient is a Partial sum over
``dp``; the cross-rank reduction can land on either side of that cast:

    %g: bf16 {P} -> comm.all_reduce -> %g': bf16 {R} -> _to_copy(f32)        (half)
    %g: bf16 {P} -> _to_copy(f32) -> %g32: f32 {P} -> comm.all_reduce         (float32)

Completion prices communication by bytes, so it reduces the half gradient; this pass places
each such reduction as the strategy says: ``float32`` (the default, and the only choice under
O1, like torch DDP under autocast: the gradient a parameter receives is fp32) carries the
Partial through the cast (a widening cast is exact on each rank's term) so reshard reduces
the fp32 gradient; the half dtype moves it onto the cast's input, to the placement the
gradient's consumers want (a ZeRO gradient's shard: reduce-scatter in half, cast the shard).
Activation casts (tensor parallelism's partial input gradients) are left as completion
placed them: they are not what ``reduce_dtype`` is about. In a pipeline the sum over
micro-batches (the ``mb`` mesh dim) lands on the same side as the ranks' sum, so a half
``reduce_dtype`` also accumulates micro-batches in half, and the ranks' sum still runs once
a step.

Its report (``NN_gradient_reduce_dtype.amp.txt``) lists where the casts went: per module,
how many casts to which dtype in the forward and the backward, and where each parameter
gradient's reduction lands.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import NAME, STATE
from ..ir.core import dtype_abbrev
from ..ir.dist import DistAttr, Partial, Placement, Replicate
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..spmd.rule_registry import tensor_inputs

__all__ = ["gradient_reduce_dtype", "format_casts"]

CAST = "aten._to_copy.default"
ANNOTATE = "autopar.annotate"


def gradient_reduce_dtype(program: Program, ctx: PassContext) -> Program:
    amp = ctx.strategy.amp
    if not amp.is_enabled or ctx.state.mesh is None or ctx.mode != "train":
        return program
    in_half = amp.reduce_dtype != "float32"
    users = program.users()
    for op in program.ops:
        if _param_of_gradient_cast(op) is not None and op.needs:
            if in_half:
                _reduce_before(op, users)
            else:
                _reduce_after(op)
    return program


def _param_of_gradient_cast(op: Op) -> str | None:
    """The parameter whose gradient ``op`` widens, when ``op`` is the backward of a cast of a
    parameter to a narrower dtype (None otherwise)."""
    fwd = op.forward_op
    if (op.kind is not OpKind.CALL or op.target != CAST or op.role is not Role.BACKWARD
            or fwd is None or fwd.target != CAST or not _widens(op)):
        return None
    source = fwd.inputs[0].producer
    while source is not None and source.target == ANNOTATE:    # a ZeRO-3 gather's pin
        source = source.inputs[0].producer
    if source is None or source.kind is not OpKind.STATE or \
            source.attrs[STATE].kind is not StateKind.PARAM:
        return None
    return source.attrs[NAME]


def _widens(op: Op) -> bool:
    src, dst = op.inputs[0].type.dtype, op.result.type.dtype
    return src.is_floating_point and dst.is_floating_point and dst.itemsize > src.itemsize


def _reduce_after(op: Op) -> None:
    """Each mesh dim the half gradient is reduced on before the cast: carry the Partial
    through the cast instead (its consumers keep their needs, so reshard reduces the fp32
    gradient to them)."""
    grad, need = op.inputs[0], op.needs[0]
    moved = [m for m, p in enumerate(grad.dist.placements)
             if isinstance(p, Partial) and not isinstance(need.placements[m], Partial)]
    if not moved:
        return
    op.needs = (_with(need, {m: grad.dist.placements[m] for m in moved}), *op.needs[1:])
    _place(op.result, {m: grad.dist.placements[m] for m in moved},
           f"amp reduce_dtype float32: the {_dtype(grad)} gradient is cast to "
           f"{_dtype(op.result)} on each rank, then reduced")


def _reduce_before(op: Op, users: dict[Value, list[Op]]) -> None:
    """Each mesh dim the half gradient is Partial on: reduce it before the cast, to the
    placement the fp32 gradient's consumers want there (all of them alike, else R): a ZeRO
    update's shard makes it a reduce-scatter, where completion, deciding the cast before its
    consumers, may have all-reduced it and left them a slice."""
    grad, need, out = op.inputs[0], op.needs[0], op.result
    wanted = {m: _consumers_want(out, m, users) for m, p in enumerate(grad.dist.placements)
              if isinstance(p, Partial)}
    wanted = {m: p for m, p in wanted.items() if need.placements[m] != p}
    if not wanted:
        return
    op.needs = (_with(need, wanted), *op.needs[1:])
    _place(out, wanted, f"amp reduce_dtype {_dtype(grad)}: the {_dtype(grad)} gradient is "
                        f"reduced, then cast to {_dtype(out)}")


def _consumers_want(value: Value, m: int, users: dict[Value, list[Op]]) -> Placement:
    found = {_need_of(user, value).placements[m] for user in users.get(value, ())
             if user.needs}
    if len(found) == 1 and not isinstance(next(iter(found)), Partial):
        return found.pop()
    return Replicate()


def _need_of(op: Op, value: Value) -> DistAttr:
    return op.needs[tensor_inputs(op).index(value)]


def _with(dist: DistAttr, changes: dict[int, Placement]) -> DistAttr:
    return DistAttr(dist.mesh, tuple(changes.get(m, p) for m, p in enumerate(dist.placements)))


def _place(value: Value, changes: dict[int, Placement], text: str) -> None:
    value.dist = _with(value.dist, changes)
    why = value.why
    value.why = Reason(why.kind if why else "rule", f"{text}; {why.text}" if why else text,
                       why.op if why else value.producer, why.sources if why else (),
                       why.choices if why else ())


def _dtype(value: Value) -> str:
    return str(value.type.dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------
# the report: where the casts went
# --------------------------------------------------------------------------------------
def format_casts(program: Program, ctx: PassContext) -> str:
    amp = ctx.strategy.amp
    if not amp.is_enabled:
        return ""
    counts: dict[str, Counter] = defaultdict(Counter)
    reductions = []
    for op in program.ops:
        if op.kind is not OpKind.CALL or op.target != CAST:
            continue
        src, dst = op.inputs[0].type.dtype, op.result.type.dtype
        if src == dst:
            continue
        kind = f"{op.role.value} {dtype_abbrev(src)}->{dtype_abbrev(dst)}"
        counts[op.module or "<model>"][kind] += 1
        param = _param_of_gradient_cast(op)
        if param is not None and op.needs:
            reductions.append(_reduction_line(param, op))
    lines = [f"amp {amp.level} {amp.dtype}, reduce_dtype {amp.reduce_dtype} ({ctx.mode} program)",
             "", "casts per module (role src->dst: count):"]
    for module, kinds in counts.items():
        lines.append(f"  {module:<32} " + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())))
    lines.append(f"  total: {sum(sum(c.values()) for c in counts.values())}")
    if reductions:
        lines += ["", "parameter gradient reductions across ranks:"] + reductions
    return "\n".join(lines) + "\n"


def _reduction_line(param: str, op: Op) -> str:
    grad, need, out = op.inputs[0], op.needs[0], op.result
    before = [m for m, p in enumerate(grad.dist.placements)
              if isinstance(p, Partial) and not isinstance(need.placements[m], Partial)]
    after = [m for m, p in enumerate(out.dist.placements) if isinstance(p, Partial)]
    dims = grad.dist.mesh.dim_names
    where = ([f"{dtype_abbrev(grad.type.dtype)} over {dims[m]} (before the cast)" for m in before]
             + [f"{dtype_abbrev(out.type.dtype)} over {dims[m]} (after the cast)" for m in after])
    return f"  {param:<32} " + ("; ".join(where) or "none (not partial)")


