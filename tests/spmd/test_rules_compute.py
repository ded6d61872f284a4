"""SPMD rules of the compute op families, as tables: an op, a mesh and input placements ->
the placements the rule needs and produces (forward), or output placements -> input needs
(reverse). Every expectation is one the op's semantics force, not just what the engine says
(e.g. mm with k sharded -> Partial(sum); layer norm with its normalized dim sharded -> the
input is gathered)."""
from __future__ import annotations

import pytest
import torch

from autopar.ir.core import Op, OpKind
from autopar.spmd import lookup

from ..spmd_util import MESH1, MESH2, T, forward, make_op, reverse

A = "aten."
SDPA = "aten._scaled_dot_product_"
I64 = torch.int64
BOOL = torch.bool
R1, P1 = "R", "P(sum)"
RR, PP = "R,R", "P(sum),P(sum)"




def ln_backward_grad_input_only() -> Op:
    """native_layer_norm_backward with output_mask [True, False, False]: the weight and bias
    grads are None, so lowering gives them non-tensor values."""
    x = (T(4, 8, 16), T(4, 8, 16), [16], T(4, 8, 1), T(4, 8, 1), T(16), T(16),
         [True, False, False])
    return make_op(A + "native_layer_norm_backward.default", *x)


Q, K, V = T(4, 8, 16, 32), T(4, 8, 12, 32), T(4, 8, 12, 32)
# CUDA-only kernels have meta implementations; make_op builds them on meta tensors.
FLASH = make_op(SDPA + "flash_attention.default", Q, K, V, 0.0, True)
EFF_BIAS = (Q, K, V, T(1, 1, 16, 12), True, 0.0, False)
EFF = make_op(SDPA + "efficient_attention.default", *EFF_BIAS)
CUDNN = make_op(SDPA + "cudnn_attention.default", Q, K, V, None, True)
EFF_BW = make_op(SDPA + "efficient_attention_backward.default", Q, Q, K, V, T(1, 1, 16, 12),
                Q, T(4, 8, 32), T(2, dtype=I64), T(dtype=I64), 0.0, [True] * 4)
FLASH_BW = make_op(SDPA + "flash_attention_backward.default", Q, Q, K, V, Q, T(4, 8, 16),
                  None, None, 16, 12, 0.0, True, T(2, dtype=I64), T(dtype=I64))
CUDNN_BW = make_op(SDPA + "cudnn_attention_backward.default", Q, Q, K, V, Q, T(4, 8, 16, 1),
                  T(dtype=I64), T(dtype=I64), T(4, 8, 16, 12), None, None, 16, 12, 0.0, True)
CPU_SDPA = SDPA + "flash_attention_for_cpu.default"
CPU_SDPA_BW = SDPA + "flash_attention_for_cpu_backward.default"

