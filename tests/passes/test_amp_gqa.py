"""bf16 O1 with grouped-query attention (issue 42): Hugging Face Llama, 4 query heads on 2
key/value heads, trained through the Engine next to eager ``torch.autocast``.

The plan computes the step as the model's code does when it is traced. Hugging Face's SDPA
attention takes one of two branches, on the attention mask's *values*:

* no mask, or a mask with padding in it: the same branch traced and eager, so the plan
  equals eager autocast bit for bit (``attn_implementation="eager"`` too: its key/value
  heads are repeated either way, and the sum over the query groups in the backward is
  eager autograd's own ``sum``, in bf16);
* a mask of all ones: eager drops it (``masking_utils._ignore_causal_mask_sdpa`` reads
  ``padding_mask.all()``) and runs SDPA's grouped-query kernel with ``is_causal``; while
  tracing Hugging Face never drops it (the values are unknown, and the plan serves every
  batch of the shape, padded or not), so with a mask SDPA cannot take the key/value heads
  as they are: ``repeat_kv`` repeats them (expand + reshape) and the backward sums each
  query head's gradient. The forward is the same (step 1's loss is equal), the gradients
  of the key/value heads are not: the grouped-query kernel accumulates the group's query
  heads into its bf16 result, adding the last head's term before rounding it; repeated
  heads come out of the kernel rounded to bf16 each, then summed. One more bf16 rounding,
  which no sum after the kernel can undo (``test_the_two_branches_differ_by_one_rounding``
  bounds it by bf16's unit roundoff). The plan equals eager bit for bit when eager takes
  the traced branch (``test_all_ones_mask_...``).

``docs/amp.md`` ("Grouped-query attention with an all-ones mask") says what to do.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import autopar as ap

from ..parity import one_thread  # noqa: F401  (a fixture: pytestmark uses it)

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
STEPS, BATCH, SEQ = 3, 8, 32
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
O1 = "amp: {enable: true, dtype: bfloat16, level: O1}"


def llama(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CONFIG, attn_implementation=attn)).train()


def logits_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def batches(mask: str | None) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """``STEPS`` batches of ``BATCH`` x ``SEQ`` tokens, fed positionally: ``(input_ids,)``
    or ``(input_ids, attention_mask)`` with a mask of all ones or with a row's first five
    positions padded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if mask is None:
            out.append(((x,), y))
            continue
        attention_mask = torch.ones_like(x)
        if mask == "padded":
            attention_mask[0, :5] = 0
        out.append(((x, attention_mask), y))
    return out


