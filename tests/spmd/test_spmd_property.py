"""The SPMD property: for each rule, on random meshes and placements, running the local op
(its local form, spmd/local_forms/) on the pieces the rule assigns and reassembling each
output by the placement the rule gives it (cat shards, reduce partials) equals the global op.

Ops and their global inputs are real: every op of the joint training programs (forward,
loss, backward, clipping, Adam) of small models (autopar MLP and GPT, models_zoo, Hugging
Face GPT-2 and Llama), run once by an interpreter that keeps every value (op_cases.py).
Inputs a rule needs Partial are split into random terms that reduce to the global value,
so linearity claims are tested, not just the trivial "one rank holds it" split. Random ops
run from the generator state they had in the program, on every rank.

Two properties per op target: from random input placements (rule.forward), and from
random output hints (rule.reverse, then rule.forward on what it proposes). Failures name
the op, its model and module, the mesh, the placements, the rule's decision and the error.
``test_local_form`` checks each local form on hand-picked placements, whatever the rules say.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from op_cases import OpCase, by_target, synthetic  # noqa: E402

from autopar.ir import Value  # noqa: E402
from autopar.ir.attrs import MULTI
from autopar.ir.dist import (  # noqa: E402
    DistAttr,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    assemble,
    format_placements,
    norm_order,
    norm_partial,
    parse_placements,
    shard_tensor_local,
)
from autopar.spmd import lookup  # noqa: E402
from autopar.spmd.local_forms import LocalContext, local_call, run_local  # noqa: E402
from autopar.spmd.rule_registry import tensor_inputs  # noqa: E402

CASES: dict[str, list[OpCase]] = by_target()
MODEL_TARGETS = sorted(t for t, cs in CASES.items() if any(c.model != "synthetic" for c in cs))
RTOL = ATOL = 1e-5     # relative to the largest magnitude of the expected output

# Outputs whose values are unspecified: only shape and dtype are compared.
UNINITIALIZED = {"aten.empty_like.default", "aten.empty.memory_format", "aten.new_empty.default",
                 "aten.empty_strided.default", "aten.new_empty_strided.default"}

# Targets the property tests do not run, with the reason. Empty: optimizer and random ops
# run (random ops from their recorded generator state).
SKIPPED: dict[str, str] = {}

# Examples per target grow with its number of distinct cases; AUTOPAR_PROPERTY_SCALE
# scales them (10 for a long hunt: about 3 minutes). Shrinking is off by default (a failing
# optimizer op shrinks for half a minute and the message names the whole case anyway);
# AUTOPAR_PROPERTY_SHRINK=1 turns it on.
SCALE = float(os.environ.get("AUTOPAR_PROPERTY_SCALE", "1"))
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("AUTOPAR_PROPERTY_SHRINK") == "1" else [])


def examples(target: str) -> int:
    return max(1, int(SCALE * min(30, max(8, 2 * len(CASES[target])))))


def settings_for(target: str) -> settings:
    return settings(max_examples=examples(target), deadline=None, derandomize=True,
                    database=None, phases=PHASES, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------
MESH_SHAPES = [(2,), (3,), (4,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (2, 2), (2, 3),
               (3, 2), (2, 2, 2)]
DIM_NAMES = ["dp", "tp", "sp", "pp", "x", "y"]


@st.composite
def meshes(draw) -> ProcessMesh:
    shape = draw(st.sampled_from(MESH_SHAPES))
    names = draw(st.permutations(DIM_NAMES))[:len(shape)]
    ids = draw(st.permutations(range(math.prod(shape))))
    return ProcessMesh(torch.tensor(ids).reshape(shape).tolist(), dim_names=names)


NORMS = [Partial(norm_partial(p)) for p in (2, 1, math.inf)]


def _placement_options(dtype: torch.dtype, rank: int, norms: bool = False) -> list[Placement]:
    options: list[Placement] = [Replicate(), Replicate()]
    options += [Shard(d) for d in range(rank)] * (3 if rank == 1 else 2 if rank == 2 else 1)
    if dtype != torch.bool:
        options += [Partial("sum")]
        options += [Partial("max"), Partial("min")]
        if dtype.is_floating_point:
            options += [Partial("avg")]
            # a norm partial's value is a norm: only a value that is never negative has one
            options += NORMS * 2 if norms else []
    return options


def _nonnegative(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and bool((x >= 0).all())


@st.composite
def dists(draw, mesh: ProcessMesh, value: Value, like: Any = None) -> DistAttr | None:
    """None (not placed yet) or one placement per mesh dim (norm partials where ``like``,
    the value's global tensor, is never negative)."""
    if draw(st.integers(0, 5)) == 0:
        return None
    options = _placement_options(value.type.dtype, len(value.type.shape), _nonnegative(like))
    return DistAttr(mesh, tuple(draw(st.sampled_from(options)) for _ in range(mesh.ndim)))


# ----------------------------------------------------------------------------------------
# building local inputs
# ----------------------------------------------------------------------------------------
# Values this large (HF masks use finfo.min) or not finite are not perturbed: a random
# split would overflow. Every term holds them as they are (sum: the first term only).
HUGE = 1e30


def _split_one(v: torch.Tensor, op: str, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n terms whose ``op``-reduction is ``v`` (random, each elementwise different)."""
    if v.dtype == torch.bool:
        return [v.clone()] + [torch.zeros_like(v) if op == "sum" else v.clone()
                              for _ in range(n - 1)]
    if op in ("sum", "avg"):
        if v.is_floating_point():
            tame = torch.isfinite(v) & (v.abs() < HUGE)
            deltas = [torch.where(tame, v * (torch.rand(v.shape, generator=gen) * 2 - 1)
                                  .to(v.dtype), torch.zeros_like(v)) for _ in range(n - 1)]
        else:
            deltas = [torch.randint(-3, 4, v.shape, generator=gen).to(v.dtype)
                      for _ in range(n - 1)]
        if op == "avg":   # v + d_k with the d_k summing to zero
            rest = -sum(deltas) if deltas else torch.zeros_like(v)
            return [v + d for d in deltas] + [v + rest]
        first = v - sum(deltas) if deltas else v
        if v.is_floating_point():
            first = torch.where(tame, first, v)
        return [first] + deltas
    owner = torch.randint(0, n, v.shape, generator=gen)
    sign = -1 if op == "max" else 1
    terms = []
    for k in range(n):
        if v.is_floating_point():
            noise = torch.rand(v.shape, generator=gen).to(v.dtype) * (v.abs() + 1)
            noise = torch.where(torch.isfinite(v) & (v.abs() < HUGE), noise,
                                torch.zeros_like(noise))
        else:
            noise = torch.randint(1, 4, v.shape, generator=gen).to(v.dtype)
        terms.append(torch.where(owner == k, v, v + sign * noise))
    return terms


def _nonnegative_terms(v: torch.Tensor, op: str, n: int, gen: torch.Generator
                       ) -> list[torch.Tensor]:
    """n non-negative terms whose ``op``-reduction is ``|v|``: the terms of a value with a
    norm partial, whose nested terms are norms and so never negative."""
    magnitude = v.abs()
    order = norm_order(op)
    if op in ("max", "min") or (order is not None and math.isinf(order)):
        owner = torch.randint(0, n, v.shape, generator=gen)
        scale = torch.rand(v.shape, generator=gen).to(v.dtype) + (1 if op == "min" else 0)
        return [torch.where(owner == k, magnitude, magnitude * scale) for k in range(n)]
    weights = torch.rand((n, *v.shape), generator=gen).to(v.dtype) + 0.1
    total = weights.sum(0) if order is None else torch.linalg.vector_norm(weights, order, dim=0)
    weights = weights / total * (n if op == "avg" else 1)
    return [w * magnitude for w in weights]


def _terms(value: torch.Tensor, dist: DistAttr, gen: torch.Generator) -> dict[tuple, torch.Tensor]:
    """Full-size terms keyed by the coordinates along the Partial mesh dims. Split top-down
    in mesh-dim order, as assemble reduces innermost (last) mesh dims first."""
    terms = {(): value}
    norms = any(isinstance(p, Partial) and norm_order(p.op) for p in dist.placements)
    split = _nonnegative_terms if norms else _split_one
    for m, p in enumerate(dist.placements):
        if isinstance(p, Partial):
            terms = {key + (i,): part for key, v in terms.items()
                     for i, part in enumerate(split(v, p.op, dist.mesh.shape[m], gen))}
    return terms


def _like_layout(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` with its dims laid out in memory in the order of ``like``'s."""
    if like.dim() < 2 or like.is_contiguous():
        return local
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))
    return local.permute(order).contiguous().permute([order.index(d) for d in range(like.dim())])


