"""Classes of identical ranks (``lower/rank_classes.py``): the reports lower one process per
class. Each case lowers every process of a plan directly and checks that every member of a
class runs its representative's program but for the pieces held: the same ops with the same
local types, the same collectives over the same pieces, the same batch and state pieces,
so the same memory estimate and predicted time; and where the model's local calls carry no
offsets, the very same program text."""
from __future__ import annotations

import pytest
import torch

import autopar as ap
from autopar.cost import Profile, predict_step
from autopar.ir import format_program
from autopar.ir.dist import local_shape
from autopar.lower import (
    estimate_memory,
    format_ranks,
    lower_program,
    lower_representatives,
    rank_classes,
)
from autopar.lower.executable import PipelineProcess, RankProgram
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

from .models_zoo import MegatronMLP, mse

TP_PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
           "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise", "wte": "vocab"}


def _gpt_plan(strategy: dict, batch: int = 8, dropout: float = 0.1, layers: int = 2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_embd=32,
                          dropout=dropout))
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       strategy=ap.Strategy(**strategy))
    x = torch.randint(0, 64, (batch, 16))
    return engine.planner.plan("train", x, x)


def _mlp_plan(strategy: dict, batch: int = 8, model=None):
    torch.manual_seed(0)
    model = model or MegatronMLP()
    engine = ap.Engine(model, mse, torch.optim.Adam(model.parameters(), lr=0.1),
                       strategy=ap.Strategy(**strategy))
    return engine.planner.plan("train", torch.randn(batch, 16), torch.randn(batch, 16))


def _mesh(shape, names):
    return {"shape": list(shape), "dim_names": list(names)}


def _tp(axis="tp", plan=None):
    return {"axis": axis, "plan": plan or TP_PLAN}


MLP_TP = {"fc1": "colwise", "fc2": "rowwise"}
CASES = {
    # name: (plan maker, strategy, the dims that must distinguish classes)
    "mlp dp2 x tp2": (_mlp_plan, dict(mesh=_mesh([2, 2], ["dp", "tp"]),
                                      data_parallel={"axis": "dp"},
                                      tensor_parallel=_tp(plan=MLP_TP)), ()),
    "mlp 5 rows over dp2": (lambda s: _mlp_plan(s, batch=5), dict(
        mesh=_mesh([2, 2], ["dp", "tp"]), data_parallel={"axis": "dp"},
        tensor_parallel=_tp(plan=MLP_TP)), ("dp",)),
    "mlp zero3 over dp3": (_mlp_plan, dict(
        mesh=_mesh([3], ["dp"]), data_parallel={"axis": "dp"},
        sharding={"stage": 3, "axis": "dp"}), ("dp",)),
    "gpt dp2 x tp2 dropout vocab": (_gpt_plan, dict(mesh=_mesh([2, 2], ["dp", "tp"]),
                                                    data_parallel={"axis": "dp"},
                                                    tensor_parallel=_tp()), ()),
    "gpt dp2 x cp2": (_gpt_plan, dict(mesh=_mesh([2, 2], ["dp", "cp"]),
                                      data_parallel={"axis": "dp"},
                                      context_parallel={"axis": "cp"}), ()),
    "gpt pp2 x dp2 x tp2 1F1B": (_gpt_plan, dict(
        mesh=_mesh([2, 2, 2], ["pp", "dp", "tp"]), data_parallel={"axis": "dp"},
        tensor_parallel=_tp(), pipeline={"axis": "pp", "schedule": "1F1B",
                                         "micro_batches": 2}), ("pp",)),
    "gpt pp2 x dp2 zero1 VPP": (lambda s: _gpt_plan(s, dropout=0.0, layers=4), dict(
        mesh=_mesh([2, 2], ["pp", "dp"]), data_parallel={"axis": "dp"},
        sharding={"stage": 1, "axis": "dp"},
        pipeline={"axis": "pp", "schedule": "VPP", "micro_batches": 4, "vpp_chunks": 2}),
        ("pp",)),
}


