"""Megatron sequence parallelism (``tensor_parallel.sequence_parallel``): the annotate pass
pins the outputs of rowwise and vocab modules to a sequence shard on tp, and completion and
reshard turn that into the Megatron-SP plan: a reduce-scatter after each row-parallel region
instead of an all-reduce, an all-gather before each column-parallel one, LayerNorm, dropout
and residual adds on the sequence shard, and the mirror image in backward. Trained on the
simulator it must equal single-device eager torch step for step."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar as ap
from autopar.ir import OpKind, Program
from autopar.ir.attrs import MULTI, NAME
from autopar.ir.dist import Shard
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.pass_infra.pinning import AnnotationError
from autopar.reshard.comm import BUCKET_STEPS, FOR_ROLE, RESHARD_STEP

from ..models_zoo import MegatronMLP, mse
from ..parity import assert_same_losses, assert_same_params, eager_train, lm_data, twin

PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
        "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise", "wte": "vocab"}
ROWWISE = {"wte", "blocks.0.attn.proj", "blocks.0.fc2", "blocks.1.attn.proj", "blocks.1.fc2"}
COLWISE = {"blocks.0.attn.qkv", "blocks.0.fc1", "blocks.1.attn.qkv", "blocks.1.fc1", "head"}
LAYER_NORMS = {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"}
SEQ = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The simulator runs thousands of tiny kernels: on 2 shared cores torch's intra-op
    threads make them several times slower. Eager and simulated runs share the setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _strategy(mesh: str, sequence_parallel: bool = True, simulate: bool = False,
              **tp) -> ap.Strategy:
    shape, names = ([2], ["tp"]) if mesh == "tp" else ([2, 2], ["dp", "tp"])
    return ap.Strategy(mesh={"shape": shape, "dim_names": names},
                       data_parallel={"axis": "dp"} if "dp" in names else None,
                       tensor_parallel={"axis": "tp", "plan": tp.pop("plan", PLAN),
                                        "sequence_parallel": sequence_parallel, **tp},
                       debug={"simulate": simulate})


def _gpt(**config) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64,
                            "block_size": SEQ, "sdpa": False, **config}))


def _plan(strategy: ap.Strategy, seq: int = SEQ, model=None) -> Program:
    model = model or _gpt()
    engine = ap.Engine(model, lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=strategy)
    tokens = torch.randint(0, 64, (4, seq + 1), generator=torch.Generator().manual_seed(0))
    return engine.prepare(tokens[:, :-1], tokens[:, 1:])


@functools.cache
def _gpt_plan(mesh: str, sequence_parallel: bool = True) -> Program:
    """The GPT's planned training step (several tests read the same plan; none edits it)."""
    return _plan(_strategy(mesh, sequence_parallel))


def _tp_comms(program: Program, consumer_role: str) -> list[tuple[str, int | None, str, tuple]]:
    """(kind, tensor dim, consumer module, shape) of each tp collective feeding ``role`` ops
    (not the program's results: the loss is all-reduced to be read whole). A bucket of
    all-reduces counts as its steps, moving its wait's results."""
    tp = program.ops[0].outputs[0].dist.mesh.dim_index("tp")
    results = set(program.output_op.inputs)
    readers = program.users()
    found = []
    for op in program.ops:
        if (op.kind is not OpKind.COMM or op.attrs.get(FOR_ROLE) != consumer_role
                or op.attrs.get(MULTI)):
            continue
        bucketed = BUCKET_STEPS in op.attrs
        steps = op.attrs[BUCKET_STEPS] if bucketed else (op.attrs[RESHARD_STEP],)
        # a bucket's results are its wait's
        moved = readers[op.outputs[0]][0].outputs if bucketed else op.outputs
        for step, v in zip(steps, moved):
            if step.mesh_dim == tp and v not in results:
                found.append((step.kind, getattr(step, "tensor_dim", None), op.module,
                              v.type.shape))
    return found


def _activation_all_reduces(comms) -> list:
    """All-reduces over tp in the model; the vocab-parallel cross-entropy (``<loss>``)
    reduces its per-token statistics over tp by design."""
    return [c for c in comms if c[0] == "all_reduce" and c[2] != "<loss>"]


def _modules(comms, kind: str, dim: int, shape: tuple | None = None) -> set[str]:
    return {m for k, d, m, s in comms if k == kind and d == dim and shape in (None, s)}


# ---- (a) the plan --------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", ["tp", "dp_tp"])
def test_forward_reduce_scatters_after_rowwise_and_gathers_before_colwise(mesh):
    forward = _tp_comms(_gpt_plan(mesh), "fwd")
    assert _activation_all_reduces(forward) == []
    assert _modules(forward, "reduce_scatter", 1) == ROWWISE
    assert len([c for c in forward if c[0] == "reduce_scatter"]) == len(ROWWISE)
    # sequence gathers of the hidden activation (the eager-softmax attention gathers its
    # local heads [B, H, T, hd] on dim 1 too, before the flattening bmm: not SP's doing)
    assert _modules(forward, "all_gather", 1, (4, SEQ, 32)) == COLWISE
    # tensor parallelism alone all-reduces where SP reduce-scatters: one for one
    plain = _tp_comms(_gpt_plan(mesh, sequence_parallel=False), "fwd")
    assert len([c for c in plain if c[0] == "all_reduce" and len(c[3]) == 3]) == len(ROWWISE)
    assert [c for c in plain if c[0] == "reduce_scatter"] == []