def local_inputs(case: OpCase, mesh: ProcessMesh, needs: tuple[DistAttr, ...],
                 gen: torch.Generator) -> dict[tuple, list[Any]]:
    """coordinate -> the rank's runtime value for each op.inputs entry."""
    per_tensor = []
    k = 0
    for v, x in zip(case.op.inputs, case.inputs):
        if not v.is_tensor:
            per_tensor.append(None)
            continue
        need = needs[k]
        k += 1
        whole = DistAttr(need.mesh, tuple(Replicate() if isinstance(p, Partial) else p
                                          for p in need.placements))
        partial_dims = [m for m, p in enumerate(need.placements) if isinstance(p, Partial)]
        per_tensor.append((need, whole, partial_dims, _terms(x, need, gen)))
    result = {}
    for coord in mesh.coordinates():
        row = []
        for x, info in zip(case.inputs, per_tensor):
            if info is None:
                row.append(x)
                continue
            need, whole, partial_dims, terms = info
            term = terms[tuple(coord[m] for m in partial_dims)]
            piece = shard_tensor_local(term, need.mesh, whole.placements, coord)
            row.append(_like_layout(piece, x))
        result[coord] = row
    return result


# ----------------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------------
def _fmt(d: DistAttr | None) -> str:
    return "None" if d is None else format_placements(d.placements)


