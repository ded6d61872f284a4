"""IR: printer golden text, verifier invariants, copying."""
import pytest
import torch

from autopar.capture.step import capture
from autopar.ir import (
    Op,
    OpKind,
    Program,
    Role,
    Slot,
    StateKey,
    TensorType,
    Value,
    VerificationError,
    format_program,
    verify,
)
from autopar.ir.attrs import NAME, SLOTS, STATE


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _tiny_program() -> Program:
    torch.manual_seed(0)
    return capture(Tiny(), lambda out, y: (out - y).pow(2).sum(), torch.randn(4, 3),
                   torch.randn(4, 2)).program


GOLDEN = """\
%0: f32[2,3] = state param 'fc.weight'
%1: f32[4,3] = input 'batch/0'
%2: f32[4,2] = input 'batch/1'
%3: f32[3,2] = aten.t(%0)  # fc fwd
%4: f32[4,2] = aten.mm(%1, %3)  # fc fwd
%5: f32[4,2] = aten.relu(%4)  # - fwd
%6: f32[4,2] = aten.detach(%5)  # - fwd
%7: f32[4,2] = aten.sub.Tensor(%5, %2)  # <loss> loss
%8: f32[4,2] = aten.pow.Tensor_Scalar(%7, 2)  # <loss> loss
%9: f32[] = aten.sum(%8)  # <loss> loss
%10: f32[] = aten.ones_like(%9, pin_memory=False, memory_format=torch.preserve_format)  # <loss> bwd of %9
%11: f32[4,2] = aten.expand(%10, [4, 2])  # <loss> bwd of %9
%12: f32[4,2] = aten.pow.Tensor_Scalar(%7, 1.0)  # <loss> bwd of %8
%13: f32[4,2] = aten.mul.Scalar(%12, 2.0)  # <loss> bwd of %8
%14: f32[4,2] = aten.mul.Tensor(%11, %13)  # <loss> bwd of %8
%15: f32[4,2] = aten.detach(%6)  # - bwd of %5
%16: f32[4,2] = aten.threshold_backward(%14, %15, 0)  # - bwd of %5
%17: f32[2,4] = aten.t(%16)  # fc bwd of %4
%18: f32[2,3] = aten.mm(%17, %1)  # fc bwd of %4
%19: f32[3,2] = aten.t(%18)  # fc bwd of %4
%20: f32[2,3] = aten.t(%19)  # fc bwd of %3
output loss=%9, grad[fc.weight]=%20
"""  # noqa: E501


def test_printer_golden():
    assert format_program(_tiny_program()) == GOLDEN


def test_printing_is_deterministic_and_copy_prints_equal():
    program = _tiny_program()
    assert format_program(program) == format_program(program)
    copied = program.copy()
    assert format_program(copied) == format_program(program)
    assert not set(copied.ops) & set(program.ops)
    verify(copied)


def test_backward_ops_link_forward_ops():
    program = _tiny_program()
    linked = [op for op in program.ops if op.role is Role.BACKWARD and op.forward_op is not None]
    assert linked, "no backward op was linked to its forward op"
    for op in linked:
        assert op.forward_op in program.ops
        assert op.forward_op.role in (Role.FORWARD, Role.LOSS)
        assert op.module == op.forward_op.module


def _program_with(*ops: Op) -> Program:
    program = Program()
    for op in ops:
        program.add(op)
    return program


def _state(name: str) -> Op:
    return Op(OpKind.STATE, "state", outputs=[Value(TensorType((2,), torch.float32))],
              attrs={STATE: StateKey.of_param(name), NAME: name})


def _output(*values: Value) -> Op:
    return Op(OpKind.OUTPUT, "output", args=values,
              attrs={SLOTS: tuple(Slot("output", str(i)) for i in range(len(values)))})


def test_verifier_accepts_a_valid_program():
    a = _state("a")
    verify(_program_with(a, _output(a.result)))


def test_verifier_rejects_use_before_definition():
    a = _state("a")
    neg = Op(OpKind.CALL, "aten.neg.default", args=(a.outputs[0],),
             outputs=[Value(TensorType((2,), torch.float32))])
    program = _program_with(neg, a, _output(neg.result))
    with pytest.raises(VerificationError, match="not defined before"):
        verify(program)


def test_verifier_rejects_missing_output_and_duplicate_state():
    with pytest.raises(VerificationError, match="output"):
        verify(_program_with(_state("a")))
    a, b = _state("w"), _state("w")
    with pytest.raises(VerificationError, match="duplicate state name 'w'"):
        verify(_program_with(a, b, _output(a.result)))


def test_a_state_op_says_what_it_reads_by_its_typed_key():
    """A state's NAME is its ``StateKey``'s name: what a state is (whose optimizer state,
    which accumulator) is read from the key, never split from the name."""
    key = StateKey.optimizer("fc.weight", "exp_avg")
    assert key.name == "fc.weight/exp_avg" and key.param == "fc.weight" and not key.of_module
    assert StateKey.accumulator("fc.weight").name == "gradient_merge/fc.weight"
    assert StateKey.scaler("loss_scale").name == "amp/loss_scale"
    a = _state("w")
    a.attrs[NAME] = "v"
    with pytest.raises(VerificationError, match="NAME 'v' is not its StateKey's"):
        verify(_program_with(a, _output(a.result)))


def test_verifier_rejects_forward_reading_backward():
    a = _state("a")
    back = Op(OpKind.CALL, "aten.neg.default", args=(a.result,), role=Role.BACKWARD,
              outputs=[Value(TensorType((2,), torch.float32))])
    fwd = Op(OpKind.CALL, "aten.neg.default", args=(back.outputs[0],), role=Role.FORWARD,
             module="blocks.0", outputs=[Value(TensorType((2,), torch.float32))])
    with pytest.raises(VerificationError, match="forward op reads a bwd value.*blocks.0"):
        verify(_program_with(a, back, fwd, _output(fwd.result)))


def test_verifier_rejects_bad_slot():
    a = _state("a")
    out = Op(OpKind.OUTPUT, "output", args=(a.result,), attrs={SLOTS: (Slot("weird"),)})
    with pytest.raises(VerificationError, match="slot kind 'weird'"):
        verify(_program_with(a, out))


def test_verifier_rejects_untyped_and_mistyped_op_attributes():
    """Op attributes are typed: a key is a declared Attr and its value has the Attr's type,
    so no pass hands a later one an untyped side channel."""
    from autopar.ir.attrs import LOCAL_NOTE
    a = _state("a")
    neg = Op(OpKind.CALL, "aten.neg.default", args=(a.result,),
             outputs=[Value(TensorType((2,), torch.float32))], module="fc1")
    program = _program_with(a, neg, _output(neg.result))
    neg.attrs[LOCAL_NOTE] = "fine"
    verify(program)
    neg.attrs[LOCAL_NOTE] = 3
    with pytest.raises(VerificationError, match="'local_note' holds a int, not str.*fc1"):
        verify(program)
    del neg.attrs[LOCAL_NOTE]
    neg.attrs["_stage"] = 0
    with pytest.raises(VerificationError, match="key '_stage' is not a declared Attr"):
        verify(program)


def test_attribute_names_are_declared_once():
    from autopar.ir.attrs import Attr
    with pytest.raises(ValueError, match="'name' declared twice"):
        Attr("name", str, "again")