def test_backward_mirrors_the_forward_and_layer_norms_run_on_the_sequence_shard():
    program = _gpt_plan("tp")
    backward = _tp_comms(program, "bwd")
    assert _activation_all_reduces(backward) == []
    hidden = (4, SEQ, 32)
    # the gradient of each gather before a colwise module is a reduce-scatter (read by the
    # LayerNorm backward before it), of each reduce-scatter after a rowwise one a gather
    assert _modules(backward, "reduce_scatter", 1, hidden) == LAYER_NORMS
    assert _modules(backward, "all_gather", 1, hidden) == ROWWISE - {"wte"}
    norms = [op for op in program.ops if op.target.startswith("aten.native_layer_norm")]
    assert {op.module for op in norms} == LAYER_NORMS and len(norms) == 2 * len(LAYER_NORMS)
    for op in norms:   # forward and backward: input (and grad) held sequence-sharded
        assert op.needs[0].placements == (Shard(1),), (op.target, op.module)
    # only the gradients of replicated parameters (LayerNorm, wpe) are all-reduced
    reduced = [c for c in _tp_comms(program, "opt") if c[0] == "all_reduce"]
    params = {op.attrs[NAME]: op.result.type.shape for op in program.ops_of(OpKind.STATE)}
    assert reduced and all(s in params.values() for _, _, _, s in reduced)


def test_sequence_dim_option_and_the_yaml_config():
    strategy = ap.Strategy.from_yaml("configs/tp_sp.yaml")
    assert strategy.tensor_parallel.sequence_parallel
    assert strategy.tensor_parallel.sequence_dim == 1
    assert _tp_comms(_plan(strategy), "fwd") == _tp_comms(_gpt_plan("tp"), "fwd")


# ---- (b) parity with single-device eager torch ----------------------------------------------

@pytest.mark.parametrize("mesh,config", [
    ("tp", {"dropout": 0.1}),               # dropout masks drawn on the sequence shard
    ("dp_tp", {"sdpa": True}),
], ids=["tp2_sp_dropout", "dp2_tp2_sp_sdpa"])
def test_training_matches_eager_single_device(mesh, config):
    model = _gpt(**config)
    ref = twin(model)
    data = lm_data(80, SEQ, 64)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    ref_losses = eager_train(ref, lm_loss, sgd(ref), data, batch_size=4, steps=20)
    engine = ap.Engine(model, lm_loss, sgd(model), strategy=_strategy(mesh, simulate=True))
    if config.get("dropout"):    # the residual branches' masks are drawn sequence-sharded
        x, y = (torch.stack(t) for t in zip(*data[:4]))
        masks = [op.result for op in engine.prepare(x, y).ops
                 if op.target == "aten.bernoulli_.float" and op.result.type.shape == (4, SEQ, 32)]
        assert len(masks) == 4 and all(v.dist.placements == (Shard(1),) for v in masks)
    losses = engine.fit(data, batch_size=4, steps_per_epoch=20, verbose=0)["loss"]
    assert len(losses) == 20
    assert_same_losses(losses, ref_losses)
    assert_same_params(model, ref)


# ---- (c) clear errors ----------------------------------------------------------------------

def test_sequence_length_not_divisible_by_tp_is_refused_naming_module_shape_and_mesh():
    with pytest.raises(AnnotationError) as err:
        _plan(_strategy("dp_tp"), seq=15)
    text = str(err.value)
    assert "'blocks.0.attn.proj'" in text and "f32[4,15,32]" in text
    assert "sequence length 15" in text and "2 ranks of tp" in text and "mesh" in text


def test_activation_without_the_sequence_dim_is_refused():
    torch.manual_seed(0)
    model = MegatronMLP()     # [batch, hidden] activations: no dim 2
    engine = ap.Engine(model, mse, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=_strategy("tp", plan={"fc1": "colwise", "fc2": "rowwise"},
                                          sequence_dim=2))
    with pytest.raises(AnnotationError) as err:
        engine.prepare(torch.randn(4, 16), torch.randn(4, 16))
    text = str(err.value)
    assert "'fc2'" in text and "f32[4,16]" in text and "no sequence_dim 2" in text
    assert "mesh" in text


def test_sequence_parallel_needs_a_rowwise_or_vocab_entry():
    with pytest.raises(AnnotationError, match="no rowwise or vocab entry"):
        _plan(_strategy("tp", plan={"blocks.*.fc1": "colwise"}))


def test_sequence_dim_without_sequence_parallel_is_a_strategy_error():
    with pytest.raises(ValueError, match="sequence_dim=0 needs sequence_parallel: true"):
        ap.Strategy(tensor_parallel={"axis": "tp", "plan": PLAN, "sequence_dim": 0})