def _fresh_op(op):
    """A copy of ``op`` whose every input position holds its own Value (what reshard makes
    of an input used twice with two needs), and those Values in op.inputs order."""
    from torch.utils import _pytree as pytree
    fresh: list[Value] = []

    def swap(a):
        if isinstance(a, Value):
            new = Value(a.type)
            fresh.append(new)
            return new
        return a

    args, kwargs = pytree.tree_map(swap, (op.args, op.kwargs))
    copy = type(op)(op.kind, op.target, args, kwargs, op.outputs, op.role, op.module,
                    op.forward_op, dict(op.attrs))
    return copy, fresh


def _outputs_of(op, result) -> list[Any]:
    if len(op.outputs) > 1 or op.attrs.get(MULTI):
        return list(result)
    return [result]


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if not want.is_floating_point():
        bad = (got != want)
        return None if not bad.any() else f"{int(bad.sum())} of {want.numel()} elements differ"
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        return "NaNs in different places"
    # finfo.min stands for -inf in masks (Hugging Face): compare such values as infinities,
    # a Partial(avg) of them may overflow to -inf and still mean the same.
    got = torch.where(got.abs() >= HUGE, got.sign() * math.inf, got)
    want = torch.where(want.abs() >= HUGE, want.sign() * math.inf, want)
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
        return "infinities differ"
    finite = ~(nan_w | inf_w)
    if not finite.any():
        return None
    g, w = got[finite].double(), want[finite].double()
    err = (g - w).abs().max().item()
    scale = w.abs().max().item()
    if err > ATOL + RTOL * scale:
        return f"max abs error {err:.3g} (max |expected| {scale:.3g})"
    return None


