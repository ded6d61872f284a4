"""Repeated layers in the placement ILP (autopar.pass_infra.layers): identical layers of a module
list are found (forward, backward, optimizer step, parameters and states), layers that
differ are not tied, and tying gives the untied optimum on a model whose layers all do the
same in it, in a program whose size does not grow with the depth."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn

import autopar as ap
from autopar.auto import placed_program, solve_placements
from autopar.auto.ilp_completion import commit_choice
from autopar.auto.tp_plan import tensor_parallel_plan_of
from autopar.cost.profile import AlphaBeta, Profile
from autopar.ir import OpKind, Role
from autopar.ir.attrs import NAME
from autopar.models import GPT, GPTConfig
from autopar.models.gpt import lm_loss
from autopar.pass_infra.explain import planned_moves
from autopar.pass_infra.layers import layer_of, repeated_layers
from autopar.pass_infra.manager import PassManager
from autopar.passes import PIPELINE

from ..models_zoo import hf_gpt2
from ..parity import one_thread
from .test_placement_ilp import MACHINE

pytestmark = pytest.mark.usefixtures("one_thread")
_ = one_thread

TP2 = "mesh: {shape: [2], dim_names: [tp]}"


def _gpt_program(layers: int, strategy: str = TP2):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=layers, n_head=4, n_embd=64))
    ids = torch.randint(0, 128, (4, 16))
    return placed_program(model, lm_loss, torch.optim.AdamW(model.parameters()),
                          ap.Strategy.from_yaml_str(strategy), ids, ids)


def _path(op) -> str:
    return op.attrs[NAME] if op.kind in (OpKind.INPUT, OpKind.STATE) else op.module


def test_layer_of_reads_the_first_index_of_a_module_path_or_state_name():
    assert layer_of("blocks.3.attn.qkv") == ("blocks", 3, "attn.qkv")
    assert layer_of("model.layers.12.mlp.experts.3.w1") == ("model.layers", 12,
                                                            "mlp.experts.3.w1")
    assert layer_of("blocks.3.fc1.weight/exp_avg") == ("blocks", 3, "fc1.weight/exp_avg")
    assert layer_of("blocks.3") == ("blocks", 3, "")
    assert layer_of("ln_f") is None and layer_of("param_groups/0") is None
    assert layer_of("") is None


def test_a_gpts_blocks_are_one_class_tied_op_by_op_in_every_role():
    program, _ = _gpt_program(4)
    found = repeated_layers(program)
    assert [(c.container, c.indices) for c in found.classes] == [("blocks", (0, 1, 2, 3))]
    per_layer = found.classes[0].ops
    assert len(found.ties) == 3 * per_layer
    one_layer, _ = _gpt_program(1)
    three_layers, _ = _gpt_program(3)
    assert per_layer == (len(three_layers.ops) - len(one_layer.ops)) // 2   # all of a layer
    by_path = {}
    for op, rep in found.ties.items():
        assert op.kind is rep.kind and op.target == rep.target and op.role is rep.role
        if _path(op):
            here, there = layer_of(_path(op)), layer_of(_path(rep))
            assert here[0] == there[0] and here[2] == there[2] and here[1] != there[1]
            by_path[_path(op)] = _path(rep)
    # parameters and optimizer states follow the first layer's
    assert by_path["blocks.2.fc1.weight"] == "blocks.0.fc1.weight"
    assert by_path["blocks.3.attn.qkv.bias/exp_avg_sq"] == "blocks.0.attn.qkv.bias/exp_avg_sq"
    # the backward runs the layers in reverse: its ops follow the last layer's
    reps = {rep for rep in found.ties.values()}
    assert all(layer_of(rep.module)[1] == 3 for rep in reps
               if rep.role is Role.BACKWARD and rep.module)
    assert all(layer_of(_path(rep))[1] == 0 for rep in reps if rep.role is Role.FORWARD
               and _path(rep))
    # the backward's residual gradient sums (captured without a module) joined a layer
    assert sum(1 for op in found.ties if op.kind is OpKind.CALL and not op.module) == 3 * 2


class _Mlp(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, hidden), nn.Linear(d, hidden)
        self.down_proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.mlp = _Mlp(d, hidden)

    def forward(self, x):
        return x + self.mlp(self.input_layernorm(x))


class _Body(nn.Module):
    def __init__(self, vocab: int, d: int, hiddens: list[int]):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_DecoderLayer(d, h) for h in hiddens)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


class _HfLike(nn.Module):
    """Hugging Face's layout: ``model.layers.<i>``, ``lm_head`` outside the body."""

    def __init__(self, hiddens: list[int], vocab: int = 64, d: int = 32):
        super().__init__()
        self.model = _Body(vocab, d, hiddens)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def test_a_layer_of_another_width_is_not_tied_to_its_siblings():
    torch.manual_seed(0)
    model = _HfLike([64, 64, 128, 64])
    ids = torch.randint(0, 64, (4, 8))
    program, _ = placed_program(model, lm_loss, torch.optim.AdamW(model.parameters()),
                                ap.Strategy.from_yaml_str(TP2), ids, ids)
    found = repeated_layers(program)
    assert [(c.container, c.indices) for c in found.classes] == [("model.layers", (0, 1, 3))]
    assert found.untied == [("model.layers", 2)]
    tied_layers = {layer_of(_path(op))[1] for op in found.ties if _path(op)}
    assert tied_layers <= {0, 1, 3} and 2 not in {layer_of(_path(r))[1] for r in
                                                   found.ties.values() if _path(r)}
    assert len(found.ties) == 2 * found.classes[0].ops