def eager_o1(model: torch.nn.Module, data) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for inputs, labels in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss = logits_loss(model(*inputs), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def engine_o1(model: torch.nn.Module) -> ap.Engine:
    return ap.Engine(model, logits_loss, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     strategy=ap.Strategy.from_yaml_str(O1))


def assert_equal_state(got: torch.nn.Module, want: torch.nn.Module) -> None:
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize("attn,mask", [("sdpa", None), ("sdpa", "padded"), ("eager", "ones")])
def test_plan_equals_eager_autocast_bit_for_bit(attn, mask):
    """No mask: SDPA's grouped-query kernel on both sides. A padded mask: ``repeat_kv`` and
    the masked kernel on both sides, the sum over the query groups eager autograd's. The
    eager attention (matmuls): ``repeat_kv`` on both sides whatever the mask holds."""
    model = llama(attn)
    reference = copy.deepcopy(model)
    data = batches(mask)
    want = eager_o1(reference, data)
    engine = engine_o1(model)
    got = [engine.train_step(inputs, labels) for inputs, labels in data]
    assert got == want
    assert_equal_state(model, reference)


def test_all_ones_mask_plan_takes_the_branch_traced(monkeypatch):
    """An all-ones mask: the plan is the traced branch (mask kept, ``repeat_kv``), eager
    autocast drops the mask. Step 1's forward is the same; its key/value gradients are
    not, first the last layer's ``v_proj`` (the backward reaches it first). Eager made to
    keep the mask, as Hugging Face does while tracing, equals the plan bit for bit."""
    model = llama("sdpa")
    reference, traced_branch = copy.deepcopy(model), copy.deepcopy(model)
    data = batches("ones")
    engine = engine_o1(model)
    divergence = engine.locate_divergence(*data[0], reference="eager")
    got = [engine.train_step(inputs, labels) for inputs, labels in data]

    want = eager_o1(reference, data)
    assert got[0] == want[0], "step 1's loss: the two branches' forwards are the same"
    assert got != want, ("eager and the plan took the same branch: docs/amp.md and this "
                         "test say they differ; update them")
    assert divergence is not None and divergence.what == (
        "gradient of model.layers.1.self_attn.v_proj.weight"), divergence

    # Hugging Face while tracing: the mask is never dropped
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    assert eager_o1(traced_branch, data) == got
    assert_equal_state(model, traced_branch)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: key/value heads repeated for their query groups."""
    b, heads, s, d = x.shape
    return x[:, :, None].expand(b, heads, n_rep, s, d).reshape(b, heads * n_rep, s, d)


def test_the_two_branches_differ_by_one_rounding():
    """The attention of the config's shapes as the two branches call SDPA under autocast,
    queries and keys fp32 (rotary makes them), values bf16 (``v_proj``'s output).

    Eager (mask dropped): ``sdpa(q, k, v, is_causal=True, enable_gqa=True)``; the kernel
    writes a key/value head's gradient as ``round(round(t0) + t1)``: head 0's term ``t0``
    rounded to bf16, head 1's added to it unrounded. Traced (mask kept): ``sdpa(q,
    repeat_kv(k), repeat_kv(v), attn_mask)`` gives ``r0 = round(t0)``, ``r1 = round(t1)``
    and the expand's backward sums them: ``round(r0 + r1)`` for v (a bf16 ``sum``; two bf16
    terms add exactly in its fp32 accumulator), ``r0 + r1`` in fp32 for k (repeated in
    fp32, cast after). So at most three roundings separate eager's ``x`` from the traced
    ``y``, each at most u = eps/2 of what it rounds: ``|t1 - r1| <= u|t1|``, ``|x - (r0 +
    t1)| <= u|r0 + t1|``, ``|y - (r0 + r1)| <= u|r0 + r1|``; with ``|t1| <= |r1| / (1 - u)``,
    ``|r0 + t1| <= |x| / (1 - u)`` and ``|r0 + r1| <= |y| / (1 - u)``:

        |x - y| <= u / (1 - u) * (|r0| + |r1| + |x| + |y|)     (elementwise; either head first)

    The outputs and the query gradients are the same bit for bit."""
    b, heads, kv_heads, s = BATCH, CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], SEQ
    d, n_rep = CONFIG["hidden_size"] // heads, heads // kv_heads
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, n, s, d, generator=g) for n in (heads, kv_heads))
    v = torch.randn(b, kv_heads, s, d, generator=g).to(BF16)
    grad_out = torch.randn(b, heads, s, d, generator=g).to(BF16)
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)

    def run(traced: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        qq, kk, vv = leaves
        with torch.autocast("cpu", dtype=BF16):
            if traced:
                kk, vv = repeat_kv(kk, n_rep), repeat_kv(vv, n_rep)
                kk.retain_grad()
                vv.retain_grad()
                out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=causal)
            else:
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        out.backward(grad_out)
        heads_grads = (kk.grad, vv.grad) if traced else (None, None)
        return out, [t.grad for t in leaves], heads_grads

    out_x, (gq_x, gk_x, gv_x), _ = run(traced=False)
    out_y, (gq_y, gk_y, gv_y), (per_head_k, per_head_v) = run(traced=True)
    assert torch.equal(out_x, out_y) and torch.equal(gq_x, gq_y)

    u = torch.finfo(BF16).eps / 2
    for name, x, y, per_head in (("k", gk_x, gk_y, per_head_k), ("v", gv_x, gv_y, per_head_v)):
        r = per_head.float().view(b, kv_heads, n_rep, s, d)
        assert n_rep == 2 and x.dtype == y.dtype
        if name == "v":     # the traced branch's sum: the rounded heads' bf16 sum
            assert torch.equal(y, (r[:, :, 0] + r[:, :, 1]).to(BF16))
        x, y = x.float(), y.float()
        bound = u / (1 - u) * (r[:, :, 0].abs() + r[:, :, 1].abs() + x.abs() + y.abs())
        assert not torch.equal(x, y), f"grad {name}: the two branches agree; update the docs"
        excess = (x - y).abs() - bound
        assert excess.max() <= 0, f"grad {name}: {excess.max().item()} beyond the bound"
