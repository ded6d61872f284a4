"""Lowering: each process's executable plan, made once from the planned global program."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.ir import OpKind
from autopar.lower.executable import BucketStart, BucketWait, RankProgram, StepComm
from autopar.lower.lowering import LoweringError, lower_program
from autopar.reshard import AllGather

from ..models_zoo import MegatronMLP, mse

DP_TP = ap.Strategy(mesh={"shape": [2, 2], "dim_names": ["dp", "tp"]},
                    data_parallel={"axis": "dp"},
                    tensor_parallel={"axis": "tp", "plan": {"fc1": "colwise", "fc2": "rowwise"}})


def _planned(strategy: ap.Strategy, batch: int = 5, dump_dir=None):
    torch.manual_seed(0)
    model = MegatronMLP()
    if dump_dir is not None:
        strategy = strategy.model_copy(update={"debug": ap.Strategy(
            debug={"dump_dir": str(dump_dir)}).debug})
    engine = ap.Engine(model, mse, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    x, y = torch.randn(batch, 16), torch.randn(batch, 16)
    return engine, engine.planner.plan("train", x, y)


def test_every_process_gets_its_partition_comm_specs_batch_slices_and_state_pieces():
    _, step = _planned(DP_TP)
    lowered = lower_program(step.program, step.facts.mesh, None, None)
    assert sorted(lowered.processes) == [0, 1, 2, 3]
    for process, rank in lowered.processes.items():
        assert isinstance(rank, RankProgram)
        assert rank.coordinate == step.facts.mesh.coordinate(process)
        comm_ops = {i for i, op in enumerate(rank.program.ops) if op.kind is OpKind.COMM}
        assert comm_ops and set(rank.comms) == comm_ops
        for spec in rank.comms.values():
            assert isinstance(spec, (StepComm, BucketStart, BucketWait))
            if isinstance(spec, StepComm):     # one piece shape per member of its group
                assert len(spec.member_shapes) == 2
        # 5 rows over dp: 3 + 2, cut once at plan time
        rows = rank.inputs["batch/0"][0]
        assert (rows.start, rows.stop) == ((0, 3) if rank.coordinate[0] == 0 else (3, 5))
        fc1 = rank.state["fc1.weight"]
        assert fc1.shape == (64, 16) and fc1.coordinate == rank.coordinate
        assert [type(c.step) for c in fc1.gather] == [AllGather]   # colwise: gather over tp
        assert fc1.gather[0].member_shapes == ((32, 16), (32, 16))


def test_lowered_programs_are_dumped_next_to_the_passes(tmp_path):
    _planned(DP_TP, dump_dir=tmp_path)
    for rank in range(4):
        text = next((tmp_path / f"rank{rank}").glob("[0-9][0-9]_partition.txt")).read_text()
        assert "comm.all_reduce" in text or "comm.all_reduce_start" in text


def test_a_pipeline_is_lowered_only_with_its_schedule():
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["pp"]},
                           pipeline={"axis": "pp", "schedule": "1F1B", "micro_batches": 2,
                                     "split": ["fc2"]})
    _, step = _planned(strategy, batch=4)
    with pytest.raises(LoweringError, match="needs its schedule"):
        lower_program(step.program, step.facts.mesh, step.facts.pipeline, None)
    lowered = lower_program(step.program, step.facts.mesh, step.facts.pipeline,
                            step.facts.schedule)
    assert {p.pp for p in lowered.processes.values()} == {0, 1}
    first = lowered.processes[0]
    assert [job for job in first.order] == lowered.jobs.ranks[0].order
    assert len(first.micro_batch_inputs) == 2 and first.peers == {0: 0, 1: 1}
