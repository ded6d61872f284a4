"""Classes of identical ranks (``lower/rank_classes.py``): the reports lower one process per
class. Each case lowers every process of a plan directly and checks that every member of a
class runs its representative's program but for the pieces held: the same ops with the same
local types, the same collectives over the same pieces, the same batch and state pieces,
so the same memory estimate and predicted time; and where the model's local calls carry no
offsets, the very same program text."""
from __future__ import annotations

import warnings

import pytest
import torch

import autopar as ap
from autopar.cost import Profile, predict_step
from autopar.ir import format_program
from autopar.ir.dist import local_shape
from autopar.lower import (
    classify_ranks,
    estimate_memory,
    format_ranks,
    lower_program,
    lower_representatives,
)
from autopar.lower.executable import PipelineProcess, RankProgram
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss

from ..models_zoo import MegatronMLP, mse

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


def _moe_plan(strategy: dict):
    """Mixtral from ``tests/passes/test_moe.py``, its experts routed by capacity (fixed shapes)."""
    pytest.importorskip("transformers")
    from autopar.capture.step import CaptureNote

    from ..passes import test_moe as moe
    model = moe._built("mixtral")
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy(**strategy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureNote)     # the dense dispatch (test_moe.py)
        engine.prepare(*moe._batch(moe._data()[:moe.BATCH]))
    return engine.planner.last("train")


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
    "gpt tp2 sequence parallel": (_gpt_plan, dict(
        mesh=_mesh([2], ["tp"]), tensor_parallel={**_tp(), "sequence_parallel": True,
                                                  "sequence_dim": 1}), ()),
    "gpt cp2 ring": (lambda s: _gpt_plan(s, dropout=0.0), dict(
        mesh=_mesh([2], ["cp"]), context_parallel={"axis": "cp", "method": "ring",
                                                   "seq_dim": 1}), ()),
    "mlp hsdp rep2 x shard2": (_mlp_plan, dict(
        mesh=_mesh([2, 2], ["rep", "shard"]), data_parallel={"axis": ["rep", "shard"]},
        sharding={"stage": 3, "axis": "shard", "unit": "layer"}), ()),
    "mixtral dp2 x ep2": (_moe_plan, dict(
        mesh=_mesh([2, 2], ["dp", "ep"]), data_parallel={"axis": "dp"},
        expert_parallel={"axis": "ep"}), ()),
    "mixtral experts over dp2": (_moe_plan, dict(
        mesh=_mesh([2], ["dp"]), data_parallel={"axis": "dp"},
        expert_parallel={"axis": "dp"}), ()),
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
    classes = classify_ranks(step.program, facts.mesh, facts.pipeline)
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
    assert len(classify_ranks(step.program, step.facts.mesh, None)) == 1


def test_offsets_differ_inside_a_class():
    """GPT's vocab-parallel embedding and dropout read the coordinate: one class, programs
    that differ only in those calls' constants."""
    make, strategy, _ = CASES["gpt dp2 x tp2 dropout vocab"]
    step = make(strategy)
    every = lower_program(step.program, step.facts.mesh, None, None)
    texts = [format_program(every.processes[p].program) for p in range(4)]
    assert texts[0] != texts[1]                  # tp rank 1 holds vocab rows from 32
    assert "vocab rows from 32" in texts[1]
    assert len(classify_ranks(step.program, step.facts.mesh, None)) == 1


def test_format_ranks():
    assert format_ranks([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"
    assert format_ranks([5]) == "5"


def _dumped(tmp_path, kind: str = "partition") -> list[str]:
    return sorted(d.name for d in tmp_path.glob("rank*")
                  if list(d.glob(f"[0-9][0-9]_{kind}.txt")))


def test_dump_ranks_chooses_whose_programs_are_written(tmp_path):
    """Simulating lowers every process (it runs them) and dumps only ``dump_ranks``."""
    make, strategy, _ = CASES["mlp dp2 x tp2"]
    make({**strategy, "debug": {"simulate": True, "dump_dir": str(tmp_path),
                                "dump_ranks": [1, 3]}})
    assert _dumped(tmp_path) == ["rank1", "rank3"]
    assert _dumped(tmp_path, "memory") == ["rank1", "rank3"]


def test_dump_ranks_classes_and_a_rank_off_the_mesh(tmp_path):
    make, strategy, _ = CASES["gpt pp2 x dp2 x tp2 1F1B"]
    make({**strategy, "debug": {"dump_dir": str(tmp_path / "a"), "dump_ranks": "classes"}})
    assert _dumped(tmp_path / "a", "jobs") == ["rank0", "rank4"]      # one per pp position
    with pytest.raises(ValueError, match=r"ranks \[8\] are not on mesh\[2,2,2\]"):
        make({**strategy, "debug": {"dump_dir": str(tmp_path / "b"), "dump_ranks": [0, 8]}})


@pytest.mark.slow
def test_plan_cli_dumps_one_rank_per_class_unless_told(tmp_path):
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, autopar as ap
        from autopar.models import GPT, GPTConfig
        from autopar.models.gpt import lm_loss
        model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8))
        engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()),
                           strategy=ap.Strategy.from_yaml("dp_tp"))
        x = torch.randint(0, 32, (4, 8))
        engine.fit([(a, a) for a in x], batch_size=4, verbose=0)
    """))

    def plan(*extra):
        done = subprocess.run([sys.executable, "-m", "autopar", "plan", str(script), *extra],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    out = plan("--dump-dir", str(tmp_path / "a"))
    assert "rank0/ stands for ranks 0-3" in out
    assert _dumped(tmp_path / "a") == ["rank0"]
    out = plan("--dump-dir", str(tmp_path / "b"), "--ranks", "1,3")
    assert "rank1/, rank3/" in out and _dumped(tmp_path / "b") == ["rank1", "rank3"]
    out = plan("--dump-dir", str(tmp_path / "c"), "--ranks", "all")
    assert _dumped(tmp_path / "c") == ["rank0", "rank1", "rank2", "rank3"]


def test_plan_cli_refuses_a_bad_rank_list():
    from autopar.__main__ import build_parser
    parser = build_parser()
    assert parser.parse_args(["plan", "t.py", "--ranks", "0,517"]).ranks == [0, 517]
    assert parser.parse_args(["plan", "t.py"]).ranks == "classes"
    for bad in ("0,0", "-1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["plan", "t.py", "--ranks", bad])


def test_a_1024_rank_plan_is_costed_by_its_8_classes():
    """dp32 x pp8 x tp4: the reports lower one rank per pipeline position and give every
    rank its numbers (``bench/plan_scale.py`` times it: seconds, not the hours lowering
    every rank took)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=32))
    engine = ap.Engine(model, lm_loss, torch.optim.AdamW(model.parameters()), strategy=ap.Strategy(
        mesh=_mesh([8, 32, 4], ["pp", "dp", "tp"]), data_parallel={"axis": "dp"},
        tensor_parallel=_tp(), pipeline={"axis": "pp", "schedule": "1F1B",
                                         "micro_batches": 8}))
    x = torch.randint(0, 64, (256, 16))
    cost = engine.cost(x, x, profile=Profile.reference())
    assert sorted(cost) == list(range(1024)) and sorted(cost.time.processes) == sorted(cost)
    lowered = engine.planner.steps[next(iter(engine.planner.steps))].every_process
    assert sorted(lowered.processes) == [128 * k for k in range(8)]
    assert lowered.classes.describe().startswith("1024 processes in 8 classes")
    table = format_ranks(p for p in cost if cost[p].peak == cost[517].peak)
    assert "512-639" in table.split(",")