def test_tied_and_untied_choose_alike_on_a_2_layer_gpt():
    program, ctx = _gpt_program(2)
    tied = solve_placements(program, ctx.state.mesh, MACHINE)
    free = solve_placements(program, ctx.state.mesh, MACHINE, tie_layers=False)
    assert (tied.tied_ops, tied.layer_classes) == (len(repeated_layers(program).ties), 1)
    assert (free.tied_ops, free.layer_classes) == (0, 0)
    assert tied.variables < free.variables
    assert any(not d.placements[0].is_replicate() for d in tied.params.values())
    assert tied.params == free.params
    assert tied.objective_s == pytest.approx(free.objective_s, rel=1e-9)
    assert tied.state_bytes == pytest.approx(free.state_bytes, rel=1e-12)
    # the same layer twice: every tied op's strategy is its representative's
    for op, rep in repeated_layers(program).ties.items():
        assert tied.strategies[op] == tied.strategies[rep]


def test_the_tied_program_does_not_grow_with_the_depth():
    sizes = {}
    for layers in (2, 4):
        program, ctx = _gpt_program(layers)
        choice = solve_placements(program, ctx.state.mesh, MACHINE)
        sizes[layers] = (choice.variables, choice.constraints)
        per_layer = repeated_layers(program).classes[0].ops
        assert choice.tied_ops == (layers - 1) * per_layer
    assert sizes[4] == sizes[2]


def _slow_network() -> Profile:
    """MACHINE with collectives of 0.1 s: unlimited, nothing is worth sharding."""
    slow = {2: AlphaBeta(alpha_s=0.1, beta_s_per_byte=1e-6)}
    return MACHINE.model_copy(update={"collectives": {k: dict(slow)
                                                      for k in MACHINE.collectives}})


def test_a_memory_limit_counts_every_tied_layers_state():
    program, ctx = _gpt_program(4)
    profile = _slow_network()
    free = solve_placements(program, ctx.state.mesh, profile)
    assert all(d.placements[0].is_replicate() for d in free.params.values())
    limit = 0.75 * free.state_bytes
    tight = solve_placements(program, ctx.state.mesh, profile, memory_limit_bytes=limit)
    untied = solve_placements(program, ctx.state.mesh, profile, memory_limit_bytes=limit,
                              tie_layers=False)
    # the state of all four layers counts, not the tied one's once
    assert tight.tied_ops and tight.state_bytes <= limit
    assert untied.state_bytes <= limit
    assert tight.objective_s >= untied.objective_s * (1 - 1e-9)


def test_a_hugging_face_gpt2_is_solved_once_per_layer_and_reads_back_as_megatron():
    """transformers' GPT-2: ``transformer.h.<i>`` tied; its Conv1D ``c_attn`` (fused qkv,
    weight ``[in, 3 * out]``) gets colwise in groups as a candidate, so the plan is exact."""
    torch.manual_seed(0)
    model = hf_gpt2("sdpa", 64, n_layer=3)
    ids = torch.randint(0, 64, (2, 16))
    program, ctx = placed_program(model, None, torch.optim.AdamW(model.parameters()),
                                  ap.Strategy.from_yaml_str(TP2),
                                  {"input_ids": ids, "labels": ids}, None)
    found = repeated_layers(program)
    assert [(c.container, c.indices) for c in found.classes] == [("transformer.h", (0, 1, 2))]
    tied = solve_placements(program, ctx.state.mesh, MACHINE)
    free = solve_placements(program, ctx.state.mesh, MACHINE, tie_layers=False)
    assert tied.tied_ops == 2 * found.classes[0].ops and tied.variables < free.variables / 2
    assert tied.params == free.params
    assert tied.objective_s == pytest.approx(free.objective_s, rel=1e-9)
    plan, why = tensor_parallel_plan_of(program, tied.params, ctx.state.mesh)
    assert (plan, why) == ({f"transformer.h.{i}.{m}": s for i in range(3) for m, s in (
        ("attn.c_attn", "colwise"), ("attn.c_proj", "rowwise"), ("mlp.c_fc", "colwise"),
        ("mlp.c_proj", "rowwise"))}, "")
    assert tied.params["transformer.h.0.attn.c_attn.weight"].placements[0].grouped


def test_the_tied_choice_committed_as_completion_passes_the_verified_pipeline():
    """Every op of every layer takes its tied strategy; reshard then inserts Megatron's two
    all-reduces per layer forward and two backward, no more."""
    program, ctx = _gpt_program(2)
    choice = solve_placements(program, ctx.state.mesh, MACHINE)

    def complete(program, ctx):
        commit_choice(program, choice, ctx.state.mesh)
        return program

    start = next(i for i, p in enumerate(PIPELINE) if p.name == "completion")
    passes = [replace(PIPELINE[start], run=complete), *PIPELINE[start + 1:]]
    placed = PassManager(passes=passes, verify=True).run(program, ctx)
    reduces = Counter(m.role for m in planned_moves(placed) if m.kind == "all_reduce")
    assert (reduces[Role.FORWARD.value], reduces[Role.BACKWARD.value]) == (2 * 2, 2 * 2)
