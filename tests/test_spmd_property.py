"""The SPMD property: for each rule, on random meshes and placements, running the local op
(its local form) on the pieces the rule assigns and reassembling each output by the
placement the rule gives it (cat shards, reduce partials) equals the global op.

Ops and their global inputs are real: every op of the joint training programs (forward,
loss, backward, clipping, optimizer) of small models (autopar MLP and GPT, Hugging Face
GPT-2 and Llama), run once by an interpreter that keeps every value (see op_cases.py).
Inputs a rule needs Partial are split into random terms that reduce to the global value,
so linearity claims are tested, not just the trivial "one rank holds it" split.

Two properties per op target: from random input placements (rule.forward), and from
random output hints (rule.reverse, then rule.forward on what it proposes). Failures name
the op, its model and module, the mesh, the placements, the rule's decision and the error.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from op_cases import OpCase, by_target  # noqa: E402

from autopar.ir import Value  # noqa: E402
from autopar.ir.dist import (DistAttr, Partial, Placement, ProcessMesh, Replicate, Shard,  # noqa: E402
                             assemble, format_placements, shard_tensor_local)
from autopar.spmd import lookup  # noqa: E402
from autopar.spmd.local_forms import LocalContext, local_call, run_local  # noqa: E402
from autopar.spmd.registry import tensor_inputs  # noqa: E402

CASES: dict[str, list[OpCase]] = by_target()
MODEL_TARGETS = sorted(t for t, cs in CASES.items() if any(c.model != "synthetic" for c in cs))
EXAMPLES = int(os.environ.get("AUTOPAR_PROPERTY_EXAMPLES", "12"))
RTOL = ATOL = 1e-5

# Outputs whose values are unspecified: only shape and dtype are compared.
UNINITIALIZED = {"aten.empty_like.default", "aten.empty.memory_format", "aten.new_empty.default",
                 "aten.empty_strided.default", "aten.new_empty_strided.default"}

# Skipped on purpose, with the reason (targets here are not run by the property tests).
SKIPPED: dict[str, str] = {}

# Shrinking is off by default (a failing optimizer op shrinks for half a minute); the
# failure message carries the whole case anyway. AUTOPAR_PROPERTY_SHRINK=1 turns it on.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("AUTOPAR_PROPERTY_SHRINK") == "1" else [])
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    phases=PHASES, suppress_health_check=list(HealthCheck))

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


def _placement_options(dtype: torch.dtype, rank: int) -> list[Placement]:
    options: list[Placement] = [Replicate(), Replicate()]
    options += [Shard(d) for d in range(rank)] * (3 if rank == 1 else 2 if rank == 2 else 1)
    if dtype != torch.bool:
        options += [Partial("sum")]
        options += [Partial("max"), Partial("min")]
        if dtype.is_floating_point:
            options += [Partial("avg")]
    return options


@st.composite
def dists(draw, mesh: ProcessMesh, value: Value) -> DistAttr | None:
    """None (not placed yet) or one placement per mesh dim."""
    if draw(st.integers(0, 5)) == 0:
        return None
    options = _placement_options(value.type.dtype, len(value.type.shape))
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


def _terms(value: torch.Tensor, dist: DistAttr, gen: torch.Generator) -> dict[tuple, torch.Tensor]:
    """Full-size terms keyed by the coordinates along the Partial mesh dims. Split top-down
    in mesh-dim order, as assemble reduces innermost (last) mesh dims first."""
    terms = {(): value}
    for m, p in enumerate(dist.placements):
        if isinstance(p, Partial):
            terms = {key + (i,): part for key, v in terms.items()
                     for i, part in enumerate(_split_one(v, p.op, dist.mesh.shape[m], gen))}
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
    if len(op.outputs) > 1 or op.attrs.get("_multi"):
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
    op = case.op
    rule = lookup(op)
    ins = tensor_inputs(op)
    head = (f"{origin}: {case.describe()}\n  mesh {mesh}\n  input placements "
            f"{[_fmt(d) for d in in_dists]}")
    try:
        decision = rule.forward(op, in_dists, mesh)
    except Exception as exc:   # a rule must decide any valid placement
        raise AssertionError(f"{head}\n  rule.forward raised {type(exc).__name__}: {exc}") from exc
    head += f"\n  needs {[_fmt(d) for d in decision.needs]}\n  outputs " \
            f"{[_fmt(d) for d in decision.outputs]}"
    assert len(decision.needs) == len(ins), f"{head}\n  {len(decision.needs)} needs for " \
                                            f"{len(ins)} tensor inputs"
    assert len(decision.outputs) == len(op.outputs), f"{head}\n  wrong number of outputs"
    for v, d in zip(ins, decision.needs):
        assert isinstance(d, DistAttr) and d.mesh == mesh, f"{head}\n  a need is not on the mesh"
        d.check(v.type.shape)
    for v, d in zip(op.outputs, decision.outputs):
        assert (d is None) != v.is_tensor, f"{head}\n  output placement {d} for {v.type}"
        if d is not None:
            d.check(v.type.shape)

    gen = torch.Generator().manual_seed(seed)
    pieces = local_inputs(case, mesh, decision.needs, gen)
    fresh_op, fresh = _fresh_op(op)
    per_rank: dict[tuple, list[Any]] = {}
    call = None
    for coord in mesh.coordinates():
        ctx = LocalContext(mesh, coord, tuple(decision.needs), tuple(decision.outputs))
        try:
            call = local_call(fresh_op, ctx)
            if case.rng_state is not None:
                torch.default_generator.set_state(case.rng_state)
            result = run_local(fresh_op, ctx, dict(zip(fresh, pieces[coord])))
        except Exception as exc:
            raise AssertionError(f"{head}\n  local call at {coord} raised "
                                 f"{type(exc).__name__}: {exc}") from exc
        per_rank[coord] = _outputs_of(op, result)
    if call is not None and call.target != op.target:
        head += f"\n  local form: {call.target} ({call.note})"

    for o, (v, d) in enumerate(zip(op.outputs, decision.outputs)):
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
        pytest.skip(f"no SPMD rule for {target} (listed by test_every_op_has_a_rule)")
    return rule


# ----------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", sorted(CASES))
def test_forward_property(target):
    _rule_or_skip(target)
    cases = CASES[target]

    @SETTINGS
    @given(data=st.data())
    def run(data):
        case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
        mesh = data.draw(meshes(), label="mesh")
        in_dists = [data.draw(dists(mesh, v), label=f"input {i}")
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

    @SETTINGS
    @given(data=st.data())
    def run(data):
        case = cases[data.draw(st.integers(0, len(cases) - 1), label="case")]
        mesh = data.draw(meshes(), label="mesh")
        hints = [data.draw(dists(mesh, v), label=f"hint {i}") if v.is_tensor else None
                 for i, v in enumerate(case.op.outputs)]
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