def check(case: OpCase, mesh: ProcessMesh, in_dists: list[DistAttr | None], seed: int,
          origin: str) -> None:
    """The property for the rule's decision on ``in_dists``."""
    head = (f"{origin}: {case.describe()}\n  mesh {mesh}\n  input placements "
            f"{[_fmt(d) for d in in_dists]}")
    try:
        decision = lookup(case.op).forward(case.op, in_dists, mesh)
    except Exception as exc:   # a rule must decide any valid placement
        raise AssertionError(f"{head}\n  rule.forward raised {type(exc).__name__}: {exc}") from exc
    check_decision(case, mesh, tuple(decision.needs), tuple(decision.outputs), seed, head)


def check_decision(case: OpCase, mesh: ProcessMesh, needs: tuple, outputs: tuple, seed: int,
                   head: str) -> None:
    """Run the local form of ``case.op`` on every rank's pieces of its inputs placed as
    ``needs``; each output reassembled by its placement in ``outputs`` must be the global
    output."""
    op = case.op
    ins = tensor_inputs(op)
    head += f"\n  needs {[_fmt(d) for d in needs]}\n  outputs {[_fmt(d) for d in outputs]}"
    assert len(needs) == len(ins), f"{head}\n  {len(needs)} needs for {len(ins)} tensor inputs"
    assert len(outputs) == len(op.outputs), f"{head}\n  wrong number of outputs"
    for v, d in zip(ins, needs):
        assert isinstance(d, DistAttr) and d.mesh == mesh, f"{head}\n  a need is not on the mesh"
        d.check(v.type.shape)
    for v, d in zip(op.outputs, outputs):
        assert (d is None) != v.is_tensor, f"{head}\n  output placement {d} for {v.type}"
        if d is not None:
            d.check(v.type.shape)

    gen = torch.Generator().manual_seed(seed)
    pieces = local_inputs(case, mesh, needs, gen)
    fresh_op, fresh = _fresh_op(op)
    per_rank: dict[tuple, list[Any]] = {}
    call = None
    saved = torch.default_generator.get_state()
    try:
        for coord in mesh.coordinates():
            ctx = LocalContext(mesh, coord, needs, outputs)
            try:
                call = local_call(fresh_op, ctx)
                if case.rng_state is not None:
                    torch.default_generator.set_state(case.rng_state)
                result = run_local(fresh_op, ctx, dict(zip(fresh, pieces[coord])))
            except Exception as exc:
                raise AssertionError(f"{head}\n  local call at {coord} raised "
                                     f"{type(exc).__name__}: {exc}") from exc
            per_rank[coord] = _outputs_of(op, result)
    finally:
        torch.default_generator.set_state(saved)
    if call is not None and call.target != op.target:
        head += f"\n  local form: {call.target} ({call.note})"

    for o, (v, d) in enumerate(zip(op.outputs, outputs)):
        if d is None:
            continue
        want = case.outputs[o]
        try:
            got = assemble({c: outs[o] for c, outs in per_rank.items()}, v.type.shape, mesh,
                           d.placements)
        except Exception as exc:
            raise AssertionError(f"{head}\n  output {o}: assemble failed: {exc}") from exc
        if op.target in UNINITIALIZED:
            got, want = torch.zeros_like(got), torch.zeros_like(want)
        problem = _mismatch(got, want)
        assert problem is None, f"{head}\n  output {o} ({v.type}): {problem}"


def _rule_or_skip(target: str):
    if target in SKIPPED:
        pytest.skip(SKIPPED[target])
    rule = lookup(CASES[target][0].op)
    if rule is None:
        where = "a model op: test_every_op_has_a_rule fails" if target in MODEL_TARGETS \
            else "only a synthetic local-form case uses it"
        pytest.skip(f"no SPMD rule for {target} ({where})")
    return rule


# ----------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", sorted(CASES))
def test_forward_property(target):
    _rule_or_skip(target)
    cases = CASES[target]

    @settings_for(target)
    @given(data=st.data())
    def run(data):
        case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
        mesh = data.draw(meshes(), label="mesh")
        given = dict(zip(case.op.inputs, case.inputs))
        in_dists = [data.draw(dists(mesh, v, given.get(v)), label=f"input {i}")
                    for i, v in enumerate(tensor_inputs(case.op))]
        check(case, mesh, in_dists, data.draw(st.integers(0, 2**31 - 1), label="seed"),
              "forward")

    run()