mk = make_op
# (id, op, mesh, input placements, expected needs, expected outputs)
FORWARD = [
    # --- matrix products
    ("mm/rows", mk(A + "mm.default", T(8, 16), T(16, 32)), MESH1, ("S(0)", "R"),
     ["S(0)", "R"], ["S(0)"]),
    ("mm/k-sharded->partial", mk(A + "mm.default", T(8, 16), T(16, 32)), MESH1,
     ("S(1)", "S(0)"), ["S(1)", "S(0)"], [P1]),
    ("mm/column", mk(A + "mm.default", T(8, 16), T(16, 32)), MESH1, ("R", "S(1)"),
     ["R", "S(1)"], ["S(1)"]),
    # a partial is carried through a linear op when the result is no bigger (the same
    # reduction, later); into a bigger result it is reduced first (cheaper, as Megatron does)
    ("mm/partial-lhs-passes", mk(A + "mm.default", T(8, 16), T(16, 16)), MESH1, (P1, "R"),
     [P1, "R"], [P1]),
    ("mm/partial-lhs-reduced-before-a-wider-result", mk(A + "mm.default", T(8, 16), T(16, 32)),
     MESH1, (P1, "R"), ["R", "R"], ["R"]),
    ("mm/two-partials-one-reduced", mk(A + "mm.default", T(8, 16), T(16, 16)), MESH1,
     (P1, P1), [P1, "R"], [P1]),
    ("mm/megatron-column", mk(A + "mm.default", T(8, 16), T(16, 32)), MESH2,
     ("S(0),R", "R,S(1)"), ["S(0),R", "R,S(1)"], ["S(0),S(1)"]),
    ("mm/megatron-row", mk(A + "mm.default", T(8, 32), T(32, 16)), MESH2,
     ("S(0),S(1)", "R,S(0)"), ["S(0),S(1)", "R,S(0)"], ["S(0),P(sum)"]),
    ("bmm/batch", mk(A + "bmm.default", T(4, 8, 16), T(4, 16, 8)), MESH1, ("S(0)", "S(0)"),
     ["S(0)", "S(0)"], ["S(0)"]),
    ("bmm/k-sharded", mk(A + "bmm.default", T(4, 8, 16), T(4, 16, 8)), MESH1,
     ("S(2)", "S(1)"), ["S(2)", "S(1)"], [P1]),
    ("addmm/k-sharded-bias-partial", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)),
     MESH1, ("R", "S(1)", "S(0)"), [P1, "S(1)", "S(0)"], [P1]),
    ("addmm/column-bias-sharded", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)),
     MESH1, ("R", "R", "S(1)"), ["S(0)", "R", "S(1)"], ["S(1)"]),
    ("addmm/partial-operand-bias-partial",
     mk(A + "addmm.default", T(8, 16), T(8, 16), T(16, 16)), MESH1, ("R", P1, "R"),
     [P1, P1, "R"], [P1]),
    ("addmm/dp+row-parallel", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)), MESH2,
     (RR, "S(0),S(1)", "R,S(0)"), ["R,P(sum)", "S(0),S(1)", "R,S(0)"], ["S(0),P(sum)"]),
    ("addmm/partial-bias-alone-reduced", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)),
     MESH1, (P1, "R", "R"), ["R", "R", "R"], ["R"]),
    ("baddbmm/batch", mk(A + "baddbmm.default", T(4, 8, 8), T(4, 8, 16), T(4, 16, 8)),
     MESH1, ("S(0)", "S(0)", "S(0)"), ["S(0)", "S(0)", "S(0)"], ["S(0)"]),
    ("baddbmm/broadcast-bias-k-sharded",
     mk(A + "baddbmm.default", T(1, 8, 8), T(4, 8, 16), T(4, 16, 8)), MESH1,
     ("R", "S(2)", "S(1)"), [P1, "S(2)", "S(1)"], [P1]),
    # --- elementwise: linear ones
    ("add/both-partial", mk(A + "add.Tensor", T(8, 16), T(8, 16)), MESH1, (P1, P1),
     [P1, P1], [P1]),
    ("add/partial+bias", mk(A + "add.Tensor", T(8, 16), T(16)), MESH1, (P1, "R"),
     [P1, P1], [P1]),
    ("add/rows+bias", mk(A + "add.Tensor", T(8, 16), T(16)), MESH1, ("S(0)", "R"),
     ["S(0)", "R"], ["S(0)"]),
    ("add/broadcast-dim", mk(A + "add.Tensor", T(8, 16), T(8, 1)), MESH1, ("S(1)", "R"),
     ["S(1)", "R"], ["S(1)"]),
    ("add/python-scalar-not-linear", mk(A + "add.Tensor", T(8, 16), 1.0), MESH1, (P1,),
     ["R"], ["R"]),
    ("sub/2d", mk(A + "sub.Tensor", T(8, 16), T(8, 16)), MESH2, ("S(0),P(sum)", "S(0),R"),
     ["S(0),P(sum)", "S(0),P(sum)"], ["S(0),P(sum)"]),
    ("mul/partial-times-replicated", mk(A + "mul.Tensor", T(8, 16), T(16)), MESH1,
     (P1, "R"), [P1, "R"], [P1]),
    ("mul/two-partials-one-reduced", mk(A + "mul.Tensor", T(8, 16), T(8, 16)), MESH1,
     (P1, P1), [P1, "R"], [P1]),
    ("mul/2d", mk(A + "mul.Tensor", T(8, 16), T(8, 16)), MESH2, ("S(0),P(sum)", "S(0),R"),
     ["S(0),P(sum)", "S(0),R"], ["S(0),P(sum)"]),
    ("mul.Scalar/partial", mk(A + "mul.Scalar", T(8, 16), 2.0), MESH1, (P1,), [P1], [P1]),
    ("div/partial-dividend", mk(A + "div.Tensor", T(8, 16), T(8, 16)), MESH1, (P1, "R"),
     [P1, "R"], [P1]),
    ("div/partial-divisor-reduced", mk(A + "div.Tensor", T(8, 16), T(8, 16)), MESH1,
     ("R", P1), ["R", "R"], ["R"]),
    ("neg/partial", mk(A + "neg.default", T(8, 16)), MESH1, (P1,), [P1], [P1]),
    ("where/branches-partial", mk(A + "where.self", T(8, 16, dtype=BOOL), T(8, 16), T(16)),
     MESH1, ("R", P1, "R"), ["R", P1, P1], [P1]),
    # Gathering the 1-byte condition is cheaper than reduce-scattering both branches.
    ("where/branches-reduce-scattered-to-the-condition",
     mk(A + "where.self", T(8, 16, dtype=BOOL), T(8, 16), T(8, 16)), MESH1, ("S(0)", P1, P1),
     ["S(0)", "S(0)", "S(0)"], ["S(0)"]),
    ("where/condition-gathered-branches-stay-partial",
     mk(A + "where.self", T(8, 16, dtype=BOOL), T(8, 16), T(8, 16)), MESH1, ("R", P1, P1),
     ["R", P1, P1], [P1]),
    ("masked_fill/zero-linear", mk(A + "masked_fill.Scalar", T(8, 16), T(16, dtype=BOOL), 0.0),
     MESH1, (P1, "R"), [P1, "R"], [P1]),
    ("masked_fill/-inf-not-linear",
     mk(A + "masked_fill.Scalar", T(8, 16), T(16, dtype=BOOL), float("-inf")), MESH1,
     (P1, "R"), ["R", "R"], ["R"]),
    ("_to_copy/same-dtype-linear", mk(A + "_to_copy.default", T(8, 16)), MESH1, (P1,),
     [P1], [P1]),
    ("_to_copy/cast-not-linear", mk(A + "_to_copy.default", T(8, 16), dtype=torch.bfloat16),
     MESH1, (P1,), ["R"], ["R"]),
    ("gelu_backward/partial-grad", mk(A + "gelu_backward.default", T(8, 16), T(8, 16)), MESH1,
     (P1, "R"), [P1, "R"], [P1]),
    ("threshold_backward/partial-input-reduced",
     mk(A + "threshold_backward.default", T(8, 16), T(8, 16), 0.0), MESH1, ("R", P1),
     ["R", "R"], ["R"]),
    # --- elementwise: nonlinear (the tag fallback)
    ("gelu/partial-reduced", mk(A + "gelu.default", T(8, 16)), MESH1, (P1,), ["R"], ["R"]),
    ("gelu/sharded", mk(A + "gelu.default", T(8, 16)), MESH2, ("S(0),S(1)",), ["S(0),S(1)"],
     ["S(0),S(1)"]),
    ("le/broadcast", mk(A + "le.Tensor", T(8, 16), T(16)), MESH1, ("S(1)", "S(0)"),
     ["S(1)", "S(0)"], ["S(1)"]),
    ("pow/sharded", mk(A + "pow.Tensor_Scalar", T(8, 16), 2), MESH1, ("S(0)",), ["S(0)"],
     ["S(0)"]),
    ("native_dropout/both-outputs", mk(A + "native_dropout.default", T(8, 16), 0.1, True),
     MESH1, ("S(0)",), ["S(0)"], ["S(0)", "S(0)"]),
    # --- reductions
    ("sum/reduced-dim->partial", mk(A + "sum.dim_IntList", T(8, 16), [1]), MESH1, ("S(1)",),
     ["S(1)"], [P1]),
    ("sum/kept-dim", mk(A + "sum.dim_IntList", T(8, 16), [1]), MESH1, ("S(0)",), ["S(0)"],
     ["S(0)"]),
    ("sum/keepdim", mk(A + "sum.dim_IntList", T(4, 8, 16), [0], True), MESH2,
     ("S(0),S(2)",), ["S(0),S(2)"], ["P(sum),S(2)"]),
    ("sum/partial-passes", mk(A + "sum.dim_IntList", T(8, 16), [0]), MESH1, (P1,), [P1], [P1]),
    ("sum.default/all", mk(A + "sum.default", T(8, 16)), MESH1, ("S(0)",), ["S(0)"], [P1]),
    ("mean/reduced-dim->partial", mk(A + "mean.dim", T(8, 16), [-1], True), MESH1, ("S(1)",),
     ["S(1)"], [P1]),
    ("mean.default/all->partial", mk(A + "mean.default", T(8, 16)), MESH1, ("S(0)",),
     ["S(0)"], [P1]),
    ("amax/reduced-dim->max", mk(A + "amax.default", T(8, 16), [1]), MESH1, ("S(1)",),
     ["S(1)"], ["P(max)"]),
    ("amax/partial-sum-reduced", mk(A + "amax.default", T(8, 16), [1]), MESH1, (P1,), ["R"],
     ["R"]),
    ("amax/partial-max-passes", mk(A + "amax.default", T(8, 16), [1]), MESH1, ("P(max)",),
     ["P(max)"], ["P(max)"]),
    ("amin/reduced-dim->min", mk(A + "amin.default", T(8, 16), [0]), MESH1, ("S(0)",),
     ["S(0)"], ["P(min)"]),
    ("max.dim/reduced-dim-whole", mk(A + "max.dim", T(8, 16), 1), MESH1, ("S(1)",), ["R"],
     ["R", "R"]),
    ("max.dim/kept-dim", mk(A + "max.dim", T(8, 16), 1), MESH1, ("S(0)",), ["S(0)"],
     ["S(0)", "S(0)"]),
    ("vector_norm/reduced-dim-norm-partial", mk(A + "linalg_vector_norm.default", T(8, 16), 2,
                                                 [-1]), MESH1, ("S(1)",), ["S(1)"], ["P(norm2)"]),
    ("vector_norm/order-0-whole", mk(A + "linalg_vector_norm.default", T(8, 16), 0, [-1]),
     MESH1, ("S(1)",), ["R"], ["R"]),
    ("vector_norm/inf-both-dims", mk(A + "linalg_vector_norm.default", T(8, 16), float("inf")),
     MESH2, ("S(0),S(1)",), ["S(0),S(1)"], ["P(norminf),P(norminf)"]),
    ("vector_norm/same-order-partial-through", mk(A + "linalg_vector_norm.default", T(6), 2),
     MESH1, ("P(norm2)",), ["P(norm2)"], ["P(norm2)"]),
    ("vector_norm/other-order-reduced-first", mk(A + "linalg_vector_norm.default", T(6), 1),
     MESH1, ("P(norm2)",), ["R"], ["R"]),
    ("vector_norm/sum-partial-reduced-first", mk(A + "linalg_vector_norm.default", T(6), 2),
     MESH1, (P1,), ["R"], ["R"]),
    ("var_mean/kept-dim", mk(A + "var_mean.correction", T(8, 16), [1]), MESH1, ("S(0)",),
     ["S(0)"], ["S(0)", "S(0)"]),
    # --- softmax
    ("softmax/axis-sharded-gathered", mk(A + "_softmax.default", T(8, 16), -1, False), MESH1,
     ("S(1)",), ["R"], ["R"]),
    ("softmax/rows", mk(A + "_softmax.default", T(8, 16), -1, False), MESH1, ("S(0)",),
     ["S(0)"], ["S(0)"]),
    ("log_softmax/2d", mk(A + "_log_softmax.default", T(8, 16), 1, False), MESH2,
     ("S(0),S(1)",), ["S(0),R"], ["S(0),R"]),
    ("safe_softmax/heads", mk(A + "_safe_softmax.default", T(4, 8, 16, 16), -1), MESH1,
     ("S(1)",), ["S(1)"], ["S(1)"]),
    ("softmax_backward/partial-grad",
     mk(A + "_softmax_backward_data.default", T(8, 16), T(8, 16), -1, torch.float32), MESH1,
     (P1, "R"), [P1, "R"], [P1]),
    ("log_softmax_backward/axis-gathered",
     mk(A + "_log_softmax_backward_data.default", T(8, 16), T(8, 16), 1, torch.float32),
     MESH1, ("S(1)", "S(1)"), ["R", "R"], ["R"]),
    # --- layer norm
    ("layer_norm/normalized-dim-gathered",
     mk(A + "native_layer_norm.default", T(4, 8, 16), [16], T(16), T(16), 1e-5), MESH1,
     ("S(2)", "R", "R"), ["R", "R", "R"], ["R", "R", "R"]),
    ("layer_norm/tokens", mk(A + "native_layer_norm.default", T(4, 8, 16), [16], T(16), T(16),
                             1e-5), MESH2, ("S(0),S(1)", RR, RR),
     ["S(0),S(1)", RR, RR], ["S(0),S(1)"] * 3),
    ("layer_norm/no-affine", mk(A + "native_layer_norm.default", T(4, 8, 16), [8, 16], None,
                                None, 1e-5), MESH1, ("S(1)",), ["R"], ["R", "R", "R"]),
    ("layer_norm/partial-reduced",
     mk(A + "native_layer_norm.default", T(4, 8, 16), [16], None, None, 1e-5), MESH1, (P1,),
     ["R"], ["R", "R", "R"]),
    ("layer_norm_backward/tokens->param-grads-partial",
     mk(A + "native_layer_norm_backward.default", T(4, 8, 16), T(4, 8, 16), [16], T(4, 8, 1),
        T(4, 8, 1), T(16), T(16), [True, True, True]), MESH1,
     ("S(0)", "S(0)", "S(0)", "S(0)", "R", "R"), ["S(0)", "S(0)", "S(0)", "S(0)", "R", "R"],
     ["S(0)", P1, P1]),
    # carrying the partial on would leave three partial results (input, weight and bias
    # gradients) to reduce: the incoming gradient is reduced first, as Megatron does
    ("layer_norm_backward/partial-grad-reduced-first",
     mk(A + "native_layer_norm_backward.default", T(4, 8, 16), T(4, 8, 16), [16], T(4, 8, 1),
        T(4, 8, 1), T(16), T(16), [True, True, True]), MESH1,
     (P1, "R", "R", "R", "R", "R"), ["R", "R", "R", "R", "R", "R"], ["R", "R", "R"]),
    ("layer_norm_backward/masked-outputs", ln_backward_grad_input_only(), MESH1,
     ("S(1)", "S(1)", "S(1)", "S(1)", "R", "R"), ["S(1)", "S(1)", "S(1)", "S(1)", "R", "R"],
     ["S(1)", None, None]),
    # --- nll loss (reduction 0 none, 1 mean, 2 sum)
    ("nll/sum-batch->partial", mk(A + "nll_loss_forward.default", T(8, 10), T(8, dtype=I64),
                                  None, 2, -100), MESH1, ("S(0)", "S(0)"), ["S(0)", "S(0)"],
     [P1, P1]),
    ("nll/mean-batch-whole", mk(A + "nll_loss_forward.default", T(8, 10), T(8, dtype=I64),
                                None, 1, -100), MESH1, ("S(0)", "S(0)"), ["R", "R"],
     ["R", "R"]),
    ("nll/none-batch-kept", mk(A + "nll_loss_forward.default", T(8, 10), T(8, dtype=I64),
                               T(10), 0, -100), MESH1, ("S(0)", "S(0)", "R"),
     ["S(0)", "S(0)", "R"], ["S(0)", P1]),
    ("nll/class-sharded->partial", mk(A + "nll_loss_forward.default", T(8, 10),
                                      T(8, dtype=I64), None, 2, -100), MESH1, ("S(1)", "R"),
     ["S(1)", "R"], [P1, P1]),
    # cross entropy over positions: self [N, C, H, W], target [N, H, W]; positions shard
    # like rows
    ("nll2d/sum-batch->partial", mk(A + "nll_loss2d_forward.default", T(8, 10, 4, 1),
                                    T(8, 4, 1, dtype=I64), None, 2, -100), MESH1,
     ("S(0)", "S(0)"), ["S(0)", "S(0)"], [P1, P1]),
    ("nll2d/sum-positions->partial", mk(A + "nll_loss2d_forward.default", T(8, 10, 4, 1),
                                        T(8, 4, 1, dtype=I64), None, 2, -100), MESH1,
     ("S(2)", "S(1)"), ["S(2)", "S(1)"], [P1, P1]),
    ("nll2d/class-gathered", mk(A + "nll_loss2d_forward.default", T(8, 10, 4, 1),
                                T(8, 4, 1, dtype=I64), None, 2, -100), MESH1, ("S(1)", "R"),
     ["R", "R"], ["R", "R"]),
    ("nll2d_backward/sum-batch", mk(A + "nll_loss2d_backward.default", T(), T(8, 10, 4, 1),
                                    T(8, 4, 1, dtype=I64), None, 2, -100, T()), MESH1,
     ("R", "S(0)", "S(0)", "R"), ["R", "S(0)", "S(0)", "R"], ["S(0)"]),
    ("nll/1d", mk(A + "nll_loss_forward.default", T(10), T(dtype=I64), None, 1, -100), MESH1,
     ("S(0)", "R"), ["R", "R"], ["R", "R"]),
    ("nll/2d-mesh-sum", mk(A + "nll_loss_forward.default", T(8, 10), T(8, dtype=I64), None, 2,
                           -100), MESH2, ("S(0),R", "S(0),R"), ["S(0),R", "S(0),R"],
     ["P(sum),R", "P(sum),R"]),
    ("nll_backward/mean-batch", mk(A + "nll_loss_backward.default", T(), T(8, 10),
                                   T(8, dtype=I64), None, 1, -100, T()), MESH1,
     ("R", "S(0)", "S(0)", "R"), ["R", "S(0)", "S(0)", "R"], ["S(0)"]),
    ("nll_backward/none-grad-rows", mk(A + "nll_loss_backward.default", T(8), T(8, 10),
                                       T(8, dtype=I64), T(10), 0, -100, T()), MESH1,
     ("S(0)", "S(0)", "S(0)", "R", "R"), ["S(0)", "S(0)", "S(0)", "R", "R"], ["S(0)"]),
    ("mse/mean-batch->partial", mk(A + "mse_loss.default", T(8, 4), T(8, 4)), MESH1,
     ("S(0)", "S(0)"), ["S(0)", "S(0)"], [P1]),
    ("mse/none-pointwise", mk(A + "mse_loss.default", T(8, 4), T(8, 4), 0), MESH2,
     ("S(0),S(1)", "S(0),R"), ["S(0),S(1)", "S(0),S(1)"], ["S(0),S(1)"]),
    ("mse_backward/mean-rows", mk(A + "mse_loss_backward.default", T(), T(8, 4), T(8, 4), 1),
     MESH1, ("R", "S(0)", "S(0)"), ["R", "S(0)", "S(0)"], ["S(0)"]),
    # --- batch norm: channels shard; batch/spatial only in eval (running statistics)
    ("batch_norm/train-channels", mk(A + "native_batch_norm.default", T(4, 8, 5, 5), T(8),
                                     T(8), T(8), T(8), True, 0.1, 1e-5), MESH1,
     ("S(1)", "S(0)", "S(0)", "S(0)", "S(0)"), ["S(1)"] + ["S(0)"] * 4,
     ["S(1)", "S(0)", "S(0)"]),
    ("batch_norm/train-batch-gathered", mk(A + "native_batch_norm.default", T(4, 8, 5, 5),
                                           None, None, None, None, True, 0.1, 1e-5), MESH1,
     ("S(0)",), ["R"], ["R", "R", "R"]),
    ("batch_norm/eval-batch", mk(A + "native_batch_norm.default", T(4, 8, 5, 5), T(8), T(8),
                                 T(8), T(8), False, 0.1, 1e-5), MESH1,
     ("S(0)", "R", "R", "R", "R"), ["S(0)", "R", "R", "R", "R"], ["S(0)", P1, P1]),
    ("batch_norm_backward/train-channels",
     mk(A + "native_batch_norm_backward.default", T(4, 8, 5, 5), T(4, 8, 5, 5), T(8), T(8),
        T(8), T(8), T(8), True, 1e-5, [True] * 3), MESH1, ("S(1)", "S(1)") + ("S(0)",) * 5,
     ["S(1)", "S(1)"] + ["S(0)"] * 5, ["S(1)", "S(0)", "S(0)"]),
    ("batch_norm_backward/eval-batch->param-grads-partial",
     mk(A + "native_batch_norm_backward.default", T(16, 8, 5, 5), T(16, 8, 5, 5), T(8), T(8),
        T(8), T(8), T(8), False, 1e-5, [True] * 3), MESH1, ("S(0)", "S(0)") + ("R",) * 5,
     ["S(0)", "S(0)"] + ["R"] * 5, ["S(0)", P1, P1]),
    # --- embedding
    ("embedding/vocab-parallel->partial",
     mk(A + "embedding.default", T(64, 16), T(4, 8, dtype=I64)), MESH1, ("S(0)", "R"),
     ["S(0)", "R"], [P1]),
    ("embedding/batch", mk(A + "embedding.default", T(64, 16), T(4, 8, dtype=I64)), MESH1,
     ("R", "S(0)"), ["R", "S(0)"], ["S(0)"]),
    ("embedding/hidden", mk(A + "embedding.default", T(64, 16), T(4, 8, dtype=I64)), MESH1,
     ("S(1)", "R"), ["S(1)", "R"], ["S(2)"]),
    ("embedding/dp+vocab", mk(A + "embedding.default", T(64, 16), T(4, 8, dtype=I64)), MESH2,
     ("R,S(0)", "S(0),R"), ["R,S(0)", "S(0),R"], ["S(0),P(sum)"]),
    # (a small vocabulary, so reducing the grad later is cheaper than gathering the batch)
    ("embedding_backward/batch->partial",
     mk(A + "embedding_dense_backward.default", T(16, 8, 16), T(16, 8, dtype=I64), 8, -1,
        False), MESH1, ("S(0)", "S(0)"), ["S(0)", "S(0)"], [P1]),
    ("embedding_backward/freq-scaled-batch-whole",
     mk(A + "embedding_dense_backward.default", T(4, 8, 16), T(4, 8, dtype=I64), 64, -1,
        True), MESH1, ("S(0)", "S(0)"), ["R", "R"], ["R"]),
    ("embedding_backward/hidden",
     mk(A + "embedding_dense_backward.default", T(4, 8, 16), T(4, 8, dtype=I64), 64, -1,
        False), MESH1, ("S(2)", "R"), ["S(2)", "R"], ["S(1)"]),
    # --- attention
    ("sdpa_cpu/batch", mk(CPU_SDPA, Q, K, V, 0.0, True), MESH1, ("S(0)",) * 3, ["S(0)"] * 3,
     ["S(0)", "S(0)"]),
    ("sdpa_cpu/heads", mk(CPU_SDPA, Q, K, V), MESH1, ("S(1)",) * 3, ["S(1)"] * 3,
     ["S(1)", "S(1)"]),
    # the query's rows may stay split (context parallelism): keys and values gathered
    ("sdpa_cpu/query-rows-split", mk(CPU_SDPA, Q, K, V), MESH1, ("S(2)",) * 3,
     ["S(2)", "R", "R"], ["S(2)", "S(2)"]),
    ("sdpa_cpu/dp+heads", mk(CPU_SDPA, Q, K, V), MESH2, ("S(0),S(1)",) * 3,
     ["S(0),S(1)"] * 3, ["S(0),S(1)"] * 2),
    ("sdpa_cpu/broadcast-mask", mk(CPU_SDPA, Q, K, V, attn_mask=T(1, 1, 16, 12)), MESH1,
     ("S(0)", "S(0)", "S(0)", "R"), ["S(0)", "S(0)", "S(0)", "R"], ["S(0)", "S(0)"]),
    ("sdpa_cpu/batch-mask", mk(CPU_SDPA, Q, K, V, attn_mask=T(4, 1, 16, 12)), MESH1,
     ("S(0)", "S(0)", "S(0)", "S(0)"), ["S(0)"] * 4, ["S(0)", "S(0)"]),
    # grouped-query attention: heads shard when the cut divides the key heads too
    ("sdpa_cpu/gqa-heads-whole", mk(CPU_SDPA, Q, T(4, 2, 12, 32), T(4, 2, 12, 32)), MESH1,
     ("S(1)", "S(1)", "S(1)"), ["R"] * 3, ["R", "R"]),
    ("sdpa_cpu/gqa-heads", mk(CPU_SDPA, Q, T(4, 4, 12, 32), T(4, 4, 12, 32)), MESH1,
     ("S(1)", "S(1)", "S(1)"), ["S(1)"] * 3, ["S(1)", "S(1)"]),
    ("sdpa_cpu/gqa-dp+heads", mk(CPU_SDPA, Q, T(4, 2, 12, 32), T(4, 2, 12, 32)), MESH2,
     ("S(0),S(1)",) * 3, ["S(0),S(1)"] * 3, ["S(0),S(1)"] * 2),
    ("sdpa_cpu_backward/gqa-heads", mk(CPU_SDPA_BW, Q, Q, T(4, 4, 12, 32), T(4, 4, 12, 32), Q,
                                       T(4, 8, 16), 0.0, True), MESH1,
     ("S(1)",) * 6, ["S(1)"] * 6, ["S(1)"] * 3),
    ("sdpa_cpu_backward/batch", mk(CPU_SDPA_BW, Q, Q, K, V, Q, T(4, 8, 16), 0.0, True), MESH1,
     ("S(0)",) * 6, ["S(0)"] * 6, ["S(0)"] * 3),
    ("sdpa_flash/heads-rng-replicated", FLASH, MESH1, ("S(1)",) * 3, ["S(1)"] * 3,
     ["S(1)", "S(1)", None, None, None, None, "R", "R", "R"]),
    ("sdpa_efficient/batch-bias-broadcast", EFF, MESH1, ("S(0)",) * 3 + ("R",),
     ["S(0)"] * 3 + ["R"], ["S(0)", "S(0)", "R", "R"]),
    ("sdpa_cudnn/dp+heads", CUDNN, MESH2, ("S(0),S(1)",) * 3, ["S(0),S(1)"] * 3,
     ["S(0),S(1)", "S(0),S(1)", None, None, None, None, RR, RR, None]),
    ("sdpa_efficient_backward/bias-grad-partial", EFF_BW, MESH1,
     ("S(0)",) * 4 + ("R",) + ("S(0)",) * 2 + ("R", "R"),
     ["S(0)"] * 4 + ["R"] + ["S(0)"] * 2 + ["R", "R"], ["S(0)", "S(0)", "S(0)", P1]),
    ("sdpa_flash_backward/heads", FLASH_BW, MESH1, ("S(1)",) * 6 + ("R", "R"),
     ["S(1)"] * 6 + ["R", "R"], ["S(1)"] * 3),
    ("sdpa_cudnn_backward/batch", CUDNN_BW, MESH1, ("S(0)",) * 6 + ("R", "R", "S(0)"),
     ["S(0)"] * 6 + ["R", "R", "S(0)"], ["S(0)"] * 3),
    # --- factories and *_like
    ("arange/replicated", mk(A + "arange.start_step", 0, 16, 2), MESH2, (), [], [RR]),
    ("ones/replicated", mk(A + "ones.default", [4, 8]), MESH1, (), [], ["R"]),
    ("full/replicated", mk(A + "full.default", [4, 8], 1.5), MESH2, (), [], [RR]),
    ("scalar_tensor/replicated", mk(A + "scalar_tensor.default", 2.0), MESH1, (), [], ["R"]),
    # *_like reads only the shape: a Partial input stays as it is, the output is whole.
    ("ones_like/loss-seed-needs-no-reduce", mk(A + "ones_like.default", T()), MESH1, (P1,),
     [P1], ["R"]),
    ("zeros_like/partial-in-replicated-out", mk(A + "zeros_like.default", T(8, 16)), MESH2,
     ("S(0),P(sum)",), ["S(0),P(sum)"], ["S(0),R"]),
    ("empty_like/follows-shards", mk(A + "empty_like.default", T(8, 16)), MESH2,
     ("S(0),S(1)",), ["S(0),S(1)"], ["S(0),S(1)"]),
    ("lift_fresh_copy/follows", mk(A + "lift_fresh_copy.default", T(8, 16)), MESH1, ("S(1)",),
     ["S(1)"], ["S(1)"]),
    # --- masks, padding, indexing
    ("tril/batch", mk(A + "tril.default", T(4, 16, 16)), MESH1, ("S(0)",), ["S(0)"],
     ["S(0)"]),
    ("tril/matrix-dim-gathered", mk(A + "tril.default", T(4, 16, 16)), MESH1, ("S(1)",),
     ["R"], ["R"]),
    ("triu/partial-passes", mk(A + "triu.default", T(16, 16), 1), MESH1, (P1,), [P1], [P1]),
    ("pad/unpadded-dim", mk(A + "constant_pad_nd.default", T(4, 8, 16), [0, 0, 1, 1]), MESH1,
     ("S(2)",), ["S(2)"], ["S(2)"]),
    ("pad/padded-dim-gathered", mk(A + "constant_pad_nd.default", T(4, 8, 16), [0, 0, 1, 1]),
     MESH1, ("S(1)",), ["R"], ["R"]),
    ("pad/nonzero-value-not-linear",
     mk(A + "constant_pad_nd.default", T(4, 8, 16), [1, 1], 1.0), MESH1, (P1,), ["R"], ["R"]),
    ("index_select/indexed-dim-gathered",
     mk(A + "index_select.default", T(8, 16), 0, T(4, dtype=I64)), MESH1, ("S(0)", "R"),
     ["R", "R"], ["R"]),
    ("index_select/index-sharded",
     mk(A + "index_select.default", T(8, 16), 0, T(4, dtype=I64)), MESH1, ("R", "S(0)"),
     ["R", "S(0)"], ["S(0)"]),
    ("index_select/other-dim", mk(A + "index_select.default", T(8, 16), 0, T(4, dtype=I64)),
     MESH1, ("S(1)", "R"), ["S(1)", "R"], ["S(1)"]),
    ("gather/rows", mk(A + "gather.default", T(8, 16), 1, T(8, 4, dtype=I64)), MESH1,
     ("S(0)", "S(0)"), ["S(0)", "S(0)"], ["S(0)"]),
    ("gather/gathered-dim-whole", mk(A + "gather.default", T(8, 16), 1, T(8, 4, dtype=I64)),
     MESH1, ("S(1)", "R"), ["R", "R"], ["R"]),
    ("gather/smaller-index-dim-whole",
     mk(A + "gather.default", T(8, 16), 1, T(4, 4, dtype=I64)), MESH1, ("S(0)", "S(0)"),
     ["R", "R"], ["R"]),
]

