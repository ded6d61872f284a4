"""``tensor_parallel.sequence_parallel`` (Megatron-SP): pin the activations that leave a
parallel region ``Shard(sequence_dim)`` on the tp mesh dim.

Each output of a rowwise or vocab module (the value the module hands to the rest of the
forward) goes through an ``autopar.annotate`` that pins the tp mesh dim, other mesh dims
left to the producer. Those outputs are Partial(sum), so reshard writes a reduce-scatter
where TP alone would all-reduce later; completion carries the sequence shard through the
residual adds, dropout and LayerNorm (their rules shard token dims), and the next colwise
matmul, whose flattened input may not keep the sequence dim sharded, gathers it. The
backward follows by the same rules: the gather's gradient is a reduce-scatter and the
reduce-scatter's a gather.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import DIST, NAME, ORIGIN, PINNED_DIMS
from ..ir.dist import DistAttr, ProcessMesh, Shard
from ..pass_infra.context import PassContext
from ..pass_infra.pinning import AnnotationError
from .tensor_parallel_plan import plan_entries

__all__ = ["sequence_parallel"]


def sequence_parallel(program: Program, ctx: PassContext) -> Program:
    tp = ctx.strategy.tensor_parallel
    mesh = ctx.state.mesh
    if mesh is None or tp is None or not tp.sequence_parallel:
        return program
    axis = mesh.dim_index(tp.axis)
    if mesh.shape[axis] == 1:
        return program   # one rank on tp: every shard is the whole value
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    modules = {n.rpartition(".")[0]: (pattern, style)
               for pattern, style, matched in plan_entries(tp.plan, params)
               if style in ("rowwise", "vocab") for n in matched}
    if not modules:
        raise AnnotationError(
            f"tensor_parallel.sequence_parallel on {tp.axis} of {mesh}: the plan has no "
            f"rowwise or vocab entry, so no activation leaves a parallel region to be "
            f"sequence-sharded (plan: {dict(tp.plan)})")
    dist = DistAttr.replicated(mesh).with_placement(axis, Shard(tp.sequence_dim))
    users = program.users()
    for module, (pattern, style) in sorted(modules.items()):
        exits = _module_outputs(program, module, users)
        if not exits:
            raise AnnotationError(
                f"tensor_parallel.sequence_parallel: {style} module {module!r} (plan "
                f"{pattern!r}) hands no tensor to the rest of the forward")
        for value in exits:
            _check_sequence_dim(value, module, tp.sequence_dim, tp.axis, mesh, axis)
            _annotate_activation(program, value, dist, axis, module, users)
    return program


# Roles of the ops that make a value a module's output when they read it from outside the
# module; a backward op reading it uses a saved activation, which is not what it returns.
_FORWARD_ROLES = (Role.FORWARD, Role.LOSS)


def _inside(op: Op, module: str) -> bool:
    return op.module == module or op.module.startswith(module + ".")


def _module_outputs(program: Program, module: str, users: dict[Value, list[Op]]
                    ) -> list[Value]:
    """The forward tensors ``module`` computes that forward ops outside it (or the program
    results) read: what the module returns, in program order."""
    found = []
    for op in program.ops:
        if op.kind is not OpKind.CALL or op.role is not Role.FORWARD or not _inside(op, module):
            continue
        for v in op.outputs:
            if v.is_tensor and any(
                    u.kind is OpKind.OUTPUT
                    or (u.role in _FORWARD_ROLES and not _inside(u, module))
                    for u in users.get(v, ())):
                found.append(v)
    return found


def _check_sequence_dim(value: Value, module: str, dim: int, axis_name: str,
                        mesh: ProcessMesh, axis: int) -> None:
    shape, ranks = list(value.type.shape), mesh.shape[axis]
    where = (f"tensor_parallel.sequence_parallel: the output of {module!r} {value.type} "
             f"on {mesh}")
    if dim >= len(shape):
        raise AnnotationError(
            f"{where} has no sequence_dim {dim} to shard over {axis_name} (rank "
            f"{len(shape)}); set tensor_parallel.sequence_dim to the sequence dim of the "
            f"activations, or leave this module out of the plan's rowwise/vocab entries")
    if shape[dim] % ranks:
        raise AnnotationError(
            f"{where}: sequence length {shape[dim]} (dim {dim}) is not divisible by the "
            f"{ranks} ranks of {axis_name}; sequence parallelism needs equal sequence "
            f"shards (pad the sequence to a multiple of {ranks})")


def _annotate_activation(program: Program, value: Value, dist: DistAttr, axis: int,
                         module: str, users: dict[Value, list[Op]]) -> None:
    """Route every reader of ``value`` through an ``autopar.annotate`` that pins the tp mesh
    dim: the forward's next layer and the backward ops that saved it alike, so the
    activation is held sequence-sharded (Megatron-SP's memory saving)."""
    readers = list(users.get(value, ()))
    note = Op(OpKind.CALL, "autopar.annotate", (value,), outputs=[Value(value.type)],
              role=Role.FORWARD, module=module,
              attrs={DIST: dist, PINNED_DIMS: (axis,), ORIGIN: "sequence_parallel"})
    program.insert_after(value.producer, note)
    pinned = note.result
    for op in readers:
        op.map_inputs(lambda v: pinned if v is value else v)
    users[pinned] = readers
    users[value] = [note]
