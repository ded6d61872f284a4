"""Completion through the public API: annotations (shard_tensor, the YAML plan,
data_parallel) in, a placement on every value out, with the communication the placements
imply and an explanation for each choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar as ap
from autopar.ir import OpKind, Role
from autopar.ir.attrs import NAME
from autopar.ir.dist import Partial, Replicate, Shard
from autopar.pass_infra.explain import describe_reason, planned_moves
from autopar.pass_infra.pinning import AnnotationError
from autopar.passes.completion import MissingRuleError, MissingRuleWarning

from ..models_zoo import MegatronMLP, mse

TP = ap.ProcessMesh([0, 1], dim_names=["tp"])


_mse = mse


def _plan(model, strategy=None, x=None, y=None, loss=_mse, optimizer=None):
    torch.manual_seed(0)
    engine = ap.Engine(model, loss, optimizer or torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy or ap.Strategy())
    x = torch.randn(8, 16) if x is None else x
    y = torch.randn(8, 16) if y is None else y
    return engine, engine.prepare(x, y)


def _by_target(program, target, role=Role.FORWARD):
    return [op for op in program.ops if op.target == target and op.role is role]


def _placements(v):
    return tuple(v.dist.placements)


def _before_reshard(v):
    """The value as its producer made it, before the comm ops reshard inserted."""
    while v.producer.kind is OpKind.COMM:
        op = v.producer    # a bucket's wait hands back its start's inputs, reduced
        v = op.args[0].producer.args[v.index] if op.target == "comm.wait" else op.args[0]
    return v


def _moves(program, role=None):
    return [m for m in planned_moves(program) if role is None or m.role == role.value]


def test_megatron_mlp_from_shard_tensor_needs_no_communication_between_the_matmuls():
    model = MegatronMLP()
    ap.shard_tensor(model.fc1.weight, TP, [Shard(0)])
    ap.shard_tensor(model.fc1.bias, TP, [Shard(0)])
    ap.shard_tensor(model.fc2.weight, TP, [Shard(1)])
    _, program = _plan(model)
    first, second = _by_target(program, "aten.addmm.default")
    assert _placements(first.result) == (Shard(1),)
    assert _placements(second.result) == (Partial("sum"),)
    # forward: nothing is sent into either matmul (the row-parallel bias only becomes a
    # local partial term); the only forward communication reduces the output, for the loss
    into_matmuls = [m for m in _moves(program, Role.FORWARD) if m.consumer == "aten.addmm.default"]
    assert [(m.kind, m.sent) for m in into_matmuls] == [("make_partial", 0.0)]
    assert {m.kind for m in _moves(program, Role.LOSS)} <= {"all_reduce"}
    gelu = _by_target(program, "aten.gelu.default")[0]
    assert gelu.needs == (gelu.args[0].dist,) and _placements(gelu.result) == (Shard(1),)


def test_megatron_backward_agrees_with_forward_and_sharded_grads_need_no_gather():
    model = MegatronMLP()
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]},
                           tensor_parallel={"axis": "tp",
                                            "plan": {"fc1": "colwise", "fc2": "rowwise"}})
    engine, program = _plan(model, strategy)
    updates = {op.args[0].producer.attrs[NAME]: op for op in program.ops
               if op.role is Role.OPTIMIZER and op.kind is OpKind.CALL}
    for name, want in {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1),
                       "fc2.bias": Replicate()}.items():
        update = updates[name]
        param, grad = update.args[0], _before_reshard(update.args[1])
        assert _placements(param) == (want,), name
        # the gradient arrives as the parameter is placed, or as a partial of it on tp
        if want != Replicate():
            assert _placements(grad) == (want,), (name, grad.dist)
    # backward of column-parallel fc1: the input gradient would be Partial (dx of fc1 is
    # not needed here: x needs no grad), and no all-gather happens in backward
    assert not [m for m in _moves(program, Role.BACKWARD) if m.kind == "all_gather"]
    assert "tensor_parallel.plan 'fc1': colwise" in engine.explain("fc1.weight")


def test_data_parallel_makes_gradients_partial_sum_on_dp_and_the_optimizer_reduces_them():
    model = MegatronMLP()
    strategy = ap.Strategy(mesh={"shape": [4], "dim_names": ["dp"]}, data_parallel={"axis": "dp"})
    engine, program = _plan(model, strategy)
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role is Role.OPTIMIZER:
            assert _placements(_before_reshard(op.args[1])) == (Partial("sum"),)
            assert _placements(op.args[1]) == (Replicate(),)       # reduced by reshard
            assert op.needs[1].placements == (Replicate(),)
    opt_moves = {(m.kind, m.axis) for m in _moves(program, Role.OPTIMIZER)}
    assert opt_moves == {("all_reduce", "dp")}
    # the only other communication: the loss terms (sum and count) are scalars
    others = [m for m in _moves(program) if m.role != Role.OPTIMIZER.value]
    assert all(m.value.type.numel == 1 for m in others), others
    why = engine.explain("grad[fc1.weight]")
    rule = next(line for line in why.splitlines() if line.lstrip().startswith("rule:"))
    assert "{P(sum)} -> {R}" in rule and "data_parallel.axis dp" in why
    chain = engine.explain("grad[fc1.weight]", depth=1).split("value by value (1 deep):")[1]
    assert "{P(sum)}" in chain.splitlines()[2]      # the gradient before its all-reduce


def test_every_value_is_placed_for_gpt_on_a_2d_mesh_and_plan_dims_follow_graph_use():
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import lm_loss
    strategy = ap.Strategy.from_yaml("configs/dp_tp.yaml")
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    ids = torch.randint(0, 64, (4, 16))
    engine, program = _plan(model, strategy, ids, ids, loss=lm_loss,
                            optimizer=torch.optim.AdamW(model.parameters()))
    unplaced = [op.target for op in program.ops for v in op.outputs
                if v.is_tensor and v.dist is None]
    assert not unplaced
    for op in program.ops:
        if op.kind is OpKind.CALL:
            assert len(op.needs) == len([v for v in op.inputs if v.is_tensor]), op.target
    params = {op.attrs[NAME]: op.result for op in program.states()}
    tp = lambda name: params[name].dist.placements[1]  # noqa: E731
    assert tp("blocks.0.fc1.weight") == Shard(0) and tp("blocks.0.fc2.weight") == Shard(1)
    assert tp("wte.weight") == Shard(0) and tp("blocks.0.fc2.bias") == Replicate()
    assert all(p.dist.placements[0] == Replicate() for p in params.values())
    # backward agrees with forward: every gradient lies as its parameter does, or is a
    # partial of it (reduced, never re-cut, before the update)
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role is Role.OPTIMIZER:
            grad = _before_reshard(op.args[1])
            for want, got in zip(op.args[0].dist.placements, grad.dist.placements):
                assert got == want or isinstance(got, Partial), (op.module, want, got)


def test_hf_conv1d_weights_stored_transposed_get_the_right_plan_dims():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]}, tensor_parallel={
        "axis": "tp", "plan": {"transformer.h.*.mlp.c_fc": "colwise",
                               "transformer.h.*.mlp.c_proj": "rowwise"}})
    ids = torch.randint(0, 64, (2, 8))
    _, program = _plan(model, strategy, {"input_ids": ids}, ids, loss=None)
    params = {op.attrs[NAME]: op.result for op in program.states()}
    # Conv1D stores [in, out]: column-parallel shards dim 1, row-parallel dim 0
    assert params["transformer.h.0.mlp.c_fc.weight"].dist.placements == (Shard(1),)
    assert params["transformer.h.0.mlp.c_fc.bias"].dist.placements == (Shard(0),)
    assert params["transformer.h.0.mlp.c_proj.weight"].dist.placements == (Shard(0),)
    assert params["transformer.h.0.mlp.c_proj.bias"].dist.placements == (Replicate(),)


def test_llama_swiglu_mlp_runs_column_then_row_without_gathering():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]}, tensor_parallel={
        "axis": "tp", "plan": {"model.layers.*.mlp.gate_proj": "colwise",
                               "model.layers.*.mlp.up_proj": "colwise",
                               "model.layers.*.mlp.down_proj": "rowwise"}})
    ids = torch.randint(0, 64, (2, 8))
    _, program = _plan(model, strategy, {"input_ids": ids}, ids, loss=None)
    down = [op for op in program.ops if op.module.endswith("down_proj") and op.role is Role.FORWARD
            and op.target == "aten.mm.default"][0]
    assert down.result.dist.placements == (Partial("sum"),)
    mlp_moves = [m for m in _moves(program, Role.FORWARD) if ".mlp" in m.module]
    assert not mlp_moves, [(m.consumer, m.kind) for m in mlp_moves]


class _Conflict(nn.Module):
    """Two activations pinned with clashing shardings meet in a matmul; moving the smaller
    one is cheaper, so completion keeps the big one where it is."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(64, 8))
        self.b = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        big = ap.shard_tensor(x @ self.a, TP, [Shard(0)])          # [16, 8] rows
        small = ap.shard_tensor(self.b * 1.0, TP, [Shard(1)])       # [8, 4] cols
        return big @ small