@pytest.mark.parametrize("target", sorted(CASES))
def test_reverse_property(target):
    rule = _rule_or_skip(target)
    cases = [c for c in CASES[target] if any(v.is_tensor for v in tensor_inputs(c.op))]
    if not cases:
        pytest.skip(f"{target} has no tensor inputs: nothing to infer backwards")

    @settings_for(target)
    @given(data=st.data())
    def run(data):
        case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
        mesh = data.draw(meshes(), label="mesh")
        hints = [data.draw(dists(mesh, v, x), label=f"hint {i}") if v.is_tensor else None
                 for i, (v, x) in enumerate(zip(case.op.outputs, case.outputs))]
        try:
            wanted = rule.reverse(case.op, hints, mesh)
        except Exception as exc:
            raise AssertionError(f"reverse: {case.describe()}\n  mesh {mesh}\n  hints "
                                 f"{[_fmt(h) for h in hints]}\n  rule.reverse raised "
                                 f"{type(exc).__name__}: {exc}") from exc
        assert len(wanted) == len(tensor_inputs(case.op)), \
            f"reverse: {case.describe()}: {len(wanted)} input placements"
        check(case, mesh, list(wanted), data.draw(st.integers(0, 2**31 - 1), label="seed"),
              f"reverse from hints {[_fmt(h) for h in hints]}")

    run()


def test_every_op_has_a_rule():
    """Every op the models' training programs contain has an SPMD rule."""
    missing = sorted(t for t in MODEL_TARGETS if lookup(CASES[t][0].op) is None)
    assert not missing, f"ops without an SPMD rule: {missing}"


def test_collection_covers_the_models():
    """The harness really sees forward, backward and optimizer ops, random ops included."""
    roles = {c.op.role.value for cs in CASES.values() for c in cs}
    assert {"fwd", "bwd", "opt"} <= roles
    assert "optim.adam" in CASES and "aten.bernoulli_.float" in CASES
    assert "aten.embedding_dense_backward.default" in CASES


# ----------------------------------------------------------------------------------------
# the local forms on their own: hand-picked placements that need them, whatever the rules
# decide (uneven shards and nested mesh dims on purpose)
# ----------------------------------------------------------------------------------------
def _case(target: str, model: str | None = None, where=lambda case: True) -> OpCase:
    found = [c for c in CASES.get(target, []) if (model is None or c.model == model)
             and where(c)]
    assert found, f"no collected case of {target} (model {model})"
    return found[0]


def _syn(target: str, *args, **kwargs) -> Callable[[], OpCase]:
    return lambda: synthetic(target, *args, **kwargs)


def _real(target: str, model: str | None = None, where=lambda case: True) -> Callable[[], OpCase]:
    return lambda: _case(target, model, where)


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


_IDS = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(3))

