"""Individual passes on captured programs."""
import pytest
import torch

from autopar.capture.step import capture
from autopar.ir import OpKind, Program, format_program, verify
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.pass_infra.manager import PassManager
from autopar.passes import pass_manager
from autopar.passes.dead_code import dead_code
from autopar.passes.fold_noops import fold_noops
from autopar.strategy import Strategy


def _gpt_program() -> Program:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, sdpa=False))
    x = torch.randint(0, 32, (2, 8))
    return capture(model, lm_loss, x, x).program


def _targets(program: Program) -> list[str]:
    return [op.target for op in program.ops if op.kind is OpKind.CALL]


def test_fold_noops_removes_detach_and_double_transpose():
    program = _gpt_program()
    assert "aten.detach.default" in _targets(program)
    folded = fold_noops(program, PassContext(PlanInputs.of(Strategy())))
    verify(folded)
    assert "aten.detach.default" not in _targets(folded)
    for op in folded.ops:
        if op.target == "aten.t.default":
            inner = op.args[0].producer
            assert inner.target != "aten.t.default"


def test_dead_code_drops_unused_ops_but_keeps_results():
    program = _gpt_program()
    results_before = [slot for slot, _ in program.results()]
    before = len(program.ops)
    pruned = dead_code(program, PassContext(PlanInputs.of(Strategy())))
    verify(pruned)
    assert len(pruned.ops) <= before
    assert [slot for slot, _ in pruned.results()] == results_before
    used = {v for op in pruned.ops for v in op.inputs}
    for op in pruned.ops:
        if op.kind is OpKind.CALL and not any(v in used for v in op.outputs):
            pytest.fail(f"dead op {op.target} survived")


def test_manager_refuses_unknown_disabled_pass_and_names_failing_pass():
    with pytest.raises(ValueError, match="unknown passes"):
        pass_manager(disabled=frozenset({"nope"})).run(_gpt_program(),
                                                      PassContext(PlanInputs.of(Strategy())))

    def broken(program, ctx):
        program.ops.pop(0)          # drops a definition: the verifier must catch it
        return program

    from autopar.pass_infra.manager import Pass
    manager = PassManager(passes=(Pass("broken", broken),))
    with pytest.raises(Exception) as info:
        manager.run(_gpt_program(), PassContext(PlanInputs.of(Strategy())))
    assert "after pass 'broken'" in "\n".join(getattr(info.value, "__notes__", []))


def test_passes_keep_dumps_stable():
    a, b = _gpt_program(), _gpt_program()
    inputs = PlanInputs.of(Strategy())
    assert format_program(pass_manager().run(a, PassContext(inputs))) == \
        format_program(pass_manager().run(b, PassContext(inputs)))


def test_a_pass_that_needs_a_disabled_pass_s_fact_fails_naming_it():
    """Disabling a pass that later passes depend on fails loudly before they run."""
    from autopar.pass_infra.context import FactError
    inputs = PlanInputs.of(Strategy())
    with pytest.raises(FactError, match="pass 'pin_annotations' needs 'mesh', made by "
                                        "settle_mesh \\(disabled\\)"):
        pass_manager(disabled=frozenset({"settle_mesh"})).run(_gpt_program(), PassContext(inputs))
    with pytest.raises(FactError, match="pass 'ring_shifts' needs 'resharded', made by "
                                        "reshard \\(disabled\\)"):
        pass_manager(disabled=frozenset({"reshard"})).run(_gpt_program(), PassContext(inputs))
    # a pass nothing later needs may be left out
    pass_manager(disabled=frozenset({"fold_noops", "bucket_collectives"})).run(
        _gpt_program(), PassContext(inputs))


def test_plan_facts_are_read_only_after_the_pass_that_makes_them():
    from autopar.pass_infra.context import FactError, PlanState
    state = PlanState()
    with pytest.raises(FactError, match="'mesh' is read before pass 'settle_mesh' made it"):
        state.mesh
    state.settle_mesh(None, None, {}, {})
    assert state.mesh is None and state.pipeline is None
    with pytest.raises(FactError, match="made twice"):
        state.settle_mesh(None, None, {}, {})


def test_a_pass_must_make_the_facts_it_declares():
    from autopar.pass_infra.context import Fact, FactError
    from autopar.pass_infra.manager import Pass
    lazy = Pass("lazy", lambda program, ctx: program, makes=frozenset({Fact.MESH}))
    with pytest.raises(FactError, match="pass 'lazy' declares it makes \\['mesh'\\] but left"):
        PassManager(passes=(lazy,)).run(_gpt_program(), PassContext(PlanInputs.of(Strategy())))
