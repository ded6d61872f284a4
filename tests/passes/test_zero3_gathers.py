"""ZeRO stage 3's gathers: where each parameter is all-gathered in the planned program."""
from __future__ import annotations

from autopar.ir import OpKind, Role, StateKind
from autopar.ir.attrs import NAME
from autopar.ir.ops import op_info
from autopar.reshard.comm import FOR_ROLE

from .test_zero import _planned


def _copy_readers(program, values):
    """Every op reading ``values`` or a view or annotation of them (the gathered copy)."""
    users = program.users()
    found, todo, seen = [], list(values), set()
    while todo:
        v = todo.pop()
        for op in users.get(v, ()):
            if op in seen:
                continue
            seen.add(op)
            found.append(op)
            if op.kind is OpKind.CALL and (op.target == "autopar.annotate"
                                           or op_info(op.target).view):
                todo.extend(op.outputs)
    return found


def test_stage_3_gathers_each_parameter_per_phase_and_keeps_it_sharded():
    """Parameters live Shard(0) between steps: each is all-gathered from its piece before its
    forward use and, where the backward reads it (the input gradient of a layer whose input
    is not data), again before its backward use, in prefetched units (one collective per
    module). The forward's copy (and its views) is read by forward ops only, the backward's
    by backward ops only; each gradient is reduce-scattered to the piece the update writes
    (a layer's as one collective), and nothing gathers the new values."""
    model, program = _planned(3, 4)
    params = program.states(StateKind.PARAM)
    assert all(str(op.result.dist.placements[0]) == "S(0)" for op in params)
    assert not [op for op in program.ops if op.target == "comm.all_gather"]
    starts = [op for op in program.ops if op.target == "comm.all_gather_start"]
    gathered = {role: sorted(v.producer.attrs[NAME] for s in starts for v in s.args
                             if s.attrs[FOR_ROLE] is role)
                for role in (Role.FORWARD, Role.BACKWARD)}
    assert gathered[Role.FORWARD] == sorted(op.attrs[NAME] for op in params)
    assert gathered[Role.BACKWARD] == ["head.weight", "layers.1.weight"]
    users = program.users()
    for start in starts:
        wait, = users[start.result]
        assert wait.target == "comm.wait" and len(wait.outputs) == len(start.args)
        readers = _copy_readers(program, wait.outputs)
        assert readers and {op.role for op in readers} == {start.attrs[FOR_ROLE]}
    scattered = [v for op in program.ops if op.target in ("comm.reduce_scatter",
                                                         "comm.reduce_scatter_start")
                 for v in op.args]
    assert len(scattered) == len(params)
