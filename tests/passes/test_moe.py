"""Mixture-of-experts models as they come: Hugging Face Mixtral and Qwen2-MoE with their
default experts implementation (grouped_mm on this torch), captured with autopar's dense
dispatch (autopar/capture/experts.py), trained serially, under data parallelism, a 1F1B
pipeline and expert parallelism on the simulator: every step's loss and the final
parameters equal eager torch's.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import autopar as ap
from autopar.capture.step import CaptureError, CaptureNote, capture
from autopar.ir import Program, StateKind
from autopar.ir.attrs import NAME
from autopar.ir.dist import (
    DistAttr,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    shard_tensor_local,
)
from autopar.ir.ops import resolve
from autopar.spmd import lookup

from ..spmd_util import T, make_op

transformers = pytest.importorskip("transformers")
# every capture of these models says it swapped their experts dispatch (tested once below)
pytestmark = pytest.mark.filterwarnings("ignore::autopar.capture.step.CaptureNote")

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=64)


def mixtral() -> torch.nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=64, num_local_experts=4, **TINY))


def qwen2_moe() -> torch.nn.Module:
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=4, norm_topk_prob=False, **TINY))


def mixtral_aux() -> torch.nn.Module:
    """Mixtral with its load-balancing loss (counts of routed tokens per expert: a
    histogram of the whole batch; a pipeline refuses it, its micro-batches would change it)."""
    model = mixtral()
    model.config.output_router_logits = True
    return model


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "mixtral_aux": mixtral_aux}
STRATEGIES = {
    "serial": "",
    "dp2": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n",
    "pp2": "mesh: {shape: [2], dim_names: [pp]}\n"
           "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2, split: auto}\n",
    "ep2": "mesh: {shape: [2], dim_names: [ep]}\nexpert_parallel: {axis: ep}\n",
    "dp2_ep2": "mesh: {shape: [2, 2], dim_names: [dp, ep]}\ndata_parallel: {axis: dp}\n"
               "expert_parallel: {axis: ep}\n",
    "pp2_ep2": "mesh: {shape: [2, 2], dim_names: [pp, ep]}\nexpert_parallel: {axis: ep}\n"
               "pipeline: {axis: pp, schedule: 1F1B, micro_batches: 2, split: auto}\n",
    # experts split over the data-parallel ranks: tokens reach them by all-to-all
    "ep2_on_dp": "mesh: {shape: [2], dim_names: [dp]}\ndata_parallel: {axis: dp}\n"
                 "expert_parallel: {axis: dp}\n",
}


def _built(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().train()
    # the default init draws the router weights too small to route tokens differently
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "top_k") and isinstance(getattr(module, "weight", None),
                                                       torch.nn.Parameter):
                module.weight.normal_(0, 1.0)
    return model


def _data() -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    return [({"input_ids": row}, row.clone()) for row in ids]


def _batch(rows: list) -> tuple[dict, torch.Tensor]:
    return ({"input_ids": torch.stack([x["input_ids"] for x, _ in rows])},
            torch.stack([y for _, y in rows]))


def _eager(name: str, data: list) -> tuple[list[float], torch.nn.Module]:
    model = _built(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        inputs, labels = _batch(data[step * BATCH:(step + 1) * BATCH])
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def _train(name: str, strategy: str, data: list) -> tuple[list[float], torch.nn.Module]:
    model = _built(name)
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           STRATEGIES[strategy] + "debug: {simulate: true}\n"))
    losses = engine.fit(data, batch_size=BATCH, steps_per_epoch=STEPS, verbose=0)["loss"]
    return losses, model          # fit writes the trained values back into the model


# both models under each kind of parallelism; the compositions with Mixtral (test time)
RUNS = [(name, strategy) for name in ("mixtral", "qwen2_moe")
        for strategy in ("serial", "dp2", "pp2", "ep2")]
RUNS += [("mixtral", "dp2_ep2"), ("mixtral", "pp2_ep2"), ("mixtral", "ep2_on_dp"),
         ("mixtral_aux", "dp2_ep2")]


@pytest.mark.parametrize("name, strategy", RUNS)
def test_moe_trains_like_eager(name, strategy):
    data = _data()
    want, eager_model = _eager(name, data)
    got, model = _train(name, strategy, data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    for (key, a), (_, b) in zip(model.state_dict().items(), eager_model.state_dict().items()):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_default_experts_implementation_is_the_one_captured():
    """The models come with grouped_mm (whose fake kernel refuses fp32); capture says it
    replaced their dispatch, naming every experts module."""
    model = _built("mixtral")
    assert model.config._experts_implementation == "grouped_mm"
    inputs, labels = _batch(_data()[:BATCH])
    with pytest.warns(CaptureNote, match="model.layers.0.mlp.experts, model.layers.1.mlp.experts"):
        captured = capture(model, None, inputs, labels)
    assert captured.notes and not any("grouped_mm" in op.target for op in captured.program.ops)


class UserMoE(torch.nn.Module):
    """A user's MoE layer: top-2 of 4 experts, either looping over the experts its tokens
    hit (value-dependent shapes) or written densely."""

    def __init__(self, dense: bool, d: int = 8, experts: int = 4):
        super().__init__()
        self.dense = dense
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            if self.dense:    # every expert on every token, zero weight where not routed
                out = out + expert(x) * (weights * (index == e)).sum(-1, keepdim=True)
            else:
                rows, slot = torch.nonzero(index == e, as_tuple=True)
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return out


class UserNet(torch.nn.Sequential):
    def __init__(self, dense: bool):
        super().__init__()
        self.moe = UserMoE(dense)
        self.head = torch.nn.Linear(8, 3)


def _user_moe_fit(dense: bool, strategy: str) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(3, generator=g)) for _ in range(8)]
    loss = torch.nn.functional.mse_loss
    torch.manual_seed(0)
    model = UserNet(dense)
    reference = UserNet(dense)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for step in range(2):
        x, y = (torch.stack(t) for t in zip(*data[step * 4:(step + 1) * 4]))
        value = loss(reference(x), y)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        want.append(value.item())
    engine = ap.Engine(model, loss, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           STRATEGIES[strategy] + "debug: {simulate: true}\n"))
    return engine.fit(data, batch_size=4, steps_per_epoch=2, verbose=0)["loss"], want


def test_a_user_moe_written_densely_trains_like_eager_under_dp2():
    got, want = _user_moe_fit(dense=True, strategy="dp2")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)


def test_a_routing_loop_is_refused_naming_the_module_and_the_dense_form():
    with pytest.raises(CaptureError, match=r"module 'moe'.*mixture-of-experts.*densely"):
        _user_moe_fit(dense=False, strategy="serial")


def _planned(name: str, strategy: str) -> tuple[ap.Engine, Program]:
    model = _built(name)
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           STRATEGIES[strategy] + "debug: {simulate: true, strict_rules: true}\n"))
    return engine, engine.prepare(*_batch(_data()[:BATCH]))


@pytest.mark.parametrize("strategy, moves", [
    ("ep2", {"comm.slice", "comm.all_reduce"}), ("ep2_on_dp", {"comm.all_to_all"})])
def test_expert_parallel_runs_each_ranks_own_experts(strategy, moves):
    """The expert stacks are Shard(0) (two of four experts per rank, gradients and momentum
    too) and every expert matmul runs on the rank's own experts; planned strictly (every op
    has a rule). On the data-parallel axis, tokens reach the experts' ranks and come back by
    all-to-all, never gathered whole."""
    _, program = _planned("mixtral", strategy)
    states = {op.attrs[NAME]: op.result for op in program.states(StateKind.PARAM)}
    for name, value in states.items():
        sharded = ".experts." in name
        assert str(value.dist.placements[0]) == ("S(0)" if sharded else "R"), name
    experts = [op for op in program.ops if op.module.endswith("mlp.experts")]
    assert all(str(op.outputs[0].dist.placements[0]) == "S(0)"
               for op in experts if op.target == "aten.bmm.default")
    assert {op.target for op in experts if op.target.startswith("comm.")} == moves


def test_experts_on_their_own_axis_cost_three_all_reduces_per_layer():
    """Every rank holds every token, so nothing else moves: per layer, the experts' output
    (forward) and the gradients of their tokens and routing weights (backward) are summed
    over the axis where the module hands them out; attention, norms and every other
    gradient stay local."""
    _, program = _planned("mixtral", "ep2")
    moved = [(op.target, op.module, op.role.value, op.outputs[0].type.shape)
             for op in program.ops if op.target.startswith("comm.") and op.target != "comm.slice"]
    per_layer = [("comm.all_reduce", f"model.layers.{i}.mlp.experts", "comm", shape)
                 for i in (0, 1) for shape in ((BATCH * SEQ, 32),) * 2 + ((BATCH * SEQ, 2),)]
    assert sorted(moved) == sorted(per_layer)


def test_expert_parallel_errors_name_the_module_mesh_and_placements():
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' has 4 experts.*"
                                         r"'ep' of size 3.*Shard\(0\)"):
        model = _built("mixtral")
        ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                  strategy=ap.Strategy.from_yaml_str(
                      "mesh: {shape: [3], dim_names: [ep]}\nexpert_parallel: {axis: ep}\n"
                      "debug: {simulate: true}\n")).prepare(*_batch(_data()[:BATCH]))
    with pytest.raises(ValueError, match="no module holds its experts' weights stacked"):
        torch.manual_seed(0)
        model = UserNet(dense=True)
        ap.Engine(model, torch.nn.functional.mse_loss,
                  torch.optim.SGD(model.parameters(), lr=0.1),
                  strategy=ap.Strategy.from_yaml_str(STRATEGIES["ep2"])).prepare(
                      torch.randn(4, 8), torch.randn(4, 3))


def test_expert_parallel_section_is_strict():
    with pytest.raises(ValueError, match="unknown key 'axes'"):
        ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [ep]}\n"
                                  "expert_parallel: {axes: ep}\n")
    with pytest.raises(ValueError, match="expert_parallel.axis 'ep' is not one of the mesh"):
        ap.Strategy.from_yaml_str("mesh: {shape: [2], dim_names: [dp]}\n"
                                  "expert_parallel: {axis: ep}\n")


def _routing_cases() -> list[tuple[str, tuple]]:
    """The scatters routing makes (topk's backward: zeros scattered along the expert dim)
    and their siblings, and the histogram of routed experts, with concrete arguments."""
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])    # [6, 2]
    rows = torch.tensor([3, 0, 3, 1])
    return [
        ("aten.scatter.src", (torch.randn(6, 4, generator=g), -1, index,
                              torch.randn(6, 2, generator=g))),
        ("aten.scatter_add.default", (torch.randn(6, 4, generator=g), 1, index,
                                      torch.randn(6, 2, generator=g))),
        ("aten.scatter.src", (torch.randn(4, 6, generator=g), 0, index.t().contiguous(),
                              torch.randn(2, 6, generator=g))),
        ("aten.scatter.value", (torch.randn(6, 4, generator=g), 1, index, 0.0)),
        ("aten.scatter.value", (torch.randn(6, 4, generator=g), 1, index, 2.0)),
        ("aten.index_add.default", (torch.randn(5, 3, generator=g), 0, rows,
                                    torch.randn(4, 3, generator=g))),
        ("aten.index_add.default", (torch.randn(3, 5, generator=g), 1, rows,
                                    torch.randn(3, 4, generator=g))),
        # tokens per expert, as a load-balancing loss counts them
        ("aten.histc.default", (index.float(), 4, 0, 4)),
    ]


def _placements_for(x: torch.Tensor, is_index: bool) -> list[Placement]:
    return [Replicate()] + [Shard(d) for d in range(x.dim())] + ([] if is_index
                                                                  else [Partial("sum")])


@pytest.mark.parametrize("case", range(len(_routing_cases())))
def test_routing_rules_hold_on_every_placement(case):
    """For every placement of the inputs on two ranks, the rule's needs run as the plain op
    on each rank's pieces assemble, by the rule's output placement, into the global result."""
    target, args = _routing_cases()[case]
    op = make_op(target, *[T(*a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a
                           for a in args])
    want = resolve(target)(*args)
    mesh = ProcessMesh([0, 1], dim_names=["x"])
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    choices = [_placements_for(args[i], is_index=not args[i].is_floating_point())
               for i in tensors]
    for placed in itertools.product(*choices):
        decision = lookup(op).forward(op, [DistAttr(mesh, (p,)) for p in placed], mesh)
        per_rank = {}
        for rank in (0, 1):
            local = list(args)
            for i, need in zip(tensors, decision.needs):
                p = need.placements[0]
                if isinstance(p, Partial):     # rank 0 holds the value, rank 1 zeros
                    local[i] = args[i] * (1 - rank)
                else:
                    local[i] = shard_tensor_local(args[i], mesh, (p,), (rank,))
            per_rank[(rank,)] = resolve(target)(*local)
        out = decision.outputs[0]
        got = assemble(per_rank, want.shape, mesh, out.placements)
        torch.testing.assert_close(got, want, msg=lambda m, placed=placed, d=decision:
                                   f"{target} {placed} -> needs {d.needs}, out {d.outputs}: {m}")


def test_moe_evaluates_like_eager_with_experts_on_the_dp_axis():
    data = _data()
    model, reference = _built("mixtral"), _built("mixtral").eval()
    model.config.use_cache = False        # eval programs return tensors, not a KV cache
    engine = ap.Engine(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                       strategy=ap.Strategy.from_yaml_str(
                           STRATEGIES["ep2_on_dp"] + "debug: {simulate: true}\n"))
    got = engine.evaluate(data, batch_size=BATCH)["loss"]
    with torch.no_grad():
        want = [reference(**_batch(data[i:i + BATCH])[0],
                          labels=_batch(data[i:i + BATCH])[1]).loss
                for i in range(0, len(data), BATCH)]
    torch.testing.assert_close(torch.tensor(got), torch.stack(want).mean(), **TOL)


@pytest.mark.parametrize("build", [
    lambda: transformers.models.mixtral.modeling_mixtral.MixtralExperts(
        transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)),
    # biases, [experts, in, out] weights, an interleaved clamped gate
    lambda: transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(
        transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)),
    # no gate: up_proj and an activation
    lambda: transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts(
        transformers.NemotronHConfig(hidden_size=16, moe_intermediate_size=8,
                                     n_routed_experts=4)),
], ids=["mixtral", "gpt_oss", "nemotron_h"])
def test_dense_dispatch_equals_each_experts_layout_eager_loop(build):
    """The dense dispatch against the experts class's own eager loop, for the layouts the
    transformers interface describes (values and gradients)."""
    from autopar.capture.experts import dense_experts_forward, is_hf_experts
    torch.manual_seed(0)
    experts = build()
    assert is_hf_experts(experts)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(10, 16, requires_grad=True)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, requires_grad=True)
    seed = torch.randn(10, 16)
    results = []
    for forward in (type(experts).forward.__wrapped__, dense_experts_forward):
        out = forward(experts, x, index, weights)
        grads = torch.autograd.grad((out * seed).sum(), [x, weights, *experts.parameters()])
        results.append((out, *grads))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **TOL)
