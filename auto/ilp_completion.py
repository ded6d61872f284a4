"""Completion by the placement ILP: the pass that places every value and sets every op's
needs from the integer program's solution, in place of the greedy ``completion`` pass.

Pinning only the starts (``apply.pin_placements``) leaves the intermediate ops to the greedy
completion, which need not follow the ILP (on a 1-layer GPT with E=512 it gathered the
logits' shards and a qkv gradient the ILP kept sharded). This pass commits the whole
solution, so reshard inserts exactly the moves the ILP paid for. ``AUTO_PIPELINE`` is the
pass list with it.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import OpKind, Program
from ..ir.attrs import NAME
from ..ir.dist import ProcessMesh
from ..ir.reason import Reason
from ..pass_infra.context import PassContext
from ..passes import PIPELINE
from ..passes.completion import place_outputs
from ..spmd.rule_registry import tensor_inputs
from .placement_ilp import PlacementChoice, solve_placements

__all__ = ["ilp_completion", "commit_choice", "AUTO_PIPELINE"]


def ilp_completion(program: Program, ctx: PassContext) -> Program:
    mesh = ctx.state.mesh
    if mesh is None:
        return program
    limit = ctx.strategy.memory_limit_gb
    choice = solve_placements(program, mesh, memory_limit_bytes=None if limit is None
                              else limit * 2**30)
    commit_choice(program, choice, mesh)
    return program


def commit_choice(program: Program, choice: PlacementChoice, mesh: ProcessMesh) -> None:
    """Place every unplaced tensor value and set every CALL op's needs as ``choice`` says;
    the loss and outputs are needed replicated, updated state where the state lives."""
    why = f"placement ILP ({choice.objective_s * 1e3:.3f} ms predicted)"
    for op in program.ops:
        if op.kind not in (OpKind.INPUT, OpKind.STATE, OpKind.CALL):
            continue
        cand = choice.strategies[op]
        if op.kind is OpKind.CALL:
            op.needs = cand.needs
        for v, dist in zip(op.outputs, cand.outputs):
            if v.is_tensor and v.dist is None and dist is not None:
                v.dist = dist if op.kind is OpKind.CALL else dist.check(v.type.shape)
                v.why = Reason("plan" if op.kind is not OpKind.CALL else "rule",
                               f"{why}: {op.target.removesuffix('.default')}"
                               if op.kind is OpKind.CALL else f"{why}: {op.attrs[NAME]}",
                               op if op.kind is OpKind.CALL else None,
                               tuple(tensor_inputs(op)) if op.kind is OpKind.CALL else ())
    place_outputs(program, mesh)


AUTO_PIPELINE = tuple(replace(p, name="ilp_completion", run=ilp_completion)
                      if p.name == "completion" else p for p in PIPELINE)
