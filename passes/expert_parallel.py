"""Expert parallelism: pin the experts' weights ``Shard(0)`` on the ``expert_parallel``
mesh dim.

An experts module holds its experts' weights stacked, ``[experts, out, in]``, and applies
them with one batched matmul over the expert dim (autopar captures transformers' experts
modules that way, ``capture/experts.py``: every expert on every token, each token's output the
sum over experts of its routing weight times the expert's output). Sharding that dim is
expert parallelism: each rank holds its experts (and their gradients and optimizer state)
and computes them, and the module's output is a sum over ranks.

* On a mesh dim of its own, every rank of it holds every token, so no token moves: the
  module's output, and in the backward the gradients of its inputs (tokens, routing
  weights), are pinned Replicate on the dim where the module hands them out, three
  all-reduces per layer, and the rest of the model plans as without experts.
* On the data-parallel dim, each rank holds its own tokens: completion sends them to the
  experts' ranks and back by all-to-all, and reduce-scatters the output to its tokens.

Found by what the graph does, not by names: a parameter of three dims whose first forward
use (through transposes and views) is a batched matmul over its dim 0 is an expert stack;
its module's parameters whose dim 0 has as many rows (per-expert biases) go with it.
An explicit ``shard_tensor`` on a parameter wins.
"""
from __future__ import annotations

from collections import defaultdict

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import DIST, NAME, ORIGIN, PINNED_DIMS
from ..ir.dist import DistAttr, ProcessMesh, Shard
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pass_infra.pinning import AnnotationError, pin
from ..spmd.rule_registry import tensor_inputs

__all__ = ["expert_parallel", "expert_stacks"]

_BATCHED_MATMULS = ("aten.bmm.default", "aten.baddbmm.default")


def expert_parallel(program: Program, ctx: PassContext) -> Program:
    ep, mesh = ctx.strategy.expert_parallel, ctx.state.mesh
    if ep is None or mesh is None:
        return program
    axis = mesh.dim_index(ep.axis)
    params = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    users = program.users()
    stacks = expert_stacks(params, users)
    if not stacks:
        raise AnnotationError(
            f"expert_parallel over {ep.axis!r} ({_describe(mesh)}): no module holds its "
            "experts' weights stacked as [experts, ...] parameters applied by one batched "
            "matmul; 3-D parameters: "
            + (", ".join(f"{n} {list(v.type.shape)}" for n, v in params.items()
                         if len(v.type.shape) == 3) or "none"))
    for module, weights in stacks.items():
        experts = next(v.type.shape[0] for v in weights.values())
        if experts % mesh.shape[axis]:
            raise AnnotationError(
                f"expert_parallel: module '{module}' has {experts} experts, which do not "
                f"split evenly over {ep.axis!r} of size {mesh.shape[axis]} ({_describe(mesh)}) "
                f"as Shard(0) of {', '.join(weights)}")
        dist = DistAttr.replicated(mesh).with_placement(axis, Shard(0))
        for name, value in weights.items():
            if value.dist is None:   # an explicit shard_tensor wins
                pin(value, dist, Reason("plan", f"expert_parallel: '{module}' holds "
                                                f"{experts} experts, dim 0 sharded on {ep.axis}"))
        if not _tokens_split_on(ctx, ep.axis):
            _reduce_on_exit(program, module, mesh, axis, users)
    return program


def _inside(op: Op, module: str) -> bool:
    return op.module == module or op.module.startswith(module + ".")


def _reduce_on_exit(program: Program, module: str, mesh: ProcessMesh, axis: int,
                    users: dict[Value, list[Op]]) -> None:
    """Pin Replicate on the expert dim of what the experts module hands out: its output in
    the forward, its inputs' gradients (tokens, routing weights) in the backward. Each is a
    sum over experts, so Partial(sum) over the axis, and reducing it there keeps the rest of
    the model (attention, norms, their gradients) as it is without experts; left Partial,
    completion may carry the partial sums on and reduce bigger values later (attention
    scores in the backward)."""
    for value, role in _exits(program, module, users):
        readers = list(users.get(value, ()))
        note = Op(OpKind.CALL, "autopar.annotate", (value,), outputs=[Value(value.type)],
                  role=role, module=module, forward_op=value.producer.forward_op,
                  attrs={DIST: DistAttr.replicated(mesh), PINNED_DIMS: (axis,),
                         ORIGIN: "expert_parallel"})
        program.insert_after(value.producer, note)
        for op in readers:
            op.map_inputs(lambda v, value=value, note=note: note.result if v is value else v)
        users[note.result] = readers
        users[value] = [note]


def _exits(program: Program, module: str, users: dict[Value, list[Op]]
           ) -> list[tuple[Value, Role]]:
    """Tensors the module's forward (backward) ops make that forward (backward) ops outside
    it, or the program results, read."""
    found = []
    for op in program.ops:
        if op.kind is not OpKind.CALL or op.role not in (Role.FORWARD, Role.BACKWARD) \
                or not _inside(op, module):
            continue
        found += [(v, op.role) for v in op.outputs if v.is_tensor and any(
            u.kind is OpKind.OUTPUT or (u.role is op.role and not _inside(u, module))
            for u in users.get(v, ()))]
    return found


def _tokens_split_on(ctx: PassContext, axis: str) -> bool:
    """Whether the batch is sharded on the experts' axis (data parallelism over it): then the
    module's output is each rank's own tokens (reduce-scattered), not every token."""
    dp = ctx.strategy.data_parallel
    return dp is not None and dp.is_enabled and axis in dp.mesh_axes


def expert_stacks(params: dict[str, Value], users: dict[Value, list[Op]]
                  ) -> dict[str, dict[str, Value]]:
    """module path -> its expert parameters (the stacks, and per-expert biases)."""
    by_module: dict[str, dict[str, Value]] = defaultdict(dict)
    for name, value in params.items():
        by_module[name.rpartition(".")[0]][name] = value
    stacks = {}
    for module, owned in by_module.items():
        counts = {v.type.shape[0] for v in owned.values()
                  if len(v.type.shape) == 3 and _batched_over_dim0(v, users)}
        if len(counts) == 1:
            experts = counts.pop()
            stacks[module] = {n: v for n, v in owned.items()
                              if len(v.type.shape) >= 2 and v.type.shape[0] == experts}
    return stacks


def _batched_over_dim0(value: Value, users: dict[Value, list[Op]]) -> bool:
    """Whether the first forward use of a 3-D parameter, followed through single-input ops
    that keep dim 0 in front (transposes of the last two dims, views), is a batched matmul."""
    while True:
        op = next((u for u in users.get(value, ()) if u.kind is OpKind.CALL
                   and u.role.value == "fwd"), None)
        if op is None:
            return False
        if op.target in _BATCHED_MATMULS:
            return True
        if len(tensor_inputs(op)) != 1 or len(op.outputs) != 1 or not op.outputs[0].is_tensor \
                or op.outputs[0].type.shape[:1] != value.type.shape[:1]:
            return False
        value = op.outputs[0]


def _describe(mesh: ProcessMesh) -> str:
    return f"mesh {list(mesh.shape)} ({', '.join(mesh.dim_names)})"