def test_a_conflict_picks_the_cheaper_reshard():
    model = _Conflict()
    _, program = _plan(model, x=torch.randn(16, 64), y=torch.randn(16, 4))
    mm = [op for op in program.ops
          if op.target == "aten.mm.default" and op.role is Role.FORWARD][-1]
    big, small = mm.args
    assert mm.needs[0] == big.dist                               # the big one stays sharded
    assert mm.needs[1].placements == (Replicate(),)              # the small one is gathered
    assert "over" in describe_reason(mm.result.why, {}, ("tp",))


def test_annotations_are_never_overridden_and_reshard_is_planned_instead():
    class Pinned(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return ap.shard_tensor(self.fc(x), TP, [Replicate()]) * 2

    model = Pinned()
    ap.shard_tensor(model.fc.weight, TP, [Shard(0)])
    engine, program = _plan(model)
    annotate = [op for op in program.ops if op.target == "autopar.annotate"][0]
    assert annotate.result.dist.placements == (Replicate(),)
    assert _before_reshard(annotate.args[0]).dist.placements == (Shard(1),)
    assert annotate.args[0].producer.target == "comm.all_gather"
    assert annotate.needs[0].placements == (Replicate(),)
    assert program.states()[0].result.dist.placements == (Shard(0),)
    assert "shard_tensor in forward" in engine.explain(
        f"%{list(_names(program)).index(annotate.result)}")


def _names(program):
    return [v for op in program.ops for v in op.outputs]


class _Cumprod(nn.Module):
    """cumprod has no SPMD rule (cumsum has one)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.cumprod(self.fc(x), 1)


def test_an_op_without_a_rule_warns_by_name_and_runs_replicated_or_errors_when_strict():
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]}, data_parallel={"axis": "dp"})
    with pytest.warns(MissingRuleWarning, match=r"cumprod.default \(top level, fwd\)"):
        _, program = _plan(_Cumprod(), strategy)
    op = [op for op in program.ops if "cumprod" in op.target][0]
    assert op.needs[0].placements == (Replicate(),) and op.result.dist.placements == (Replicate(),)
    strict = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]}, data_parallel={"axis": "dp"},
                         debug={"strict_rules": True})
    with pytest.raises(MissingRuleError, match="cumprod"):
        _plan(_Cumprod(), strict)


def test_plan_errors_name_the_entry_and_the_modules():
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]},
                           tensor_parallel={"axis": "tp", "plan": {"fc3": "colwise"}})
    with pytest.raises(AnnotationError, match=r"'fc3'.*matches no module.*fc1, fc2"):
        _plan(MegatronMLP(), strategy)


def test_an_annotation_on_another_mesh_is_refused():
    model = MegatronMLP()
    ap.shard_tensor(model.fc1.weight, ap.ProcessMesh([0, 1, 2, 3], ["tp"]), [Shard(0)])
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["tp"]})
    with pytest.raises(AnnotationError, match="one mesh"):
        _plan(model, strategy)


def test_offline_planning_of_a_64_rank_mesh_in_one_process(tmp_path):
    from autopar.models import GPT, GPTConfig
    from autopar.models.gpt import lm_loss
    strategy = ap.Strategy(mesh={"shape": [8, 8], "dim_names": ["dp", "tp"]},
                           data_parallel={"axis": "dp"},
                           tensor_parallel={"axis": "tp", "plan": {"blocks.*.fc1": "colwise",
                                                                   "blocks.*.fc2": "rowwise"}},
                           debug={"dump_dir": str(tmp_path)})
    model = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    ids = torch.randint(0, 64, (16, 16))
    engine, program = _plan(model, strategy, ids, ids, loss=lm_loss)
    assert program.states()[0].result.dist.mesh.size == 64
    dumped = {p.name for p in (tmp_path / "rank0").iterdir()}
    assert {"completion.txt", "completion.explain.txt"} <= {n[3:] for n in dumped}
    text = next((tmp_path / "rank0").glob("[0-9][0-9]_completion.txt")).read_text()
    assert "{S(0),P(sum)}" in text and "reshard" in text
    with pytest.raises(ValueError, match="64 ranks but WORLD_SIZE is 1.*torchrun"):
        engine.fit([(row, row) for row in ids], batch_size=16, verbose=0)


def test_cli_plans_an_unmodified_script_and_explains(capsys, tmp_path):
    from autopar.__main__ import main
    main(["plan", "examples/train_gpt.py", "--strategy", "configs/dp.yaml", "--dump-dir",
          str(tmp_path), "--explain", "grad[blocks.0.fc1.weight]", "--depth", "2", "--",
          "--layers", "1"])
    out = capsys.readouterr().out
    assert "mesh: mesh[2](dp)" in out
    assert "all_reduce" in out and "on dp" in out
    assert "explain grad[blocks.0.fc1.weight]" in out and "data_parallel.axis dp" in out
    assert "the reasons behind it, value by value (2 deep)" in out
    assert list((tmp_path / "rank0").glob("[0-9][0-9]_completion.txt"))


def test_serial_programs_are_not_placed():
    _, program = _plan(MegatronMLP())
    assert all(v.dist is None for op in program.ops for v in op.outputs)


def test_an_annotated_model_still_runs_as_plain_torch_and_on_a_one_rank_mesh():
    from ..parity import assert_same_losses, eager_train, regression_data, twin
    one = ap.ProcessMesh([0], dim_names=["tp"])

    class Annotated(MegatronMLP):
        def forward(self, x):
            return self.fc2(ap.shard_tensor(F.gelu(self.fc1(x)), one, [Shard(1)]))

    torch.manual_seed(0)
    model = Annotated()
    reference = twin(model)
    data = regression_data(16, 16, 16)
    ref_losses = eager_train(reference, _mse, torch.optim.SGD(reference.parameters(), lr=0.1),
                             data, batch_size=4, steps=4)
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = engine.fit(data, batch_size=4, verbose=0)["loss"]
    assert_same_losses(losses, ref_losses)
