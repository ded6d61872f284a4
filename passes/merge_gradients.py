"""Gradient merge (accumulation over ``gradient_merge.k_steps`` batches): each parameter's
gradient is added into an accumulator state, and the optimizer runs once every k batches.

The engine plans two training programs from one capture, both through every pass up to
here, so completion places them identically:

* the *accumulate* program (``PlanInputs.accumulate_only``; batches 1..k-1 of a cycle)
  writes ``acc + g`` back to the accumulator and drops everything that read the gradients
  (clipping, the optimizer's updates and their state): no gradient communication, no update;
* the *apply* program (the k-th batch) hands the optimizer ``(acc + g) / k`` (``avg``) in
  place of ``g`` and resets the accumulator to zeros.

An accumulating step drops every result computed from the gradients (a state without its
update keeps its value): amp's loss-scaling check and scale update run once per optimizer
step, on the merged gradients, as ``GradScaler`` does with accumulation.

An accumulator is the state ``StateKey.accumulator(<param FQN>)`` (named
``gradient_merge/<param FQN>``; it starts at zeros, its ``FILL``), placed
exactly like the gradient as the backward makes it: a ``Partial(sum)`` over dp stays a
partial sum on each rank, so nothing communicates until the apply program, where reshard
puts the all-reduce (ZeRO: the reduce-scatter) once, on the merged gradient. In a pipeline
the gradient is summed over micro-batches first (its ``mb`` dim is replicated): the merge
ops run once a step, with the optimizer (role ``opt``, the post phase). Elsewhere they are
the backward's last word on the gradient (role ``bwd``, right after it is made, as
autograd's ``.grad +=``), so bucketed all-reduces and early reduce-scatters of the merged
gradient still overlap the backward. Under amp the gradient is taken as it is reduced: after
the cast to fp32, or, when ``reduce_dtype`` is the half one, the half partial terms before
the cast that reads them reduced. Each merge op says what it does in the dumps
(``{merge=...}``).
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, Slot, StateKey, Value, state_op
from ..ir.attrs import NAME, Attr
from ..ir.dist import DistAttr, Replicate, micro_batch_dim
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..pipeline.phases import STAGE
from .dead_code import dead_code
from .zero_sharding import from_backward

__all__ = ["merge_gradients", "MERGE"]

MERGE: Attr[str] = Attr("merge", str, "a gradient-merge op: what it does to whose gradient",
                        shown=True)
class GradientMergeError(ValueError):
    """A program whose gradients cannot be merged as planned."""


def merge_gradients(program: Program, ctx: PassContext) -> Program:
    merge = ctx.strategy.gradient_merge
    if ctx.mode != "train" or not merge.is_enabled:
        if ctx.inputs.accumulate_only:
            raise GradientMergeError(
                f"an accumulate-only {ctx.mode} program needs gradient_merge.k_steps > 1 "
                f"(k_steps: {merge.k_steps})")
        return program
    gradients = _gradients(program, ctx)
    if not gradients:
        raise GradientMergeError(
            "gradient_merge: the training program updates no parameter from a gradient "
            "(no optimizer update op), so there is nothing to accumulate")
    role = Role.OPTIMIZER if ctx.state.pipeline is not None else Role.BACKWARD
    users = program.users()
    merged = {name: _accumulate(program, name, g, role) for name, g in gradients.items()}
    if ctx.inputs.accumulate_only:
        return _accumulate_only(program, ctx, gradients, merged, users)
    for name, g in gradients.items():
        _apply(program, name, g, merged[name], users, merge.k_steps if merge.avg else 1)
    return program


def _gradients(program: Program, ctx: PassContext) -> dict[str, Value]:
    """Each updated parameter's gradient as the backward made it: the gradient operand of
    its update (``optimizer_updates``: ``(param, grad, hparams, *state)``), back through the
    optimizer-role ops that transform it first (clipping)."""
    found: dict[str, Value] = {}
    for slot, v in program.results():
        update = v.producer
        if slot.kind != "update" or v.index != 0 or not update.target.startswith("optim."):
            continue
        g = _before_reduction(from_backward(update.args[1]))
        if g.producer.role is Role.OPTIMIZER or g.producer.kind is not OpKind.CALL:
            raise GradientMergeError(
                f"gradient_merge: the gradient {update.target} ({update.module or 'top level'}"
                f") updates {slot.name!r} with does not come from the backward: it stops at "
                f"{g.producer.target} (role {g.producer.role.value}), placed {g.dist} on "
                f"{ctx.state.mesh or 'one device'}")
        found[slot.name] = g
    return found


def _before_reduction(g: Value) -> Value:
    """Back through a one-input op that reads its input reduced (amp's cast of the half
    gradient to fp32 when ``reduce_dtype`` is the half one: the reduction comes before the
    cast), so the accumulator holds the partial terms and only the apply step reduces."""
    while (op := g.producer).kind is OpKind.CALL and len(op.needs) == 1 \
            and len(ins := [v for v in op.inputs if v.is_tensor]) == 1 \
            and _reduced(ins[0].dist, op.needs[0]):
        g = ins[0]
    return g


def _reduced(have: DistAttr | None, need: DistAttr | None) -> bool:
    """Whether reading ``have`` as ``need`` sums partial terms over some mesh dim."""
    return have is not None and need is not None and any(
        p.is_partial() and not q.is_partial()
        for p, q in zip(have.placements, need.placements))


def _accumulator_dist(g: Value) -> DistAttr | None:
    """Where the accumulator lives: where the gradient is made, but whole over a
    pipeline's micro-batches (the state is the step's sum, not one micro-batch's term)."""
    if g.dist is None:
        return None
    mb = micro_batch_dim(g.dist.mesh)
    return g.dist if mb is None else g.dist.with_placement(mb, Replicate())


