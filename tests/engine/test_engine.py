"""Engine API: evaluate / predict / metrics / history / retrace / dumps / refusals."""
import copy

import pytest
import torch

import autopar as ap
from autopar.ir import OpKind, StateKind
from autopar.ir.attrs import NAME, STATE
from autopar.models import GPT, MLP, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.strategy import UnsupportedStrategyError

from ..parity import ATOL, RTOL, lm_data, regression_data


def _mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _mlp_engine(**kwargs):
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    return model, ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_history_has_one_loss_per_step_over_epochs():
    _, engine = _mlp_engine()
    history = engine.fit(regression_data(24, 16, 8), batch_size=4, epochs=2, steps_per_epoch=5,
                         verbose=0)
    assert len(history["loss"]) == 10 and all(isinstance(x, float) for x in history["loss"])
    assert len(history["lr"]) == 10


def test_evaluate_and_predict_match_eager_in_eval_mode():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                          dropout=0.2))
    ref = copy.deepcopy(model).eval()
    data = lm_data(10, 16, 64)

    def accuracy(logits, y):
        return (logits.argmax(-1) == y).float().mean()

    engine = ap.Engine(model, lm_loss, torch.optim.Adam(model.parameters()), metrics=[accuracy])
    scores = engine.evaluate(data, batch_size=4)       # 4 + 4 + 2: a smaller last batch
    with torch.no_grad():
        batches = [data[i:i + 4] for i in range(0, 10, 4)]
        xs = [torch.stack([x for x, _ in b]) for b in batches]
        ys = [torch.stack([y for _, y in b]) for b in batches]
        ref_loss = sum(lm_loss(ref(x), y).item() * len(x) for x, y in zip(xs, ys)) / 10
        ref_acc = sum(accuracy(ref(x), y).item() * len(x) for x, y in zip(xs, ys)) / 10
    assert scores["loss"] == pytest.approx(ref_loss, rel=RTOL, abs=ATOL)
    assert scores["accuracy"] == pytest.approx(ref_acc, rel=RTOL, abs=ATOL)

    outputs = engine.predict([x for x, _ in data], batch_size=4)
    assert [o.shape[0] for o in outputs] == [4, 4, 2]
    with torch.no_grad():
        for ours, x in zip(outputs, xs):
            torch.testing.assert_close(ours, ref(x), rtol=RTOL, atol=ATOL)
    assert model.training, "evaluate/predict must not leave the user's model in eval mode"


def test_prepare_plans_without_running_and_dumps_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DUMP_DIR", str(tmp_path))
    model, engine = _mlp_engine(strategy=ap.Strategy(grad_clip={"max_norm": 1.0}))
    before = copy.deepcopy(model.state_dict())
    program = engine.prepare(torch.randn(4, 16), torch.randn(4, 8))
    files = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    # one numbered dump per pass, in the pass manager's order, then the memory estimate of
    # the lowered program, then the timings
    from autopar.passes import PIPELINE
    assert files == (["00_capture.txt"]
                     + [f"{n:02d}_{p.name}.txt" for n, p in enumerate(PIPELINE, start=1)]
                     + [f"{len(PIPELINE) + 1:02d}_memory.txt", "timings.txt"])
    assert [p.name for p in PIPELINE][:3] == ["decompose_loss", "fold_noops",
                                              "functionalize_writes"]
    assert "optimizer_updates" in (tmp_path / "rank0" / "timings.txt").read_text()
    final = next((tmp_path / "rank0").glob("[0-9][0-9]_optimizer_updates.txt")).read_text()
    assert "optim.sgd" in final and "aten.linalg_vector_norm" in final
    assert "update[head.weight]=" in final
    assert any(op.target == "optim.sgd" for op in program.ops)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), "prepare must not train"


def test_programs_are_cached_per_batch_signature():
    _, engine = _mlp_engine()
    engine.fit(regression_data(10, 16, 8), batch_size=4, verbose=0)   # 4, 4, 2
    assert len(engine.programs()) == 2


def test_unsupported_strategy_section_is_refused_up_front(monkeypatch):
    # the accepted sections are those the passes implement: take amp's passes away, as a
    # version without them would be
    import autopar.passes as passes
    monkeypatch.setattr(passes, "PIPELINE",
                        tuple(p for p in passes.PIPELINE if "amp" not in p.implements))
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]},
                           amp={"enable": True})
    with pytest.raises(UnsupportedStrategyError, match="amp"):
        _mlp_engine(strategy=strategy)


