"""The op table (``ir.ops``): one place resolves a target and says what it is."""
from __future__ import annotations

import pytest
import torch

from autopar.ir import Op, OpKind, TensorType, Value
from autopar.ir.ops import UnknownOpError, draws_random, kernel, op_info, resolve, schema_args

F32 = torch.float32


def _call(target: str, args: tuple, kwargs: dict | None = None) -> Op:
    return Op(OpKind.CALL, target, args, kwargs or {}, [Value(TensorType((2, 4, 8, 16), F32))])


def _qkv() -> tuple[Value, Value, Value]:
    return tuple(Value(TensorType((2, 4, 8, 16), F32)) for _ in range(3))


def test_aten_traits_come_from_schema_and_tags():
    assert op_info("aten.bernoulli_.float").random and op_info("aten.bernoulli_.float").mutates
    assert op_info("aten.add.Tensor").pointwise and not op_info("aten.add.Tensor").effectful
    assert op_info("aten.t.default").view and not op_info("aten.mm.default").view
    assert resolve("aten.mm.default") is torch.ops.aten.mm.default


def test_autopar_kernels_declare_their_traits():
    assert op_info("autopar.set_rng_state").effectful
    assert op_info("autopar.sliced_random").random
    assert not op_info("autopar.vocab_embedding").effectful
    assert op_info("optim.adam").batched is not None


def test_an_omitted_dropout_probability_is_the_schema_default_not_a_draw():
    """CPU flash attention called without ``dropout_p`` (Hugging Face's SDPA with a mask)
    draws nothing: the omitted argument is its schema default, 0.0."""
    target = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    q, k, v = _qkv()
    assert op_info(target).random                        # the kernel can draw...
    assert not draws_random(_call(target, (q, k, v)))    # ...but this call does not
    assert not draws_random(_call(target, (q, k, v, 0.0)))
    assert draws_random(_call(target, (q, k, v), {"dropout_p": 0.1}))
    assert schema_args(_call(target, (q, k, v)))["dropout_p"] == 0.0


def test_an_unknown_target_names_the_op_and_the_table():
    with pytest.raises(UnknownOpError, match="autopar.nope.*op table"):
        resolve("autopar.nope")
    with pytest.raises(UnknownOpError, match="aten.no_such_op.default"):
        op_info("aten.no_such_op.default")


def test_a_kernel_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        kernel("autopar.annotate")(lambda x: x)