# (id, case, mesh shape, needs, outputs) -- placements as text, one string per tensor
LOCAL_FORM_CASES = [
    ("view", _syn("aten.view.default", _x(4, 6, 5), [24, 5]), (2,), ["S(0)"], ["S(0)"]),
    ("view-nested", _syn("aten.view.default", _x(4, 6, 5), [4, 30]), (2, 3),
     ["S(0),S(1)"], ["S(0),S(1)"]),
    ("unsafe_view", _syn("aten._unsafe_view.default", _x(6, 4), [3, 2, 4]), (3,), ["S(0)"],
     ["S(0)"]),
    ("reshape-partial", _syn("aten.view.default", _x(6, 4), [24]), (2,), ["P(sum)"],
     ["P(sum)"]),
    ("reshape-alias", _syn("aten._reshape_alias.default", _x(4, 6), [4, 2, 3], [6, 3, 1]),
     (2,), ["S(0)"], ["S(0)"]),
    ("reshape", _syn("aten.reshape.default", _x(6, 4), [6, 2, 2]), (3,), ["S(0)"], ["S(0)"]),
    ("expand-minus-one", _syn("aten.expand.default", _x(3, 1), [-1, 5]), (2,), ["S(0)"],
     ["S(0)"]),
    ("new-full", _syn("aten.new_full.default", _x(2), [5, 3], 1.5), (3,), ["R"], ["S(0)"]),
    ("new-ones", _syn("aten.new_ones.default", _x(2), [5, 3]), (2,), ["R"], ["S(1)"]),
    ("select-backward", _syn("aten.select_backward.default", _x(4, 5), [4, 3, 5], 1, 2),
     (3,), ["S(0)"], ["S(0)"]),
    ("expand", _syn("aten.expand.default", _x(3, 1, 4), [3, 5, 4]), (2, 2), ["S(0),S(2)"],
     ["S(0),S(2)"]),
    ("new_zeros", _syn("aten.new_zeros.default", _x(2, 2), [5, 7]), (2, 2), ["R,R"],
     ["S(1),S(0)"]),
    ("zeros", _syn("aten.zeros.default", [7, 3]), (3,), [], ["S(0)"]),
    ("empty", _syn("aten.empty.memory_format", [5, 2]), (2, 2), [], ["S(0),S(1)"]),
    ("ones", _real("aten.ones.default"), (2, 3), [], ["S(1),S(0)"]),
    ("full", _real("aten.full.default"), (4,), [], ["S(0)"]),
    ("arange", _real("aten.arange.default"), (3,), [], ["S(0)"]),
    ("arange-step-nested", _real("aten.arange.start_step"), (2, 2), [], ["S(0),S(0)"]),
    ("arange-float", _real("aten.arange.start"), (4,), [], ["S(0)"]),
    ("tril", _real("aten.tril.default", "gpt"), (2, 3), ["S(0),S(1)"], ["S(0),S(1)"]),
    ("tril-batched", _real("aten.tril.default", "synthetic"), (2, 2), ["S(2),S(1)"],
     ["S(2),S(1)"]),
    ("triu", _real("aten.triu.default"), (3, 2), ["S(1),S(0)"], ["S(1),S(0)"]),
    ("mean-dim-sum", _syn("aten.mean.dim", _x(6, 5, 4), [0, 2], True), (4,), ["S(0)"],
     ["P(sum)"]),
    ("mean-dim-avg-uneven", _syn("aten.mean.dim", _x(6, 5, 4), [0]), (4,), ["S(0)"],
     ["P(avg)"]),
    ("mean-dim-mixed", _syn("aten.mean.dim", _x(6, 5, 4), [0, 2]), (2, 3),
     ["S(0),S(2)"], ["P(sum),P(avg)"]),
    ("mean-dim-kept", _syn("aten.mean.dim", _x(6, 5, 4), [-1], True), (2,), ["S(1)"],
     ["S(1)"]),
    ("mean-dim-rmsnorm", _real("aten.mean.dim", "hf-llama-eager"), (3,), ["S(2)"],
     ["P(sum)"]),
    ("mean-all", _syn("aten.mean.default", _x(6, 5)), (2, 3), ["S(1),S(0)"],
     ["P(sum),P(sum)"]),
    ("mse-loss-sum", _real("aten.mse_loss.default"), (2,), ["S(0)", "S(0)"], ["P(sum)"]),
    ("mse-loss-avg", _real("aten.mse_loss.default"), (2,), ["S(0)", "S(0)"], ["P(avg)"]),
    ("mse-loss-backward", _real("aten.mse_loss_backward.default", "mlp"), (2, 2),
     ["R,R", "S(0),S(1)", "S(0),S(1)"], ["S(0),S(1)"]),
    ("embedding-vocab", _real("aten.embedding.default", "gpt",
                              lambda c: c.op.args[0].type.shape[0] == 30), (4,),
     ["S(0)", "R"], ["P(sum)"]),
    ("embedding-vocab-nested", _syn("aten.embedding.default", _x(11, 4), _IDS), (2, 3),
     ["S(0),S(0)", "R,R"], ["P(sum),P(sum)"]),
    ("embedding-vocab-and-batch", _syn("aten.embedding.default", _x(11, 4), _IDS), (2, 2),
     ["S(0),R", "R,S(0)"], ["P(sum),S(0)"]),
    ("embedding-backward-vocab", _syn("aten.embedding_dense_backward.default", _x(3, 5, 4),
                                      _IDS, 11, 2, True), (4,), ["R", "R"], ["S(0)"]),
    ("embedding-backward-vocab-batch", _syn("aten.embedding_dense_backward.default",
                                            _x(3, 5, 4), _IDS, 11, -1, False), (2, 3),
     ["S(0),R", "S(0),R"], ["P(sum),S(0)"]),
    ("embedding-backward-model", _real("aten.embedding_dense_backward.default", "gpt",
                                       lambda c: c.op.outputs[0].type.shape[0] == 30), (3,),
     ["R", "R"], ["S(0)"]),
    ("bernoulli", _real("aten.bernoulli_.float", "gpt"), (2, 3), ["S(0),S(3)"],
     ["S(0),S(3)"]),
    ("bernoulli-nested", _real("aten.bernoulli_.float"), (2, 2),
     ["S(1),S(1)"], ["S(1),S(1)"]),
    ("native-dropout", _real("aten.native_dropout.default"), (3,), ["S(0)"],
     ["S(0)", "S(0)"]),
    ("rand-like", _real("aten.rand_like.default"), (2, 2), ["S(1),S(2)"], ["S(1),S(2)"]),
    ("randn", _real("aten.randn.default"), (3,), [], ["S(0)"]),
    ("slice-backward", _real("aten.slice_backward.default"), (3,),
     ["S(0)"], ["S(0)"]),
    ("flash-empty-heads", _real("aten._scaled_dot_product_flash_attention_for_cpu.default",
                                "gpt-sdpa-nodrop"), (3,), ["S(1)"] * 3, ["S(1)", "S(1)"]),
    ("flash-backward-empty-heads",
     _real("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
           "gpt-sdpa-nodrop"), (4,), ["S(1)"] * 6, ["S(1)"] * 3),
    ("max-norm-empty-piece", _syn("aten.linalg_vector_norm.default", _x(3, 4), math.inf),
     (4,), ["S(0)"], ["P(norminf)"]),
    ("max-norm-empty-piece-nested", _syn("aten.linalg_vector_norm.default", _x(5, 2),
                                         math.inf, [0], True), (2, 3), ["S(0),S(0)"],
     ["P(norminf),P(norminf)"]),
]


