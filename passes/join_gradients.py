"""Join gradients after accumulating them: a gradient summed from terms that two pipeline
stages make (a tied weight: the embedding's term on the first stage, the output head's on
the last) is summed over micro-batches on each stage, then joined once per step.

    %g = add(%a, %b); %s = comm.all_reduce(%g) over mb
 -> %sa = comm.all_reduce(%a) over mb; %sb = comm.all_reduce(%b) over mb; %s = add(%sa, %sb)

The sum is linear, so the result is the same sum; but the joining ``add`` moves from every
micro-batch's backward to the once-a-step optimizer phase, and one message per step crosses
the stages instead of one per micro-batch (Megatron's embedding-group all-reduce).
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.attrs import LOCAL_NOTE
from ..ir.dist import micro_batch_dim
from ..pass_infra.context import PassContext
from ..pipeline.phases import STAGE
from ..reshard.comm import RESHARD_STEP
from ..reshard.steps import AllReduce


def join_gradients(program: Program, ctx: PassContext) -> Program:
    if ctx.state.pipeline is None or ctx.state.pipeline.micro_batches == 1:
        return program
    mb = micro_batch_dim(ctx.state.mesh)
    users = program.users()
    for total in [op for op in program.ops if _sums_over(op, mb)]:
        add = total.args[0].producer
        if (add.target != "aten.add.Tensor" or add.kwargs or len(add.args) != 2
                or len(users.get(add.result, ())) != 1):
            continue
        stages = [_stage_of(v) for v in add.args]
        if None not in stages and stages[0] != stages[1]:
            _accumulate_then_join(program, total, add)
    return program


def _sums_over(op: Op, mb: int) -> bool:
    step = op.attrs.get(RESHARD_STEP)
    return (op.kind is OpKind.COMM and isinstance(step, AllReduce) and step.mesh_dim == mb
            and step.op == "sum")


def _stage_of(value: Value) -> int | None:
    """The stage of the call that made ``value``, through collectives that moved it."""
    op = value.producer
    while op is not None and op.kind is OpKind.COMM and op.args:
        op = op.args[0].producer
    return op.attrs.get(STAGE) if op is not None else None


def _accumulate_then_join(program: Program, total: Op, add: Op) -> None:
    terms = []
    for v in add.args:
        term = Op(OpKind.COMM, total.target, (v,), outputs=[Value(v.type)], role=total.role,
                  module=total.module, attrs=dict(total.attrs))
        term.needs = (v.dist,)
        term.result.dist, term.result.why = total.result.dist, total.result.why
        term.result.producer = term
        terms.append(term)
    joined = Op(OpKind.CALL, add.target, tuple(t.result for t in terms),
                outputs=[total.result], role=Role.OPTIMIZER, module=add.module,
                attrs={LOCAL_NOTE: "a gradient of two stages: each stage's term summed "
                                     "over micro-batches, then joined once"})
    joined.needs = tuple(t.result.dist for t in terms)
    total.result.producer, total.result.index = joined, 0
    at = program.ops.index(total)
    program.ops[at:at + 1] = terms + [joined]
    program.ops.remove(add)
