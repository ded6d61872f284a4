"""The ops ``calibrate`` times one by one: targets whose time the generic matmul and
pointwise curves get badly wrong on CPU, each with a few calls of growing size.

A generic add moves ~0.1 ns a byte here, a gelu or a layer norm costs ~1 ns an element,
SDPA's CPU flash kernel runs far below mm's rate at the same FLOPs, and AdamW is ~9
kernels plus Python per parameter: a step predicted from the generic curves misses half
its time. Each target gets its own curve, over the same size measure the predictor uses
for it (``cost.predict.op_size``: FLOPs for matmul-class ops, parameter bytes for
optimizer updates, bytes read + written otherwise), computed here on an IR op built from
the very call that is timed, so calibration and prediction cannot disagree on it.

A case is ``(fn, op)``: ``fn()`` makes one call, ``op`` describes it (shapes and dtypes).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..ir import Op, OpKind, TensorType, Value
from .timing import kernel

__all__ = ["PROBED", "VIEW_TARGETS", "cases", "view_cases", "ir_op", "Case"]

Case = tuple[Callable[[], object], Op]


def _value(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return Value(TensorType(tuple(obj.shape), obj.dtype))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_value(x) for x in obj)
    return obj


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _flat_tensors(x)]
    return []


def ir_op(target: str, args: tuple, kwargs: dict | None = None) -> Case:
    """Call ``target`` once (a warm-up that also gives the outputs' shapes) and return
    ``(a callable repeating the call, the IR op of the call)``."""
    fn, kwargs = kernel(target), kwargs or {}
    outputs = [Value(TensorType(tuple(t.shape), t.dtype))
               for t in _flat_tensors(fn(*args, **kwargs))]
    op = Op(OpKind.CALL, target, args=_value(args), kwargs=_value(kwargs), outputs=outputs)
    return (lambda: fn(*args, **kwargs)), op


# ------------------------------------------------------------------------ the targets
# (rows, width) of the row-wise ops and (batch x heads, sequence, head dim) of attention:
# from a tiny layer to a large one; the predictor interpolates in log-log between them and
# extends past the last at its throughput.
ROWS = ((64, 64), (512, 128), (2048, 256), (4096, 512))
ELEMENTS = (1 << 12, 1 << 15, 1 << 18, 1 << 21)
ATTENTION = ((8, 32, 16), (32, 64, 16), (32, 128, 32), (32, 256, 32))
PARAMS = (256, 1 << 12, 1 << 16, 1 << 20)        # elements of one optimizer parameter


def _gelu(i: int, dtype: torch.dtype) -> Case:
    return ir_op("aten.gelu.default", (torch.randn(ELEMENTS[i], dtype=dtype),))


def _gelu_backward(i: int, dtype: torch.dtype) -> Case:
    x = torch.randn(ELEMENTS[i], dtype=dtype)
    return ir_op("aten.gelu_backward.default", (torch.randn_like(x), x))


def _layer_norm(i: int, dtype: torch.dtype) -> Case:
    rows, width = ROWS[i]
    return ir_op("aten.native_layer_norm.default",
                 (torch.randn(rows, width, dtype=dtype), [width],
                  torch.randn(width, dtype=dtype), torch.randn(width, dtype=dtype), 1e-5))


def _layer_norm_backward(i: int, dtype: torch.dtype) -> Case:
    rows, width = ROWS[i]
    x, w, b = (torch.randn(rows, width, dtype=dtype), torch.randn(width, dtype=dtype),
               torch.randn(width, dtype=dtype))
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [width], w, b, 1e-5)
    return ir_op("aten.native_layer_norm_backward.default",
                 (torch.randn_like(x), x, [width], mean, rstd, w, b, [True, True, True]))


def _softmax(target: str) -> Callable[[int, torch.dtype], Case]:
    def make(i: int, dtype: torch.dtype) -> Case:
        rows, width = ROWS[i]
        return ir_op(target, (torch.randn(rows, width, dtype=dtype), -1, False))
    return make


def _softmax_backward(target: str) -> Callable[[int, torch.dtype], Case]:
    def make(i: int, dtype: torch.dtype) -> Case:
        rows, width = ROWS[i]
        out = torch.randn(rows, width, dtype=dtype)
        return ir_op(target, (torch.randn_like(out), out, -1, dtype))
    return make


def _attention_inputs(i: int, dtype: torch.dtype) -> list[torch.Tensor]:
    bh, seq, dim = ATTENTION[i]
    return [torch.randn(bh // 4, 4, seq, dim, dtype=dtype) for _ in range(3)]


SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _sdpa(i: int, dtype: torch.dtype) -> Case:
    # causal, as a decoder's attention (GPT): the kernel skips the masked half
    return ir_op(SDPA, (*_attention_inputs(i, dtype), 0.0, True))


def _sdpa_backward(i: int, dtype: torch.dtype) -> Case:
    q, k, v = _attention_inputs(i, dtype)
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, True)
    return ir_op(SDPA_BACKWARD, (torch.randn_like(out), q, k, v, out, logsumexp, 0.0, True))


def _adam(i: int, dtype: torch.dtype) -> Case:
    """One AdamW (torch's defaults: lr 1e-3, weight decay 0.01) update of a group of 8
    parameters through the batched kernel the generated code calls; the op describes one
    parameter and the curve's time is the group's over 8 (a step updates each parameter
    once, in one group call)."""
    from ..ir.kernels.optim import adam_group
    group = 8
    params = [torch.randn(PARAMS[i]) for _ in range(group)]
    grads = [torch.randn_like(p) for p in params]
    hyper = torch.optim.AdamW(params).param_groups[0]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.tensor(0.0) for _ in params]

    def update() -> None:
        adam_group(params, grads, hyper, exp_avgs, exp_avg_sqs, steps)
    update()
    op = Op(OpKind.CALL, "optim.adam",
            args=(_value(params[0]), _value(grads[0]), hyper, _value(exp_avgs[0]),
                  _value(exp_avg_sqs[0]), _value(steps[0])),
            outputs=[_value(params[0])])
    return update, op


# target -> (case maker by size index, calls per timed call, dtypes it is measured in:
# "half" = also float16 and bfloat16)
PROBED: dict[str, tuple[Callable[[int, torch.dtype], Case], int, bool]] = {
    "aten.gelu.default": (_gelu, 1, True),
    "aten.gelu_backward.default": (_gelu_backward, 1, True),
    "aten.native_layer_norm.default": (_layer_norm, 1, True),
    "aten.native_layer_norm_backward.default": (_layer_norm_backward, 1, True),
    "aten._softmax.default": (_softmax("aten._softmax.default"), 1, True),
    "aten._log_softmax.default": (_softmax("aten._log_softmax.default"), 1, False),
    "aten._softmax_backward_data.default":
        (_softmax_backward("aten._softmax_backward_data.default"), 1, True),
    "aten._log_softmax_backward_data.default":
        (_softmax_backward("aten._log_softmax_backward_data.default"), 1, False),
    SDPA: (_sdpa, 1, True),
    SDPA_BACKWARD: (_sdpa_backward, 1, True),
    "optim.adam": (_adam, 8, False),
}


def cases(dtype: torch.dtype, sizes: int) -> list[tuple[str, int, Case]]:
    """``(target, calls per timed call, case)`` for every probed target measured in
    ``dtype``, at the first ``sizes`` sizes."""
    out = []
    for target, (make, calls, half) in PROBED.items():
        if dtype != torch.float32 and not half:
            continue
        for i in range(sizes):
            out.append((target, calls, make(i, dtype)))
    return out


VIEW_TARGETS = ("aten.view.default", "aten.t.default", "aten.transpose.int")


def view_cases() -> list[Callable[[], object]]:
    """Calls of the common view ops on a small tensor: they move no data, their cost is
    aten's dispatch and the view's metadata."""
    x = torch.randn(16, 16)
    view, t, transpose = (kernel(target) for target in VIEW_TARGETS)
    return [lambda: view(x, [4, 64]), lambda: t(x), lambda: transpose(x, 0, 1)]
