"""Real op instances with real global values, for tests that check ops one at a time.

The joint training programs (forward, loss, backward, gradient clipping, optimizer) of
small models are captured and run once by a tiny interpreter that keeps every value, so
each op comes with the inputs it really sees: valid ids, causal masks, dropout masks,
optimizer states. Ops are deduplicated by target, input types and non-tensor arguments.
A few synthetic cases add ops that these models do not produce but that have local forms.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import models_zoo as zoo
import torch
from torch.utils import _pytree as pytree

from autopar.capture.step import capture
from autopar.ir import Op, OpKind, Program, StateKind, TensorType, Value
from autopar.ir.attrs import CONST, MULTI, NAME, STATE, STRIDES
from autopar.ir.ops import op_info, resolve
from autopar.models import GPT, MLP, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.pass_infra.context import PassContext, PlanInputs
from autopar.passes import pass_manager
from autopar.passes.decompose_loss import decompose_loss
from autopar.strategy import Strategy

BATCH, SEQ, VOCAB = 2, 8, 30
SEED = 1234


def is_random(target: str) -> bool:
    return op_info(target).random


@dataclass(repr=False)
class OpCase:
    op: Op
    inputs: list[Any]          # runtime value of each op.inputs entry (tensors are global)
    outputs: list[Any]         # runtime value of each op.outputs entry
    rng_state: torch.Tensor | None    # generator state just before a random op ran
    model: str

    @property
    def target(self) -> str:
        return self.op.target

    def __repr__(self) -> str:
        return f"OpCase<{self.describe()}>"

    def describe(self) -> str:
        types = ", ".join(str(v.type) for v in self.op.inputs)
        return f"{self.op.target}({types}) in {self.model}:{self.op.module or '-'} " \
               f"[{self.op.role.value}]"


# ----------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------
def _gpt(sdpa: bool, dropout: float) -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=12,
                         dropout=dropout, sdpa=sdpa))


def _hf_gpt2(attn: str) -> torch.nn.Module:
    return zoo.hf_gpt2(attn, VOCAB, n_layer=1, n_embd=12, n_head=2, n_positions=16)


def _hf_llama(attn: str) -> torch.nn.Module:
    return zoo.hf_llama(attn, VOCAB, hidden_size=12, intermediate_size=20, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)


def _flat_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _lm_batch(dict_inputs: bool, vocab: int = VOCAB):
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    labels = ids.clone()
    labels[0, 1] = -100           # an ignored target: exercises ignore_index paths
    return ({"input_ids": ids} if dict_inputs else ids), labels


# name -> (builder, loss, batch, decompose the mean loss)
def _model_specs() -> dict[str, Callable]:
    specs: dict[str, Callable] = {
        "mlp": lambda: (MLP(6, 10, 5, depth=2), torch.nn.functional.mse_loss,
                        (torch.randn(3, 6), torch.randn(3, 5)), False),
        "gpt": lambda: (_gpt(False, 0.1), lm_loss, _lm_batch(False), True),
        "gpt-sdpa": lambda: (_gpt(True, 0.1), lm_loss, _lm_batch(False), False),
        "gpt-sdpa-nodrop": lambda: (_gpt(True, 0.0), lm_loss, _lm_batch(False), True),
    }
    specs.update({
        "zoo-rotary": lambda: (zoo.TinyLM(zoo.RotaryAttention(12, 2), 12), _flat_lm_loss,
                               _lm_batch(False, zoo.VOCAB), False),
        "zoo-maskbuffer": lambda: (zoo.TinyLM(zoo.MaskBufferAttention(12, 16), 12),
                                   _flat_lm_loss, _lm_batch(False, zoo.VOCAB), False),
        "zoo-batchnorm": lambda: (zoo.BatchNormNet(6), torch.nn.functional.cross_entropy,
                                  (torch.randn(5, 6), torch.randint(0, 4, (5,))), False),
    })
    try:
        import transformers  # noqa: F401
    except ImportError:
        return specs
    specs.update({
        "hf-gpt2-eager": lambda: (_hf_gpt2("eager"), None, _lm_batch(True), False),
        "hf-gpt2-sdpa": lambda: (_hf_gpt2("sdpa"), None, _lm_batch(True), True),
        "hf-llama-eager": lambda: (_hf_llama("eager"), None, _lm_batch(True), True),
        "hf-llama-sdpa": lambda: (_hf_llama("sdpa"), None, _lm_batch(True), False),
    })
    return specs


def _program(model, loss, batch, decompose: bool) -> tuple[Program, torch.optim.Optimizer]:
    inputs, labels = batch
    program = capture(model, loss, inputs, labels, mode="train").program
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    strategy = Strategy(grad_clip={"max_norm": 1.0})
    ctx = PassContext(PlanInputs.of(strategy, optimizer=optimizer, param_names={
        id(p): n for n, p in model.named_parameters()}))
    program = pass_manager().run(program, ctx)
    if decompose:      # a no-op if the pipeline already decomposed the mean loss
        program = decompose_loss(program, ctx)
    return program, optimizer


# ----------------------------------------------------------------------------------------
# the interpreter
# ----------------------------------------------------------------------------------------
def _state_value(op: Op, model: torch.nn.Module) -> Any:
    name, kind = op.attrs[NAME], op.attrs[STATE].kind
    if kind is StateKind.PARAM:
        return dict(model.named_parameters())[name].detach().clone()
    if kind is StateKind.BUFFER:
        return dict(model.named_buffers())[name].clone()
    if kind is StateKind.CONST:
        return op.attrs[CONST]
    # optimizer state: not the all-zero first step, so the update math is exercised
    t = op.result.type
    key = op.attrs[STATE].key
    if key == "step":
        return torch.tensor(3.0, dtype=t.dtype)
    if key in ("exp_avg_sq", "max_exp_avg_sq"):
        return torch.rand(t.shape, dtype=t.dtype) * 1e-3
    return torch.randn(t.shape, dtype=t.dtype) * 1e-2


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def interpret(program: Program, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              batch, name: str) -> list[OpCase]:
    """Run ``program`` op by op, keeping every value; one OpCase per call op."""
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    env: dict[Value, Any] = {}
    cases = []
    generator = torch.default_generator
    saved = generator.get_state()
    generator.manual_seed(SEED)
    try:
        with torch.no_grad():
            for op in program.ops:
                if op.kind is OpKind.INPUT:
                    key = op.attrs[NAME]
                    group, _, index = key.partition("/")
                    env[op.result] = leaves[int(index)] if group == "batch" \
                        else optimizer.param_groups[int(index)]
                elif op.kind is OpKind.STATE:
                    env[op.result] = _state_value(op, model)
                elif op.kind is OpKind.CALL:
                    inputs = [env[v] for v in op.inputs]
                    rng = generator.get_state() if is_random(op.target) else None
                    swap = lambda a: _clone(env[a]) if isinstance(a, Value) else a  # noqa: E731
                    args, kwargs = pytree.tree_map(swap, (op.args, op.kwargs))
                    out = resolve(op.target)(*args, **kwargs)
                    outs = list(out) if (len(op.outputs) > 1 or op.attrs.get(MULTI)) \
                        else [out]
                    for v, o in zip(op.outputs, outs, strict=True):
                        env[v] = o
                    cases.append(OpCase(op, inputs, outs, rng, name))
    finally:
        generator.set_state(saved)
    return cases


def _arg_key(a: Any) -> Any:
    if isinstance(a, Value):
        return str(a.type)
    if isinstance(a, float):
        return repr(a)
    return repr(a)


def case_key(op: Op) -> tuple:
    args, kwargs = pytree.tree_map(_arg_key, (op.args, op.kwargs))
    return (op.target, repr(args), repr(sorted(kwargs.items())))


# ----------------------------------------------------------------------------------------
# synthetic cases: ops with local forms that the models above do not produce
# ----------------------------------------------------------------------------------------
def synthetic(target: str, *args, model: str = "synthetic", **kwargs) -> OpCase:
    """An OpCase from concrete arguments: tensors become Values."""
    values: list[Any] = []

    def to_value(a):
        if isinstance(a, torch.Tensor):
            values.append(a)
            return Value(TensorType(tuple(a.shape), a.dtype))
        return a

    vargs, vkwargs = pytree.tree_map(to_value, (args, kwargs))
    rng = torch.default_generator.get_state() if is_random(target) else None
    out = resolve(target)(*pytree.tree_map(_clone, args), **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    types = [TensorType(tuple(o.shape), o.dtype) for o in outs]
    op = Op(OpKind.CALL, target, vargs, vkwargs, [Value(t) for t in types])
    if rng is not None:   # what capture records for random ops: the layout they filled
        op.attrs[STRIDES] = tuple(tuple(o.stride()) for o in outs)
    return OpCase(op, values, outs, rng, model)


def _conv_cases(g: torch.Generator) -> list[OpCase]:
    """Convolutions (plain with bias, grouped without, transposed), their backward, and
    max pooling with its backward."""
    x = torch.randn(2, 4, 5, 5, generator=g)
    w, b = torch.randn(6, 4, 3, 3, generator=g), torch.randn(6, generator=g)
    w_grouped, w_t = torch.randn(6, 2, 3, 3, generator=g), torch.randn(4, 6, 3, 3, generator=g)
    conv = [1, 1], [1, 1], [1, 1]
    grad = torch.randn(2, 6, 5, 5, generator=g)
    pooled, indices = torch.ops.aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    return [
        synthetic("aten.convolution.default", x, w, b, *conv, False, [0, 0], 1),
        synthetic("aten.convolution.default", x, w_grouped, None, *conv, False, [0, 0], 2),
        synthetic("aten.convolution.default", x, w_t, b, *conv, True, [0, 0], 1),
        synthetic("aten.convolution_backward.default", grad, x, w, [6], *conv, False,
                  [0, 0], 1, [True, True, True]),
        synthetic("aten.convolution_backward.default", grad, x, w_grouped, [6], *conv, False,
                  [0, 0], 2, [True, True, True]),
        synthetic("aten.max_pool2d_with_indices.default", x, [2, 2], [2, 2]),
        synthetic("aten.max_pool2d_with_indices_backward.default", torch.randn_like(pooled),
                  x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices),
    ]


def _index_put_cases(g: torch.Generator) -> list[OpCase]:
    """Indexed writes: the backward of ``table[ids]`` (accumulated, 1-D and 2-D ids), a
    write of distinct rows, and non-adjacent index tensors (their dims lead the values)."""
    table = torch.randn(6, 4, generator=g)
    ids = torch.randint(0, 6, (3, 5), generator=g)
    cube = torch.randn(6, 5, 4, generator=g)
    return [
        synthetic("aten.index_put.default", table, [ids[0]], torch.randn(5, 4, generator=g),
                  True),
        synthetic("aten.index_put.default", table, [ids], torch.randn(3, 5, 4, generator=g),
                  True),
        synthetic("aten.index_put.default", table, [torch.tensor([4, 0, 2])],
                  torch.randn(3, 4, generator=g), False),
        synthetic("aten.index_put.default", cube, [ids[0, :3], None, ids[1, :3] % 4],
                  torch.randn(3, 5, generator=g), True),
    ]


def _activation_backward_cases(g: torch.Generator) -> list[OpCase]:
    """Activation backwards torch does not tag pointwise (linear in the gradient), and
    hardswish, which is not tagged either."""
    grad, x = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    a = "aten."
    return [
        synthetic(a + "softplus_backward.default", grad, x, 1.0, 20.0),
        synthetic(a + "elu_backward.default", grad, 1.0, 1.0, 1.0, False, x),
        synthetic(a + "hardtanh_backward.default", grad, x, -1.0, 1.0),
        synthetic(a + "leaky_relu_backward.default", grad, x, 0.01, False),
        synthetic(a + "mish_backward.default", grad, x),
        synthetic(a + "hardswish_backward.default", grad, x),
        synthetic(a + "hardsigmoid_backward.default", grad, x),
        synthetic(a + "softshrink_backward.default", grad, x, 0.5),
        synthetic(a + "hardshrink_backward.default", grad, x, 0.5),
        synthetic(a + "logit_backward.default", grad, x.sigmoid(), None),
        synthetic(a + "hardswish.default", x),
    ]


def _micro_batch_norm_cases(g: torch.Generator) -> list[OpCase]:
    """Batch norm by a micro-batch's statistics (outside a pipeline: plain batch norm)."""
    x, w, b = torch.randn(6, 4, 3, generator=g), torch.randn(4, generator=g), \
        torch.randn(4, generator=g)
    out, mean, invstd, _, _ = resolve("autopar.micro_batch_norm")(x, w, b, 0.1, 1e-5)
    grad = torch.randn_like(out)
    return [
        synthetic("autopar.micro_batch_norm", x, w, b, 0.1, 1e-5),
        synthetic("autopar.micro_batch_norm_backward", grad, x, w, mean, invstd, 1e-5,
                  [True, True, True]),
    ]