def _signature(program) -> list[str]:
    """A program op by op: kind, call, and its values' local types (what a class shares;
    a local call's offsets are what the piece held changes)."""
    return [f"{op.kind.name} {op.target} {[str(v.type) for v in op.inputs]} -> "
            f"{[str(v.type) for v in op.outputs]}" for op in program.ops]


def _comms(comms) -> list[str]:
    """Comm specs without their groups' process ids."""
    return [f"{i} {type(c).__name__} {getattr(c, 'member_shapes', '')} "
            f"{getattr(c, 'pieces', '')} {getattr(c, 'shapes', '')}"
            for i, c in sorted(comms.items())]


def _process_signature(made) -> list:
    if isinstance(made, RankProgram):
        return [_signature(made.program), _comms(made.comms),
                {k: [s.stop - s.start for s in v] for k, v in made.inputs.items()},
                _state(made.state)]
    assert isinstance(made, PipelineProcess)
    return [made.pp, [(str(job), _signature(jp.program), _comms(jp.comms))
                      for job, jp in made.programs.items()],
            [{k: [s.stop - s.start for s in v] for k, v in mb.items()}
             for mb in made.micro_batch_inputs], _state(made.state), sorted(made.held)]


def _state(state) -> dict:
    """Each state piece's local shape and the pieces its gather moves."""
    return {name: (None if p.dist is None else
                   local_shape(p.shape, p.dist.mesh, p.dist.placements, p.coordinate),
                   [g.member_shapes for g in p.gather]) for name, p in state.items()}


@pytest.mark.parametrize("case", CASES)
def test_every_member_of_a_class_lowers_as_its_representative(case):
    make, strategy, distinguishing = CASES[case]
    step = make(strategy)
    facts = step.facts
    every = lower_program(step.program, facts.mesh, facts.pipeline, facts.schedule)
    classes = rank_classes(step.program, facts.mesh, facts.pipeline)
    assert classes.distinguishing == distinguishing, classes.describe()
    assert sorted(classes.representative) == sorted(every.processes)
    profile = Profile.reference()
    memory, time = estimate_memory(every), predict_step(every, profile)
    for process, rep in classes.representative.items():
        mine, theirs = every.processes[process], every.processes[rep]
        assert _process_signature(mine) == _process_signature(theirs), \
            f"{case}: process {process} does not lower as {rep}, its class's representative"
        assert memory[process].cells() == memory[rep].cells()
        assert time[process] == time[rep]
    # the reports' lowering: one process per class, the same tables
    reps = lower_representatives(step.program, facts.mesh, facts.pipeline, facts.schedule)
    assert sorted(reps.processes) == classes.representatives
    assert {p: m.cells() for p, m in estimate_memory(reps).items()} == \
        {p: m.cells() for p, m in memory.items()}
    assert predict_step(reps, profile) == time
    # a distinguishing dim makes classes whose programs do differ
    if distinguishing and distinguishing != ("pp",):
        signatures = {format(_process_signature(every.processes[r]))
                      for r in classes.representatives}
        assert len(signatures) > 1


def test_classes_without_offsets_share_the_program_text():
    """An MLP under dp x tp: no local call reads its coordinate, so every process's program
    text is its representative's (the class is the whole mesh)."""
    make, strategy, _ = CASES["mlp dp2 x tp2"]
    step = make(strategy)
    every = lower_program(step.program, step.facts.mesh, None, None)
    texts = {format_program(m.program) for m in every.processes.values()}
    assert len(texts) == 1
    assert len(rank_classes(step.program, step.facts.mesh, None)) == 1


def test_offsets_differ_inside_a_class():
    """GPT's vocab-parallel embedding and dropout read the coordinate: one class, programs
    that differ only in those calls' constants."""
    make, strategy, _ = CASES["gpt dp2 x tp2 dropout vocab"]
    step = make(strategy)
    every = lower_program(step.program, step.facts.mesh, None, None)
    texts = [format_program(every.processes[p].program) for p in range(4)]
    assert texts[0] != texts[1]                  # tp rank 1 holds vocab rows from 32
    assert "vocab rows from 32" in texts[1]
    assert len(rank_classes(step.program, step.facts.mesh, None)) == 1


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"
    assert format_ranks([5]) == "5"
