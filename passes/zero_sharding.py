"""ZeRO as placements: pin each optimizer state that is shaped like its parameter ``Shard(0)``
over the sharding axis (stage >= 1), and for stage 3 the parameters too.

Nothing else changes: the update rule (``spmd/rules/optimizer.py``) runs where its most
sharded operand lives, so each rank updates its piece; completion asks the gradient for that
placement (Partial -> reduce-scatter) and the updated parameter for the parameter's own
placement (replicated -> all-gather). A static plan never needs the whole gradient once the
update is sharded, so stages 1 and 2 plan the same program: both reduce-scatter. Where the
gradient passes through ops before its update (clipping scales it by ``max_norm / total
norm``), those ops would read it first and take it whole; stage 2 pins it ``Shard(0)`` on
the axis as the backward hands it over, so clipping works on the pieces (its norms are
``Partial(norm2)``: one scalar all-reduce per mesh dim) and no gradient is held whole.

Stage 3 keeps the parameters sharded too, so nothing gathers the new values; an annotation
pinning Replicate on the axis just before each phase's first read (forward, and backward
where the backward reads the parameter itself) makes reshard all-gather it there, instead of
completion keeping the weight sharded and moving activations. Reshard moves a value once,
so the backward would read the forward's gathered copy (or a saved transpose of it) and the
copy would live from forward to backward; ``regather_for_backward`` gives the backward its
own gather, ``prefetch_gathers`` issues each layer's gathers one layer ahead, and
``scatter_gradients_early`` reduce-scatters each gradient as soon as it is made.

Under amp O2 a parameter the model reads only through its cast to the half dtype (the
top-of-step cast) is gathered as that half copy: the cast runs on each rank's piece right
after the parameter, and the pin goes on the copy, so stage 3 gathers half the bytes
(FSDP2's ``param_dtype``) and the same values. O1 keeps gathering fp32 parameters, as
FSDP2 under autocast does: autocast casts a weight where it is used, and a layer's fp32
norm parameters would otherwise travel in a unit of their own (a unit is of one dtype).

Uneven first dims are allowed (``torch.chunk`` pieces). A state whose dim 0 another mesh dim
already cuts (a colwise tensor-parallel weight) is cut on its first free dim instead, so the
ZeRO piece is a slice of the tensor-parallel piece (``_zero_dim``); with no free dim it is
cut further on dim 0, nested as in DTensor.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import DIST, NAME, ORIGIN, PINNED_DIMS, STATE
from ..ir.dist import DistAttr, ProcessMesh, Replicate, Shard
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pass_infra.pinning import AnnotationError, pin, trivial_dims_replicated

__all__ = ["zero_sharding", "scheduled_axis", "from_backward", "half_copy",
           "parameter_of"]


def scheduled_axis(ctx: PassContext, stage: int) -> int | None:
    """The sharding axis's mesh dim, for the passes that schedule ZeRO's collectives from
    ``stage`` on; None where they leave the plan alone: no such stage, or a pipeline (there
    a parameter's gather and a gradient's sum run once a step, outside the micro-batches)."""
    sharding, mesh = ctx.strategy.sharding, ctx.state.mesh
    if (mesh is None or sharding is None or sharding.stage < stage
            or ctx.state.pipeline is not None):
        return None
    return mesh.dim_index(sharding.axis)


def zero_sharding(program: Program, ctx: PassContext) -> Program:
    sharding, mesh = ctx.strategy.sharding, ctx.state.mesh
    if sharding is None or not sharding.is_enabled or mesh is None:
        return program
    if sharding.axis not in mesh.dim_names:
        raise AnnotationError(
            f"sharding stage {sharding.stage} over {sharding.axis!r}: the mesh "
            f"{list(mesh.shape)} ({', '.join(mesh.dim_names)}) has no such axis")
    axis = mesh.dim_index(sharding.axis)
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    sharded: dict[Value, DistAttr] = {}
    for op in program.states(StateKind.OPTIM):
        name = op.attrs[NAME]
        param = params.get(op.attrs[STATE].param)
        if param is not None and op.result.type.shape == param.type.shape:
            _pin_shard0(op.result, param, mesh, axis, sharding.stage, f"optimizer state {name!r}")
            # a scalar (Adam's step) or a state already cut on the axis is left unpinned
            if op.result.dist is not None and op.result.dist.placements[axis].is_shard():
                sharded.setdefault(param, op.result.dist)
    if sharding.stage >= 2:
        for update in [op for op in program.ops if op.role is Role.OPTIMIZER
                       and op.args and op.args[0] in sharded]:
            _shard_gradient(program, update, sharded[update.args[0]], axis)
    amp = ctx.strategy.amp
    half_params = amp.is_enabled and amp.level == "O2"
    if sharding.stage >= 3:
        users = program.users()
        for name, param in params.items():
            _pin_shard0(param, param, mesh, axis, sharding.stage, f"parameter {name!r}")
            if param.dist is not None and param.dist.placements[axis].is_shard():
                read = _read_copy(program, param, users) if half_params else param
                _gather_for_uses(program, name, param, read, axis, users)
    elif half_params:
        users = program.users()
        for name, param in params.items():
            if half_copy(param, users) is None:
                continue
            _pin_shard0(param, param, mesh, axis, sharding.stage,
                        f"fp32 master parameter {name!r} (amp O2)")
            if param.dist is not None and param.dist.placements[axis].is_shard():
                _gather_once(program, name, param, _read_copy(program, param, users), axis,
                             users)
    return program


def _read_copy(program: Program, param: Value, users: dict[Value, list[Op]]) -> Value:
    """What the model reads of ``param`` under amp O2: the half-dtype copy when a cast is
    the parameter's only forward or backward reader, hoisted to right after the parameter
    so every gather of it can start as early as a gather of the parameter could; else the
    parameter. Stage 3 gathers that copy, cast on each rank's piece: half the bytes
    (FSDP2's ``param_dtype``), the same values."""
    copy = half_copy(param, users)
    if copy is None:
        return param
    program.ops.remove(copy.producer)
    program.insert_after(param.producer, copy.producer)
    return copy


def half_copy(param: Value, users: dict[Value, list[Op]]) -> Value | None:
    """The half-dtype copy of ``param`` that is its only forward or backward reader."""
    readers = [op for op in users.get(param, ()) if op.role in (Role.FORWARD, Role.BACKWARD)]
    return readers[0].result if len(readers) == 1 and _narrows(readers[0]) else None


def _narrows(op: Op) -> bool:
    if op.kind is not OpKind.CALL or op.target != "aten._to_copy.default" or op.kwargs.keys() \
            - {"dtype", "layout", "device"} or len(op.args) != 1:
        return False
    src, dst = op.args[0].type.dtype, op.result.type.dtype
    return src.is_floating_point and dst.is_floating_point and dst.itemsize < src.itemsize


def parameter_of(value: Value) -> str | None:
    """The parameter ``value`` is, or whose half copy it is (``_read_copy``); else None."""
    op = value.producer
    if op is not None and op.kind is OpKind.CALL and _narrows(op):
        op = op.args[0].producer
    if op is None or op.kind is not OpKind.STATE or op.attrs[STATE].kind is not StateKind.PARAM:
        return None
    return op.attrs[NAME]


def _gather_for_uses(program: Program, name: str, param: Value, read: Value, axis: int,
                     users: dict[Value, list[Op]]) -> None:
    """Stage 3: the forward reads the parameter (``read``: or its half copy) gathered on the
    axis, and the backward gathers it again (an annotation pinning Replicate there, just
    before each phase's first use), so the gathered copy need not live from forward to
    backward; the update reads the piece. Without this, completion may keep the weight
    sharded and move activations instead."""
    for role in (Role.FORWARD, Role.BACKWARD):
        readers = [op for op in users.get(read, ()) if op.role is role]
        if not readers:
            continue
        first = min(readers, key=program.ops.index)
        dist = param.dist.with_placement(axis, Replicate())
        note = Op(OpKind.CALL, "autopar.annotate", (read,), outputs=[Value(read.type)],
                  role=role, module=first.module, forward_op=first.forward_op,
                  attrs={DIST: dist, PINNED_DIMS: (axis,), ORIGIN: f"zero-3 gather {name}"})
        program.insert_after(program.ops[program.ops.index(first) - 1], note)
        for op in readers:
            op.map_inputs(lambda v, note=note: note.result if v is read else v)


def _gather_once(program: Program, name: str, param: Value, read: Value, axis: int,
                 users: dict[Value, list[Op]]) -> None:
    """Stages 1 and 2 under amp O2 (Megatron's distributed optimizer): the fp32 master
    parameter stays cut on the axis, each rank casts its piece and the half copy ``read``
    is gathered once, at the top of the step, for every forward and backward use: the
    gather moves half the bytes of gathering the updated fp32 piece, and no rank holds the
    whole fp32 parameter."""
    readers = [op for op in users.get(read, ()) if op.role in (Role.FORWARD, Role.BACKWARD)]
    if not readers:
        return
    dist = param.dist.with_placement(axis, Replicate())
    note = Op(OpKind.CALL, "autopar.annotate", (read,), outputs=[Value(read.type)],
              role=Role.FORWARD, module=read.producer.module,
              attrs={DIST: dist, PINNED_DIMS: (axis,), ORIGIN: f"zero gather {name}"})
    program.insert_after(read.producer, note)
    for op in readers:
        op.map_inputs(lambda v, note=note: note.result if v is read else v)


def _shard_gradient(program: Program, update: Op, dist: DistAttr, axis: int) -> None:
    """Stage 2: the gradient the backward hands over is held where its update runs. Only
    where optimizer-role ops transform it before the update (clipping): otherwise the update
    asks for that placement itself."""
    grad = update.args[1]
    raw = from_backward(grad)
    if raw is grad:
        return
    readers = [op for op in program.users().get(raw, ()) if op.role is Role.OPTIMIZER]
    if not readers:
        return
    first = min(readers, key=program.ops.index)
    note = Op(OpKind.CALL, "autopar.annotate", (raw,), outputs=[Value(raw.type)],
              role=Role.OPTIMIZER, module=update.module,
              attrs={DIST: dist, ORIGIN: f"zero-2 gradient {update.module or '-'}"})
    program.insert_after(program.ops[program.ops.index(first) - 1], note)
    for op in readers:
        op.map_inputs(lambda v, note=note: note.result if v is raw else v)


def _zero_dim(shape: tuple[int, ...], base: DistAttr, mesh: ProcessMesh, axis: int) -> int:
    """The tensor dim ZeRO cuts: dim 0, unless another mesh dim already cuts it (a colwise
    or vocab tensor-parallel weight). Then the first dim no mesh dim cuts and with a row for
    every rank of ``axis``, so each rank's ZeRO piece is a slice of its tensor-parallel piece
    (Megatron's distributed optimizer) and placing it moves no data: nested under dim 0, the
    ZeRO cut comes first (mesh-dim order, as DTensor's) and the pieces change tp ranks by
    two all-to-alls a step. Dim 0, nested, when no other dim qualifies."""
    cut = {p.dim for m, p in enumerate(base.placements) if m != axis and isinstance(p, Shard)}
    if 0 not in cut:
        return 0
    return next((d for d, n in enumerate(shape) if d not in cut and n >= mesh.shape[axis]), 0)


def from_backward(grad: Value) -> Value:
    """The gradient as the backward made it: back through the optimizer-role ops that
    transform it before its update (clipping's ``g * coef``), by the operand shaped like it."""
    v = grad
    while (op := v.producer) is not None and op.kind is OpKind.CALL \
            and op.role is Role.OPTIMIZER:
        alike = [x for x in op.inputs if x.is_tensor and x.type.shape == v.type.shape]
        if len(alike) != 1:
            break
        v = alike[0]
    return v


def _pin_shard0(value: Value, param: Value, mesh: ProcessMesh, axis: int, stage: int,
               what: str) -> None:
    """A shard on ``axis`` (``_zero_dim``) on top of the parameter's pinned placement (tp),
    if any."""
    if not value.type.shape:
        return                       # a scalar (Adam's step) stays replicated
    base = param.dist if param.dist is not None else DistAttr.replicated(mesh)
    if base.placements[axis].is_shard():
        return                       # already cut on the axis (experts on the dp axis)
    dim = _zero_dim(tuple(value.type.shape), base, mesh, axis)
    dist = trivial_dims_replicated(base.with_placement(axis, Shard(dim)))
    why = Reason("plan", f"sharding stage {stage}: {what} dim {dim} sharded on "
                         f"{mesh.dim_names[axis]}")
    if value is param and value.dist is not None:
        # a tensor-parallel pin says where the whole parameter lives; ZeRO cuts it further
        value.dist, value.why = dist.check(value.type.shape), why
    else:
        pin(value, dist, why)
