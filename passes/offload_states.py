"""``sharding.offload``: the optimizer state (and, with ``params``, the parameters) lives in
host memory; the update runs on the host (ZeRO-Offload; FSDP2's ``CPUOffloadPolicy``).

Each offloaded state op is marked ``ON_HOST`` (the runtime keeps its piece in pinned host
memory) and the step moves what crosses between the homes::

    %g  = ...                                  # a gradient, as the backward makes it
    %gh = autopar.to_host(%g)                  # its copy starts at once, on a side stream
    ...                                        # the rest of the backward
    %gh', %ph' = autopar.host_ready(%gh, %ph)  # once before a run of updates
    %p1, %m1, %v1 = optim.adam(%ph', %gh', ., %m, %v)     # on the host, batched as before
    %pd = autopar.to_device(%p1)               # the new parameter back (params stay home)

With ``params`` the parameter's state is the host copy: every reader but its update reads
``autopar.to_device(%p)`` made right after it, and the new value stays on the host. Every
other tensor an update reads (the loss scaler's ``found_inf``) is copied to the host too,
so the update reads one device. Runs after ZeRO's gathers are placed (``gather_updates``):
an updated parameter's consumers, a gather among them, read its device copy.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import MULTI, ON_HOST, STATE
from ..pass_infra.context import PassContext

__all__ = ["offload_states", "is_update"]

def is_update(op: Op) -> bool:
    return op.kind is OpKind.CALL and op.target.startswith("optim.")


def offload_states(program: Program, ctx: PassContext) -> Program:
    sharding = ctx.strategy.sharding
    offload = sharding.offload if sharding is not None else None
    if offload is None or not offload.is_enabled:
        return program
    kinds = {StateKind.OPTIM} | ({StateKind.PARAM} if offload.params else set())
    for op in program.states():
        if op.attrs[STATE].kind in kinds:
            op.attrs[ON_HOST] = True
    if offload.params:
        _params_read_on_device(program)
    copies: dict[Value, Value] = {}       # device value -> its host copy, waited for
    for run in _update_runs(program):
        _run_on_host(program, run, copies, keep_new_params=offload.params)
    return program


def _on_host(value: Value) -> bool:
    op = value.producer
    return op is not None and (op.attrs.get(ON_HOST, False) or op.target == "autopar.to_host")


def _copy_op(target: str, value: Value, like: Op, role: Role = Role.OPTIMIZER) -> Op:
    op = Op(OpKind.CALL, target, (value,), outputs=[Value(value.type)], role=role,
            module=like.module)
    op.outputs[0].dist, op.outputs[0].why = value.dist, value.why
    op.needs = (value.dist,) if value.dist is not None else ()
    return op


def _params_read_on_device(program: Program) -> None:
    """Every reader of a host parameter but its update reads its device copy."""
    users = program.users()
    for state in [op for op in program.states(StateKind.PARAM) if op.attrs.get(ON_HOST)]:
        host = state.result
        readers = [u for u in users.get(host, []) if not is_update(u)]
        for update in (u for u in users.get(host, []) if is_update(u)):
            if update.args[0] is not host:
                raise _not_the_piece(state)
        if not readers:
            continue
        copy = program.insert_after(state, _copy_op("autopar.to_device", host, state,
                                                    Role.FORWARD))
        for reader in readers:
            reader.map_inputs(lambda v: copy.result if v is host else v)
    for update in (op for op in program.ops if is_update(op)):
        read = update.args[0].producer
        if read is None or read.kind is not OpKind.STATE:
            raise _not_the_piece(None, update)


def _not_the_piece(state: Op | None, update: Op | None = None) -> ValueError:
    what = f"parameter {state.attrs[STATE].param!r}" if state is not None \
        else f"the parameter of {update.target} (module {update.module!r})"
    return ValueError(
        f"sharding.offload.params: {what} is updated on a piece cut from it (ZeRO stage 1 or "
        "2 keeps the parameter whole and updates a piece), so the host could not keep the "
        "value the step reads; offload parameters with stage 3 (each rank keeps and updates "
        "its piece, FSDP2's CPUOffloadPolicy) or stage 0, or offload only the optimizer")


def _update_runs(program: Program) -> list[list[Op]]:
    """Maximal runs of consecutive updates (each run one batched call per optimizer)."""
    runs: list[list[Op]] = []
    previous = None
    for op in program.ops:
        if is_update(op):
            if previous is not None and is_update(previous):
                runs[-1].append(op)
            else:
                runs.append([op])
        previous = op
    return runs


def _run_on_host(program: Program, run: list[Op], copies: dict[Value, Value],
                 keep_new_params: bool) -> None:
    """Copy what the run's updates read to the host, wait for the new copies once before
    the run, and copy each new parameter back after it (unless the host keeps them).
    ``copies``: the host copies earlier runs waited for (a scalar read by every update,
    the loss scaler's ``found_inf``, is copied once)."""
    started = {}
    for update in run:
        for value in update.inputs:
            if value.is_tensor and not _on_host(value) and value not in copies \
                    and value not in started:
                started[value] = _to_host(program, value, before=run[0]).result
    if started:
        waited = list(started.values())
        wait = Op(OpKind.CALL, "autopar.host_ready", tuple(waited),
                  outputs=[Value(v.type) for v in waited], role=Role.OPTIMIZER,
                  module=run[0].module, attrs={MULTI: True})
        for new, old in zip(wait.outputs, waited):
            new.dist, new.why = old.dist, old.why
        wait.needs = tuple(v.dist for v in waited if v.dist is not None)
        program.ops.insert(program.ops.index(run[0]), wait)
        for i, v in enumerate(wait.outputs):
            v.producer, v.index = wait, i
        copies.update(zip(started, wait.outputs))
    for update in run:
        update.map_inputs(lambda v: copies.get(v, v))
    if not keep_new_params:
        _new_params_to_device(program, run)


def _to_host(program: Program, value: Value, before: Op) -> Op:
    """A host copy of ``value`` started as soon as it exists: right after the op that makes
    it, or (a state, an input: there from the step's start) right before the run."""
    producer = value.producer
    role = Role.BACKWARD if producer is not None and producer.role is Role.BACKWARD \
        else Role.OPTIMIZER          # a gradient's copy is part of the backward that makes it
    made = producer is not None and producer.kind in (OpKind.CALL, OpKind.COMM)
    # the copy belongs to the module whose op it follows (a gradient's: its backward op's)
    op = _copy_op("autopar.to_host", value, producer if made else before, role)
    if made:
        return program.insert_after(producer, op)
    program.ops.insert(program.ops.index(before), op)
    op.outputs[0].producer, op.outputs[0].index = op, 0
    return op


def _new_params_to_device(program: Program, run: list[Op]) -> None:
    users = program.users()
    anchor = run[-1]
    for update in run:
        new = update.outputs[0]
        readers = users.get(new, [])
        if not readers:
            continue
        copy = program.insert_after(anchor, _copy_op("autopar.to_device", new, update))
        anchor = copy
        for reader in readers:
            reader.map_inputs(lambda v: copy.result if v is new else v)
