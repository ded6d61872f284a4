"""ZeRO stage 3's gathers: where each parameter is all-gathered in the planned program."""
from __future__ import annotations

from autopar.ir import StateKind
from autopar.ir.attrs import NAME

from .test_zero import _planned


def test_stage_3_gathers_each_parameter_for_its_forward_and_keeps_it_sharded():
    """Parameters live Shard(0) between steps: each is all-gathered once, from its piece,
    before its forward use (the backward reads the forward's gathered copy), its gradient is
    reduce-scattered to the piece the update writes, and nothing gathers the new values."""
    model, program = _planned(3, 4)
    params = program.states(StateKind.PARAM)
    assert all(str(op.result.dist.placements[0]) == "S(0)" for op in params)
    gathers = [op for op in program.ops if op.target == "comm.all_gather"]
    assert sorted(op.args[0].producer.attrs[NAME] for op in gathers) == \
        sorted(op.attrs[NAME] for op in params)
    scatters = [op for op in program.ops if op.target == "comm.reduce_scatter"]
    assert len(scatters) == len(params)
    users = program.users()
    assert all(u.role.value == "fwd" for op in gathers for u in users[op.outputs[0]]
               if u.target != "autopar.annotate")