# (id, op, mesh, wanted output placements, expected input needs)
REVERSE = [
    ("mm/rows", mk(A + "mm.default", T(8, 16), T(16, 32)), MESH1, ("S(0)",), ["S(0)", "R"]),
    ("mm/partial", mk(A + "mm.default", T(8, 16), T(16, 32)), MESH1, (P1,), [P1, "R"]),
    ("addmm/columns", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)), MESH1, ("S(1)",),
     ["S(0)", "R", "S(1)"]),
    ("addmm/partial-bias-too", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)), MESH1,
     (P1,), [P1, P1, "R"]),
    ("addmm/2d", mk(A + "addmm.default", T(32), T(8, 16), T(16, 32)), MESH2, ("S(0),P(sum)",),
     ["R,P(sum)", "S(0),P(sum)", "R,R"]),
    ("add/rows", mk(A + "add.Tensor", T(8, 16), T(16)), MESH1, ("S(0)",), ["S(0)", "R"]),
    ("add/partial", mk(A + "add.Tensor", T(8, 16), T(16)), MESH1, (P1,), [P1, P1]),
    ("gelu/partial-unreachable", mk(A + "gelu.default", T(8, 16)), MESH1, (P1,), ["R"]),
    ("where/partial", mk(A + "where.self", T(8, 16, dtype=BOOL), T(8, 16), T(8, 16)), MESH1,
     (P1,), ["R", P1, P1]),
    ("sum/partial", mk(A + "sum.dim_IntList", T(8, 16), [1]), MESH1, (P1,), [P1]),
    ("sum/kept", mk(A + "sum.dim_IntList", T(8, 16), [1]), MESH1, ("S(0)",), ["S(0)"]),
    ("softmax/rows", mk(A + "_softmax.default", T(8, 16), -1, False), MESH2, ("S(0),S(0)",),
     ["S(0),S(0)"]),
    ("layer_norm/tokens", mk(A + "native_layer_norm.default", T(4, 8, 16), [16], T(16), T(16),
                             1e-5), MESH1, ("S(1)", None, None), ["S(1)", "R", "R"]),
    ("layer_norm_backward/weight-grad-partial",
     mk(A + "native_layer_norm_backward.default", T(4, 8, 16), T(4, 8, 16), [16], T(4, 8, 1),
        T(4, 8, 1), T(16), T(16), [True, True, True]), MESH1, (None, P1, None),
     [P1, "R", "R", "R", "R", "R"]),
    ("nll/none-rows", mk(A + "nll_loss_forward.default", T(8, 10), T(8, dtype=I64), None, 0,
                         -100), MESH1, ("S(0)", None), ["S(0)", "S(0)"]),
    ("nll_backward/partial-grad", mk(A + "nll_loss_backward.default", T(), T(8, 10),
                                     T(8, dtype=I64), None, 2, -100, T()), MESH1, (P1,),
     [P1, "R", "R", "R"]),
    ("sdpa_cpu_backward/partial-grad", mk(CPU_SDPA_BW, Q, Q, K, V, Q, T(4, 8, 16), 0.0, True),
     MESH1, (P1, None, None), [P1] + ["R"] * 5),
    ("nll_backward/rows", mk(A + "nll_loss_backward.default", T(), T(8, 10), T(8, dtype=I64),
                             None, 1, -100, T()), MESH1, ("S(0)",), ["R", "S(0)", "S(0)", "R"]),
    ("embedding/batch", mk(A + "embedding.default", T(64, 16), T(4, 8, dtype=I64)), MESH1,
     ("S(0)",), ["R", "S(0)"]),
    ("embedding/partial", mk(A + "embedding.default", T(64, 16), T(4, 8, dtype=I64)), MESH1,
     (P1,), [P1, "R"]),
    ("sdpa_cpu/heads", mk(CPU_SDPA, Q, K, V), MESH1, ("S(1)", None), ["S(1)"] * 3),
    ("sdpa_flash/rng-hint-ignored", FLASH, MESH1,
     (None, None, None, None, None, None, "S(0)", None, None), ["R"] * 3),
    ("index_select/index", mk(A + "index_select.default", T(8, 16), 0, T(4, dtype=I64)),
     MESH1, ("S(0)",), ["R", "S(0)"]),
    ("tril/partial", mk(A + "tril.default", T(16, 16)), MESH1, (P1,), [P1]),
    ("ones_like/shard", mk(A + "ones_like.default", T(8, 16)), MESH2, ("P(sum),S(1)",),
     ["R,S(1)"]),
]