def _place(op: Op, dist: DistAttr | None, text: str) -> Op:
    op.needs = () if dist is None else tuple(dist for _ in op.inputs)
    for v in op.outputs:
        v.dist = dist
        v.why = None if dist is None else Reason("merge", text, op)
    return op


def _accumulate(program: Program, name: str, g: Value, role: Role) -> Value:
    """``acc + g``, placed like the accumulator, right after the gradient is made."""
    dist = _accumulator_dist(g)
    made = g.producer
    state = state_op(StateKey.accumulator(name), g.type, role, fill=0.0)
    _place(state, dist, f"gradient merge: accumulates {name}'s gradient where it is made")
    stage = _stage_of(g) if role is Role.OPTIMIZER else None
    add = Op(OpKind.CALL, "aten.add.Tensor", (state.result, g), outputs=[Value(g.type)],
             role=role, module=made.module,
             forward_op=made.forward_op if role is Role.BACKWARD else None,
             attrs={MERGE: f"accumulate {name}", **({} if stage is None else {STAGE: stage})})
    _place(add, dist, f"gradient merge: the sum of {name}'s gradients so far")
    program.insert_after(made, state)
    program.insert_after(state, add)
    return add.result


def _stage_of(g: Value) -> int | None:
    """A pipeline's stage for a gradient's accumulator: the stage that makes it, or for a
    tied weight's sum of terms from several stages the first of them (every stage that
    updates the weight reads the merged gradient from there, once a step)."""
    found, todo, seen = set(), [g], set()
    while todo:
        op = todo.pop().producer
        if op is None or op in seen or op.kind is not OpKind.CALL:
            continue
        seen.add(op)
        if STAGE in op.attrs:
            found.add(op.attrs[STAGE])
        else:
            todo.extend(op.inputs)
    return min(found, default=None)


def _apply(program: Program, name: str, g: Value, total: Value, users: dict[Value, list[Op]],
           k: int) -> None:
    """The optimizer (and clipping) read ``total / k`` in place of ``g``; the accumulator
    starts the next cycle at zeros."""
    add = total.producer
    merged = total
    if k > 1:
        scale = Op(OpKind.CALL, "aten.mul.Tensor", (total, 1.0 / k), outputs=[Value(g.type)],
                   role=add.role, module=add.module, forward_op=add.forward_op,
                   attrs={MERGE: f"average {name} over {k} batches"})
        _place(scale, total.dist, f"gradient merge: the mean of {name}'s {k} gradients")
        program.insert_after(add, scale)
        merged = scale.result
    for reader in users.get(g, ()):
        reader.map_inputs(lambda v: merged if v is g else v)
    # made from the accumulator (alive all step anyway) at the step's end, so neither the
    # sum nor the zeros outlive their use; in a pipeline on the accumulator's stage
    acc = add.args[0]
    stage = {STAGE: add.attrs[STAGE]} if STAGE in add.attrs else {}
    reset = Op(OpKind.CALL, "aten.zeros_like.default", (acc,), outputs=[Value(g.type)],
               role=add.role, module=add.module, forward_op=add.forward_op,
               attrs={MERGE: f"reset {name}", **stage})
    _place(reset, total.dist, f"gradient merge: {name}'s accumulator starts again")
    program.add(reset)
    _set_results(program, program.results() + [(Slot("update", StateKey.accumulator(name).name),
                                                 reset.result)])


def _accumulate_only(program: Program, ctx: PassContext, gradients: dict[str, Value],
                     merged: dict[str, Value], users: dict[Value, list[Op]]) -> Program:
    """Keep what does not read the gradients (the loss, outputs, buffer updates) and write
    each sum back to its accumulator; drop what does: clipping, the updates and their state,
    loss scaling's check and scale update (each belongs to the optimizer step, once per k
    batches; a state without its update keeps its value), and the unused hyper-parameters."""
    readers = {op for g in gradients.values() for op in users.get(g, ())}
    dropped = _downstream(program, readers)
    lost = [str(s) for s, v in program.results()
            if v.producer in dropped and s.kind in ("loss", "output")]
    if lost:
        raise GradientMergeError(f"gradient_merge: results {lost} are computed from the "
                                 "gradients, so a step that only accumulates cannot make them")
    results = [(s, v) for s, v in program.results() if v.producer not in dropped]
    results += [(Slot("update", StateKey.accumulator(n).name), v) for n, v in merged.items()]
    program.ops = [op for op in program.ops if op not in dropped]
    _set_results(program, results)
    program = dead_code(program, ctx)
    used = {v for op in program.ops for v in op.inputs}
    program.ops = [op for op in program.ops if not (op.kind is OpKind.INPUT and op.role is
                                                    Role.OPTIMIZER and op.result not in used)]
    return program


def _downstream(program: Program, start: set[Op]) -> set[Op]:
    """``start`` and every op that reads what they make (program order is a topological
    order, so one sweep finds them)."""
    found = set(start)
    made = {v for op in start for v in op.outputs}
    for op in program.ops:
        if op.kind is not OpKind.OUTPUT and any(v in made for v in op.inputs):
            found.add(op)
            made.update(op.outputs)
    return found


def _set_results(program: Program, results: list[tuple[Slot, Value]]) -> None:
    """New results, with the output op's needs kept aligned (tensor results only): an
    updated state goes back where the state lives."""
    out = program.output_op
    if not out.needs:                     # serial: nothing is placed
        program.set_results(results)
        return
    old = dict(zip([s for s, v in program.results() if v.is_tensor], out.needs))
    states = {op.attrs[NAME]: op.result.dist for op in program.ops_of(OpKind.STATE)}
    program.set_results(results)
    out.needs = tuple(old[s] if s in old else states[s.name]
                      for s, v in results if v.is_tensor)
