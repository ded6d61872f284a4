"""The divergence locator: where does a parallel plan first stop computing what one device
computes?

One step of a lowered plan (every process lowered) runs on the simulator; next to it, the
planned global program runs on whole tensors, each op reading the whole values of its
inputs (a comm op moves data but changes no value, so it is the identity there). After
every op, each rank's pieces of its results are assembled by their placements and compared
with the whole result, which then continues from the assembled value: each op is judged on
the inputs the ranks gave it, so rounding that differs by reduction order (fp32, and the
few ulps a half-precision result may move) does not pile up into a false report. The first
op beyond the tolerance is reported: the op, its module, the placements in and out, the
communication that fed it and the error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir import Op, OpKind, Value
from ..ir.attrs import COMM_TEXT
from ..ir.dist import assemble, format_placements
from ..ir.printer import value_names
from ..lower.executable import Lowered
from ..runtime.seeding import draw_generator, forked_generator
from ..runtime.simulator import call_op, initial_value, simulate_step

__all__ = ["Divergence", "locate_in_plan", "whole_values"]


@dataclass(frozen=True)
class Divergence:
    op: str                 # the op, as the dump names its first result
    target: str
    module: str
    role: str
    inputs: tuple[str, ...]          # each tensor input: name and placement
    outputs: tuple[str, ...]
    fed_by: tuple[str, ...]          # the communication that moved its inputs
    max_abs: float
    max_rel: float
    mesh: str = ""                   # the mesh the placements are over, e.g. mesh[2,2](dp,tp)

    def __str__(self) -> str:
        lines = [f"first divergence from one device: {self.op} = {self.target} "
                 f"({self.module or 'top level'}, {self.role}): max abs error "
                 f"{self.max_abs:.3g}, max rel {self.max_rel:.3g}",
                 f"  on {self.mesh}" if self.mesh else "",
                 "  inputs:  " + "; ".join(self.inputs),
                 "  outputs: " + "; ".join(self.outputs)]
        lines += [f"  fed by:  {text}" for text in self.fed_by]
        return "\n".join(line for line in lines if line)


class _Stop(Exception):
    def __init__(self, found: Divergence):
        self.found = found


class _Reference:
    """The global program on whole tensors, op by op, beside the simulated ranks."""

    def __init__(self, lowered: Lowered, feeds: dict[str, Any], state: dict[str, Any],
                 rtol: float, atol: float):
        self.lowered, self.feeds, self.state = lowered, feeds, state
        self.rtol, self.atol = rtol, atol
        self.mesh = lowered.mesh
        self.whole: dict[Value, Any] = {}
        self.names = value_names(lowered.program)

    def __call__(self, i: int, op: Op, ops: dict, envs: dict, rng) -> None:
        self._run(op, rng)
        if op.kind is OpKind.CALL:
            self._compare(op, ops, envs)

    def _run(self, op: Op, rng) -> None:
        if op.kind in (OpKind.INPUT, OpKind.STATE):
            whole = initial_value(op, self.feeds, self.state,
                                  next(iter(self.lowered.processes.values())))
            self.whole[op.outputs[0]] = whole.clone() if isinstance(whole, torch.Tensor) \
                else whole
        elif op.kind is OpKind.COMM:       # moves data, changes no value
            if op.target in ("comm.all_reduce_start", "comm.all_gather_start",
                             "comm.reduce_scatter_start"):
                self.whole[op.outputs[0]] = tuple(self.whole[v] for v in op.args)
            elif op.target == "comm.wait":
                for v, x in zip(op.outputs, self.whole[op.args[0]]):
                    self.whole[v] = x
            else:
                self.whole[op.outputs[0]] = self.whole[op.args[0]]
        else:
            saved = draw_generator().get_state()
            if rng is not None:      # draw what the ranks drew, then leave the generator
                draw_generator().set_state(rng)
            for v, x in zip(op.outputs, call_op(op, self.whole)):
                self.whole[v] = x
            draw_generator().set_state(saved)

    def _compare(self, op: Op, ops: dict, envs: dict) -> None:
        if op.target in _UNINITIALIZED:
            return      # memory nobody has written yet: any bits, on any rank
        for k, v in enumerate(op.outputs):
            want = self.whole[v]
            if not v.is_tensor or v.dist is None or not isinstance(want, torch.Tensor):
                continue
            pieces = {c: envs[c][local.outputs[k]] for c, local in ops.items()}
            got = assemble(pieces, v.type.shape, v.dist.mesh, v.dist.placements)
            error = _error(got, want)
            if error is not None and error[0] > self.atol + _rtol(self.rtol, op) * error[1]:
                raise _Stop(self._describe(op, error))
            # later ops are checked on what the ranks computed, so each op answers for its
            # own rounding only, not for the drift of the ops before it
            self.whole[v] = got.to(want.dtype)

    def _describe(self, op: Op, error: tuple[float, float]) -> Divergence:
        names = self.names

        def placed(v: Value) -> str:
            where = format_placements(v.dist.placements) if v.dist is not None else "whole"
            return f"{names.get(v, '?')} {where}"

        fed_by = tuple(f"{names.get(v, '?')} = "
                       f"{v.producer.attrs.get(COMM_TEXT, v.producer.target)}"
                       for v in op.inputs if v.producer is not None
                       and v.producer.kind is OpKind.COMM)
        return Divergence(names.get(op.outputs[0], op.target),
                          op.target.removesuffix(".default"), op.module, op.role.value,
                          tuple(placed(v) for v in op.inputs if v.is_tensor),
                          tuple(placed(v) for v in op.outputs if v.is_tensor), fed_by,
                          error[0], error[0] / max(error[1], 1e-30),
                          next((v.dist.mesh.short() for v in op.outputs
                                if v.is_tensor and v.dist is not None), ""))


# Ops whose results are allocated, not computed (a dropout's ``empty_like`` before
# ``bernoulli_`` fills it): their bits differ between any two runs.
_UNINITIALIZED = frozenset({
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default"})


def _rtol(rtol: float, op: Op) -> float:
    """An op that reads or makes a half-precision tensor may differ from one device's by a
    few of that dtype's ulps (a sum split over ranks rounds its terms to it first; a
    partial half value assembled whole is rounded once more): compare it at that scale."""
    half = [v.type.dtype for v in op.inputs + op.outputs
            if v.is_tensor and v.type.dtype in (torch.bfloat16, torch.float16)]
    if half:
        return max(rtol, 4 * max(torch.finfo(d).eps for d in half))
    return rtol


def _error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float] | None:
    """(max abs error, the largest magnitude expected); None where nothing can differ."""
    if got.shape != want.shape:
        return float("inf"), 1.0
    if want.numel() == 0:
        return None
    if not (want.is_floating_point() or want.is_complex()):
        return None if torch.equal(got, want) else (float("inf"), 1.0)
    return (got.to(want.dtype) - want).abs().max().item(), want.abs().max().item()


def locate_in_plan(lowered: Lowered, feeds: dict[str, Any], state: dict[str, Any],
                      seed: int | None = None, rtol: float = 1e-4,
                      atol: float = 1e-5) -> Divergence | None:
    """The first op of one step of ``lowered`` (every process lowered, no pipeline) whose
    assembled result differs from the single-device value beyond ``atol + rtol * |max|``;
    None when the step matches. ``state`` (whole tensors) is not changed."""
    if lowered.pipeline is not None:
        raise NotImplementedError("the divergence locator runs plans without a pipeline "
                                  "(plan the model on the same mesh without pipeline stages)")
    reference = _Reference(lowered, feeds, state, rtol, atol)
    try:
        with forked_generator(seed):
            simulate_step(lowered, feeds, state, observe=reference)
    except _Stop as stop:
        return stop.found
    return None


def whole_values(lowered: Lowered, feeds: dict[str, Any], state: dict[str, Any],
                 seed: int | None = None) -> dict[Value, Any]:
    """Every value of one step of ``lowered``'s global program on whole tensors (each comm
    op the identity: the one device the plan stands for), random ops drawing in program
    order from the generator seeded ``seed``. ``state`` is not changed. What eager torch is
    compared with (``divergence.eager_reference``)."""
    whole = _Reference(lowered, feeds, state, 0.0, 0.0)
    with forked_generator(seed), torch.no_grad():
        for op in lowered.program.ops:
            if op.kind is OpKind.OUTPUT:
                break
            if op.kind is OpKind.CALL:      # draws in order, as one device would
                whole.whole.update(zip(op.outputs, call_op(op, whole.whole)))
            else:
                whole._run(op, None)
    return whole.whole