def _synthetic_cases() -> list[OpCase]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, 4, generator=g)
    saved = torch.default_generator.get_state()
    torch.default_generator.manual_seed(SEED + 1)
    try:
        return [
            synthetic("aten.mean.default", x),
            synthetic("aten.mean.dim", x, [0, 2], True),
            synthetic("aten.arange.start_step", 3, 40, 3),
            synthetic("aten.arange.start", 2, 9, dtype=torch.float32),
            synthetic("aten.triu.default", torch.randn(7, 9, generator=g), 1),
            synthetic("aten.tril.default", torch.randn(2, 7, 6, generator=g), -1),
            synthetic("aten.new_zeros.default", x, [5, 7]),
            synthetic("aten.new_ones.default", x, [3, 4]),
            *_conv_cases(g),
            synthetic("aten.cumsum.default", x, 1),
            synthetic("aten.topk.default", x, 2, 1),
            synthetic("aten.index.Tensor", x, [None, torch.tensor([[0, 3], [1, 1], [4, 2]])]),
            synthetic("aten.index.Tensor", x, [torch.tensor([5, 0, 2]), None,
                                               torch.tensor([1, 3, 0])]),
            *_index_put_cases(g),
            *_activation_backward_cases(g),
            *_micro_batch_norm_cases(g),
            synthetic("aten.view_as_complex.default", torch.randn(6, 4, 2, generator=g)),
            synthetic("aten.view_as_real.default", torch.randn(6, 4, dtype=torch.complex64,
                                                               generator=g)),
            synthetic("aten._conj.default", torch.randn(6, 4, dtype=torch.complex64,
                                                        generator=g)),
            synthetic("aten.full.default", [6, 4], 2.5),
            synthetic("aten.native_dropout.default", torch.randn(6, 5, generator=g), 0.3, True),
            synthetic("aten.rand_like.default", x),
            synthetic("aten.randn.default", [7, 3]),
            synthetic("aten.embedding.default", torch.randn(11, 4, generator=g),
                      torch.randint(0, 11, (3, 5), generator=g)),
            synthetic("aten.embedding_dense_backward.default", torch.randn(3, 5, 4, generator=g),
                      torch.randint(0, 11, (3, 5), generator=g), 11, 2, True),
            synthetic("aten.mse_loss_backward.default", torch.tensor(0.7), torch.randn(5, 3),
                      torch.randn(5, 3), 1),
            # the mean-reduced loss as a model without decompose_loss would have it
            synthetic("aten.nll_loss_forward.default",
                      torch.randn(5, 7, generator=g).log_softmax(-1),
                      torch.tensor([1, 6, -100, 0, 3]), None, 1, -100),
        ]
    finally:
        torch.default_generator.set_state(saved)


# ----------------------------------------------------------------------------------------
# the collection
# ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def collect(unique: bool = True) -> tuple[OpCase, ...]:
    """Every call op of every model's training program (first instance of each key)."""
    saved = torch.random.get_rng_state()
    torch.manual_seed(0)
    cases: list[OpCase] = []
    try:
        for name, spec in _model_specs().items():
            model, loss, batch, decompose = spec()
            model.train()
            program, optimizer = _program(model, loss, batch, decompose)
            cases += interpret(program, model, optimizer, batch, name)
        cases += _synthetic_cases()
    finally:
        torch.random.set_rng_state(saved)
    if not unique:
        return tuple(cases)
    seen: dict[tuple, OpCase] = {}
    for case in cases:
        seen.setdefault(case_key(case.op), case)
    return tuple(seen.values())


def by_target() -> dict[str, list[OpCase]]:
    table: dict[str, list[OpCase]] = {}
    for case in collect():
        table.setdefault(case.target, []).append(case)
    return dict(sorted(table.items()))


__all__ = ["OpCase", "collect", "by_target", "interpret", "synthetic", "case_key", "is_random"]