@pytest.mark.parametrize("op, mesh, ins, needs, outs", [c[1:] for c in FORWARD],
                         ids=[c[0] for c in FORWARD])
def test_forward(op, mesh, ins, needs, outs):
    assert forward(op, mesh, *ins) == (needs, outs)


@pytest.mark.parametrize("op, mesh, outs, needs", [c[1:] for c in REVERSE],
                         ids=[c[0] for c in REVERSE])
def test_reverse(op, mesh, outs, needs):
    assert reverse(op, mesh, *outs) == needs


COVERED = """
_log_softmax _log_softmax_backward_data _safe_softmax _softmax _softmax_backward_data
_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward
_scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
_scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward
_to_copy add.Tensor addmm arange arange.start arange.start_step bernoulli_.float bitwise_not
bmm constant_pad_nd cos div.Scalar div.Tensor div_.Scalar embedding embedding_dense_backward
empty_like gelu gelu_backward le.Tensor lift_fresh_copy masked_fill.Scalar mean.dim mm
mul.Scalar mul.Tensor native_layer_norm native_layer_norm_backward neg nll_loss_backward
nll_loss_forward ones ones_like pow.Tensor_Scalar rsqrt scalar_tensor silu silu_backward sin
sum.dim_IntList tanh tanh_backward tril where.self zeros relu threshold_backward
sum.default amax amin max.dim var_mean.correction var.correction linalg_vector_norm clamp
clamp_min reciprocal sqrt exp log sub.Tensor rsub.Tensor rsub.Scalar zeros_like full full_like
empty.memory_format native_dropout native_dropout_backward triu index_select gather baddbmm
mean.default mse_loss mse_loss_backward native_batch_norm native_batch_norm_backward
""".split()


@pytest.mark.parametrize("name", COVERED)
def test_every_listed_op_has_a_rule(name):
    target = A + (name if "." in name else name + ".default")
    assert lookup(Op(OpKind.CALL, target)) is not None, target


def test_gqa_heads_shard_only_evenly():
    """With fewer key heads the head letter has two sizes: it shards only where both divide
    (piece r of the query heads then reads piece r of the key heads)."""
    op = mk(CPU_SDPA, Q, T(4, 2, 12, 32), T(4, 2, 12, 32))
    spec = lookup(op).spec(op)
    assert spec.inputs[1][1] == "h" and "h" in spec.even and "h" not in spec.replicated
    odd = mk(CPU_SDPA, T(4, 6, 16, 32), T(4, 4, 12, 32), T(4, 4, 12, 32))   # 6 % 4: no GQA
    assert "h" in lookup(odd).spec(odd).replicated