@pytest.mark.parametrize("make,shape,needs,outputs", [c[1:] for c in LOCAL_FORM_CASES],
                         ids=[c[0] for c in LOCAL_FORM_CASES])
def test_local_form(make, shape, needs, outputs):
    case = make()
    mesh = ProcessMesh(torch.arange(math.prod(shape)).reshape(shape).tolist())
    to_dist = lambda t: DistAttr(mesh, parse_placements(t))  # noqa: E731
    outs = tuple(to_dist(t) for t in outputs) + (None,) * (len(case.op.outputs) - len(outputs))
    check_decision(case, mesh, tuple(to_dist(t) for t in needs), outs, seed=0,
                   head=f"local form: {case.describe()}\n  mesh {mesh}")


def test_random_op_without_local_form_refuses_sharded_output():
    from autopar.spmd.local_forms import UnsupportedLocalForm
    # bernoulli.default draws with the probabilities of its input: no global draw of the
    # whole tensor can be made from a piece of them
    case = synthetic("aten.bernoulli.default", torch.rand(4, 2))
    mesh = ProcessMesh([0, 1])
    ctx = LocalContext(mesh, (0,), (DistAttr(mesh, (Shard(0),)),),
                       (DistAttr(mesh, (Shard(0),)),))
    with pytest.raises(UnsupportedLocalForm, match="bernoulli"):
        local_call(case.op, ctx)
