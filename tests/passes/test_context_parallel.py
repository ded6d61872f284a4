"""Context parallelism, ``context_parallel: {axis: cp, method: allgather | ring}``: every fed
tensor is cut along its sequence dim over ``cp``; attention gathers the keys and values and
each rank attends its query rows to all of them, a causal mask offset to its rows
(``autopar.causal_rows_attention``); the keys' and values' gradients are partial sums,
reduce-scattered back. On the simulator our GPT (causal SDPA) and Hugging Face Llama
(SDPA, rotary, grouped-query attention) train like eager (fp32, rtol 1e-5) on cp2, cp4,
dp x cp, ZeRO-3 x cp, cp x tp and pp x cp; the local kernel equals the slices of one
whole-sequence call, forward and backward; what is not built is refused by name.

Ring attention (``method: ring``) passes the keys and values around the cp ring
(``comm.shift``) and merges the blocks by their log-sum-exp: the same layouts train like
eager; no rank holds more than its chunk of the keys; the ring's math equals one
whole-sequence attention, forward and backward, causal or not, grouped heads or not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar as ap
from autopar.capture import CaptureNote, RingAttentionError
from autopar.capture.ring_attention import ring_attention_mode
from autopar.ir.kernels import ring as ring_kernels
from autopar.ir.kernels.sharded import causal_rows_attention
from autopar.models.gpt import lm_loss
from autopar.reshard.comm import RESHARD_STEP

from .. import models_zoo as zoo
from ..parity import (  # noqa: F401  (one_thread: a fixture)
    assert_same_losses,
    assert_same_params,
    eager_train,
    gpt_optimizer,
    lm_data,
    one_thread,
    parity_gpt,
    twin,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ, BATCH, STEPS = 32, 4, 3
CP = "context_parallel: {axis: cp}\ndebug: {simulate: true}\n"
TP_PLAN = ('{"blocks.*.attn.qkv": colwise, "blocks.*.attn.proj": rowwise, '
           '"blocks.*.fc1": colwise, "blocks.*.fc2": rowwise}')


def _fit_both(text: str, optim: str = "adamw", cp: str = CP) -> ap.Engine:
    # ring attention replaces SDPA calls: the SGD model too calls SDPA there
    model = parity_gpt(optim, seq=SEQ, sdpa=True if cp == RING else None)
    ref = twin(model)
    opt, sched = gpt_optimizer(optim, model, warmup=2)
    ref_opt, ref_sched = gpt_optimizer(optim, ref, warmup=2)
    data = lm_data(STEPS * BATCH, SEQ, 64)
    want = eager_train(ref, lm_loss, ref_opt, data, BATCH, STEPS, None, ref_sched)
    engine = ap.Engine(model, lm_loss, opt, strategy=ap.Strategy.from_yaml_str(text + cp),
                       lr_scheduler=sched)
    assert_same_losses(engine.fit(data, batch_size=BATCH, verbose=0)["loss"], want)
    assert_same_params(model, ref)
    return engine


LAYOUTS = [
    ("mesh: {shape: [2], dim_names: [cp]}\n", "adamw"),
    ("mesh: {shape: [4], dim_names: [cp]}\n", "adamw"),
    ("mesh: {shape: [2, 2], dim_names: [dp, cp]}\ndata_parallel: {axis: dp}\n", "adamw"),
    ("mesh: {shape: [2, 2], dim_names: [dp, cp]}\ndata_parallel: {axis: dp}\n"
     "sharding: {stage: 3, axis: dp}\n", "adamw"),
    # SGD: AdamW follows the rounding noise of a near-zero gradient (end_to_end/test_parity_dist)
    (f"mesh: {{shape: [2, 2], dim_names: [cp, tp]}}\n"
     f"tensor_parallel: {{axis: tp, plan: {TP_PLAN}}}\n", "sgd"),
    ("mesh: {shape: [2, 2], dim_names: [pp, cp]}\n"
     "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2}\n", "adamw"),
]
LAYOUT_IDS = ["cp2", "cp4", "dp2xcp2", "zero3-dp2xcp2", "cp2xtp2", "pp2xcp2"]
RING = "context_parallel: {axis: cp, method: ring}\ndebug: {simulate: true}\n"


@pytest.mark.parametrize("text, optim", LAYOUTS, ids=LAYOUT_IDS)
def test_context_parallel_trains_like_eager(text, optim):
    _fit_both(text, optim)


@pytest.mark.parametrize("text, optim", LAYOUTS, ids=LAYOUT_IDS)
def test_ring_attention_trains_like_eager(text, optim):
    _fit_both(text, optim, RING)


def test_the_plan_gathers_keys_and_values_and_offsets_the_causal_rows():
    engine = _fit_both("mesh: {shape: [2], dim_names: [cp]}\n")
    lowered = engine.planner.last("train").lowered
    for rank, made in lowered.processes.items():
        ops = made.program.ops
        rows = [op.args[1] for op in ops if op.target == "autopar.causal_rows_attention"]
        assert len(rows) == 4                   # 2 layers, forward and backward
        assert all(tuple(r) == (rank * SEQ // 2, (rank + 1) * SEQ // 2) for r in rows)
        gathers = [op for op in ops if op.target == "comm.all_gather"]
        assert len(gathers) == 4 and all(len(op.args[0].type.shape) == 4 for op in gathers)
        # each layer's key and value gradients (partial sums over the rows), and nothing else
        scatters = [op for op in ops if op.target == "comm.reduce_scatter"]
        assert len(scatters) == 4
        assert all(op.attrs[RESHARD_STEP].mesh_dim == 0 for op in scatters)


def test_the_local_kernel_is_the_slice_of_one_whole_sequence_call():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 4, requires_grad=True) for _ in range(3))
    forward = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    backward = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True)
    dk_sum, dv_sum = torch.zeros_like(dk), torch.zeros_like(dv)
    for start, stop in ((0, 5), (5, 12)):
        rows = slice(start, stop)
        o, lse_rows = causal_rows_attention(forward, (start, stop), 12, q[:, :, rows], k, v,
                                            0.0, True)
        torch.testing.assert_close(o, out[:, :, rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse_rows, lse[:, :, rows], rtol=1e-6, atol=1e-6)
        gq, gk, gv = causal_rows_attention(backward, (start, stop), 12, grad[:, :, rows],
                                           q[:, :, rows], k, v, out[:, :, rows],
                                           lse[:, :, rows], 0.0, True)
        torch.testing.assert_close(gq, dq[:, :, rows], rtol=1e-5, atol=1e-6)
        dk_sum += gk
        dv_sum += gv
    torch.testing.assert_close(dk_sum, dk, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dv_sum, dv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_hugging_face_llama_with_rotary_and_grouped_query_attention(method):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = zoo.hf_llama("sdpa", 97).train()
    ref = twin(model)
    g = torch.Generator().manual_seed(0)
    data = [({"input_ids": x}, x.clone()) for x in torch.randint(0, 97, (6, 16), generator=g)]
    # SGD for the ring: its blocks add in another order, and AdamW follows the rounding of
    # a near-zero gradient (one element of 2048 at 6e-5 relative after three steps)
    make = (torch.optim.SGD, dict(lr=0.1)) if method == "ring" else (torch.optim.AdamW,
                                                                      dict(lr=1e-3))
    engine = ap.Engine(model, None, make[0](model.parameters(), **make[1]),
                       strategy=ap.Strategy.from_yaml_str(
                           "mesh: {shape: [2], dim_names: [cp]}\n"
                           f"context_parallel: {{axis: cp, method: {method}}}\n"
                           "debug: {simulate: true}\n"))
    got = engine.fit(data, batch_size=2, verbose=0)["loss"]
    opt, want = make[0](ref.parameters(), **make[1]), []
    for step in range(3):
        x = torch.stack([i["input_ids"] for i, _ in data[2 * step:2 * step + 2]])
        loss = ref(input_ids=x, labels=x.clone()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert_same_losses(got, want)
    assert_same_params(model, ref)


def test_the_ring_passes_chunks_and_never_gathers_the_keys():
    engine = _fit_both("mesh: {shape: [4], dim_names: [cp]}\n", cp=RING)
    lowered = engine.planner.last("train").lowered
    chunk = SEQ // 4
    for rank, made in lowered.processes.items():
        ops = made.program.ops
        assert not [op for op in ops if op.target == "comm.all_gather"
                    and len(op.args[0].type.shape) == 4]
        blocks = [op for op in ops if op.target.startswith("autopar.ring_block")]
        assert len(blocks) == 2 * 2 * 4          # 2 layers, forward and backward, 4 steps
        assert all(op.kwargs["first"] == rank for op in blocks)
        # every attention tensor a rank holds is its own chunk of the sequence
        assert all(v.type.shape[2] == chunk for op in blocks for v in op.args[:3])
        shifts = [op for op in ops if op.target == "comm.shift"]
        # per layer: k, v three times forward; k, v, dk, dv three times backward, dk, dv home
        assert len(shifts) == 2 * (2 * 3 + 4 * 3 + 2)
        assert {(op.attrs[RESHARD_STEP].shift, op.attrs[RESHARD_STEP].tensor_dim)
                for op in shifts} == {(1, 2)}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_ring_is_one_whole_attention_forward_and_backward(causal, heads, groups, n):
    """Chunks of 3 rows, blocks merged by log-sum-exp; gradients as the blocks' shares."""
    torch.manual_seed(0)
    q = torch.randn(2, heads, 3 * n, 8, requires_grad=True)
    k, v = (torch.randn(2, groups, 3 * n, 8, requires_grad=True) for _ in range(2))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grad = torch.randn_like(want)
    with ring_attention_mode(n):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad),
                            torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_blocks_plain_math_equals_the_flash_kernel():
    """Devices without the CPU flash kernel run the blocks in plain ops."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    for diagonal in (True, False):
        out, lse = ring_kernels._FLASH(q, k, v, 0.0, diagonal, scale=0.4)
        m_out, m_lse = ring_kernels._math_block(q, k, v, diagonal, 0.4)
        torch.testing.assert_close(m_out, out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m_lse, lse, rtol=1e-5, atol=1e-6)
        grad = torch.randn_like(out)
        for ours, theirs in zip(
                ring_kernels._math_block_backward(grad, q, k, v, out, lse, diagonal, 0.4),
                ring_kernels._FLASH_BACKWARD(grad, q, k, v, out, lse, 0.0, diagonal,
                                             scale=0.4)):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_ring_attention_refuses_what_it_cannot_split():
    model = parity_gpt("adamw", seq=SEQ)
    data = lm_data(4, SEQ - 2, 64)       # 30 tokens over 4 ranks
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           "mesh: {shape: [4], dim_names: [cp]}\n" + RING))
    with pytest.raises(RingAttentionError, match=r"attn.*divisible by 4; got 30"):
        engine.fit(data, batch_size=4, verbose=0)
    q = torch.randn(1, 2, 8, 4)
    with ring_attention_mode(2), pytest.raises(RingAttentionError, match="takes no attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with ring_attention_mode(2), pytest.raises(RingAttentionError, match="dropout"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    # an attention in plain ops is not ring attention: said, not silently planned otherwise
    model = parity_gpt("sgd", seq=SEQ, sdpa=False)
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           "mesh: {shape: [2], dim_names: [cp]}\n" + RING))
    with pytest.warns(CaptureNote, match="calls no scaled_dot_product_attention"):
        engine.fit(lm_data(4, SEQ, 64), batch_size=4, verbose=0)


def test_what_is_not_built_is_refused_by_name():
    with pytest.raises(ValueError, match="context_parallel.axis 'cp'.*not one of the mesh"):
        ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                  "context_parallel: {axis: cp}")
    with pytest.raises(ValueError, match="both 'dp'"):
        ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                  "data_parallel: {axis: dp}\ncontext_parallel: {axis: dp}")