def test_a_new_pass_needs_nothing_from_the_engine(monkeypatch):
    """What a pass needs of the engine it declares: its state's start (``FILL``) and what it
    reports (``report[...]`` results go into the history by name). A pass counting optimizer
    steps, added to the pipeline as a new strategy-level pass would be, trains through
    ``Engine.fit`` as it is: the state starts at its fill, carries over between steps and
    back into the engine's state, and the history has its report."""
    import autopar.passes as passes
    from autopar.ir import Role, Slot, StateKey, TensorType, state_op
    from autopar.pass_infra import Fact, make_pass

    key = StateKey.scaler("optimizer_steps")     # a pass's own scalar state, like the scaler's

    def count_steps(program, ctx):
        if ctx.mode != "train":
            return program
        seen = program.add(state_op(key, TensorType((), torch.float32), Role.OPTIMIZER, 0.0))
        now = program.add_call("aten.add.Tensor", (seen.result, 1.0),
                               [TensorType((), torch.float32)], role=Role.OPTIMIZER)
        program.set_results(program.results() + [(Slot("update", key.name), now.result),
                                                 (Slot("report", "optimizer_steps"),
                                                  now.result)])
        return program

    at = [p.name for p in passes.PIPELINE].index("optimizer_updates") + 1
    monkeypatch.setattr(passes, "PIPELINE", passes.PIPELINE[:at] + (
        make_pass("count_steps", count_steps, needs=(Fact.OPTIMIZER,)),) + passes.PIPELINE[at:])
    _, engine = _mlp_engine()
    history = engine.fit(regression_data(12, 16, 8), batch_size=4, verbose=0)
    assert history["optimizer_steps"] == [1.0, 2.0, 3.0]
    assert engine.state.tensors[key.name].item() == 3.0


def test_a_distributed_plan_without_its_processes_is_refused_not_run_serially():
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]}, data_parallel={"axis": "dp"})
    _, engine = _mlp_engine(strategy=strategy)
    engine.prepare(torch.randn(4, 16), torch.randn(4, 8))    # planning works offline
    with pytest.raises(ValueError, match="mesh has 2 ranks but WORLD_SIZE is 1.*torchrun "
                                         "--nproc-per-node 2.*debug.simulate"):
        engine.fit(regression_data(8, 16, 8), batch_size=4, verbose=0)


def test_unsupported_optimizer_names_itself():
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    engine = ap.Engine(model, _mse, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(NotImplementedError, match="RMSprop.*supported are Adam, AdamW, SGD"):
        engine.fit(regression_data(4, 16, 8), batch_size=4, verbose=0)


def test_fit_without_optimizer_is_a_clear_error():
    model = MLP(16, 32, 8)
    with pytest.raises(ValueError, match="needs an optimizer"):
        ap.Engine(model, _mse).fit(regression_data(4, 16, 8), batch_size=4, verbose=0)


def test_world_size_mismatch_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _, engine = _mlp_engine()
    with pytest.raises(ValueError, match="world size"):
        engine.fit(regression_data(8, 16, 8), batch_size=4, verbose=0)


def test_state_dict_and_optimizer_state_dict_after_fit():
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    engine = ap.Engine(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    engine.fit(regression_data(8, 16, 8), batch_size=4, verbose=0)
    state = engine.state_dict()
    assert set(state) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value)
    buffers = [s["momentum_buffer"] for s in engine.optimizer.state_dict()["state"].values()]
    assert len(buffers) == len(list(model.parameters())) and all(b is not None for b in buffers)


def test_verbose_logs_on_rank0(capsys):
    _, engine = _mlp_engine()
    engine.fit(regression_data(8, 16, 8), batch_size=4, log_freq=1, verbose=2)
    out = capsys.readouterr().out
    assert "step 1/" in out and "loss:" in out


def test_later_programs_keep_parameters_where_training_placed_them():
    strategy = ap.Strategy(mesh={"shape": [2], "dim_names": ["dp"]}, data_parallel={"axis": "dp"})
    _, engine = _mlp_engine(strategy=strategy)
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    train = engine.prepare(x, y)
    evaluation = engine.prepare(x, y, mode="eval")
    placed = lambda program: {op.attrs[NAME]: op.result.dist  # noqa: E731
                              for op in program.ops_of(OpKind.STATE)
                              if op.attrs[STATE].kind is StateKind.PARAM}
    assert placed(evaluation) == placed(train)
    assert "kept where an earlier program placed it" in engine.explain("head.weight", mode="eval")
