"""Loss scaling (``amp.loss_scale``), its first half: the backward is seeded with the loss
scale, so every gradient comes out scaled (small float16 gradients do not flush to zero),
and each gradient is unscaled before clipping and the optimizer, with a flag saying whether
any of them held an inf or nan.

The math is ``torch.amp.GradScaler``'s, so an fp32 run equals eager GradScaler to the bit:

* ``scaler.scale(loss).backward()`` seeds the loss's own backward with the gradient of
  ``loss * scale``: the scale itself. Here the backward's seed (the ``ones_like`` of the loss
  that ``torch.autograd.grad`` makes) is replaced by the scale state, cast to the loss dtype
  as autograd would. The loss result stays the true loss.
* ``scaler.unscale_`` multiplies each gradient by ``1 / scale`` computed in double and
  rounded to float, after checking the scaled values for inf/nan
  (``torch._amp_foreach_non_finite_check_and_unscale_``).

Check and unscale read each gradient once: ``autopar.unscale_checked(g, inv_scale)`` gives
``g * inv_scale`` and whether ``g`` holds an inf or nan (GradScaler's own kernel on a copy,
``ir/kernels/amp.py``), and the per-gradient flags are stacked and their max taken (traced
as ATen ops). A gradient sharded
over a mesh axis (tensor parallel, ZeRO-2) checks its piece, which makes its flag
``Partial(max)`` (``spmd/rules/reduction.py``): one all-reduce of the combined flag settles
every rank's. Under plain data parallelism the gradients are all-reduced anyway (an inf or
nan on any rank reaches every rank's sum), so the flag needs none.

The scaler's state starts as ``GradScaler`` makes it: the scale state (``amp/loss_scale``)
declares its start (``init_scale``, or the static scale) as the state's fill, so nothing
outside the passes makes it. The program reports, for the engine's history,
``report[loss_scale]`` (the scale this step's gradients were scaled by) and
``report[skipped]`` (whether an inf or nan skips the update), and hands
``scaler[found_inf]`` (0. or 1., float32 like GradScaler's) to ``skip_nonfinite_steps``.
The unscale reads the gradient values the backward makes, so gradient merge
(``passes/merge_gradients.py``) composes as GradScaler does with accumulation: its
accumulate-only program is only seeded with the scale and sums scaled gradients; its apply
program checks and unscales the sum (the scale stays the same through a cycle: it only
moves with an optimizer step).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir import Op, OpKind, Program, Role, Slot, StateKey, TensorType, Value, state_op
from ..ir.attrs import Attr
from ..ir.from_fx import append_graph
from ..pass_infra.context import PassContext
from ..strategy.sections import AmpConfig

__all__ = ["LOSS_SCALING", "LOSS_SCALE", "GROWTH_TRACKER", "FOUND_INF", "SCALE_USED", "SKIPPED",
           "declare_scaler_state", "scales_loss", "scale_loss", "ScaleLossError"]

LOSS_SCALING: Attr[str] = Attr("loss_scaling", str, "what an op does for loss scaling "
                               "(passes/scale_loss.py, passes/skip_nonfinite_steps.py)",
                               shown=True)
# the scaler's state, as GradScaler keeps it (``_scale``, ``_growth_tracker``)
LOSS_SCALE, GROWTH_TRACKER = StateKey.scaler("loss_scale"), StateKey.scaler("growth_tracker")
FOUND_INF = Slot("scaler", "found_inf")
SCALE_USED, SKIPPED = Slot("report", "loss_scale"), Slot("report", "skipped")

_SEED = "aten.ones_like.default"


class ScaleLossError(RuntimeError):
    """The captured step is not one loss scaling can rewrite."""


def scales_loss(amp: AmpConfig, mode: str) -> bool:
    """Loss scaling applies to training steps, with the casts of ``amp.enable`` or without
    them (an fp32 step scaled as GradScaler scales one)."""
    return amp.loss_scale is not None and mode == "train"


def scale_loss(program: Program, ctx: PassContext) -> Program:
    grads = [(slot, v) for slot, v in program.results() if slot.kind == "grad"]
    if not scales_loss(ctx.strategy.amp, ctx.mode) or not grads:
        return program
    amp = ctx.strategy.amp
    start = amp.init_scale if amp.loss_scale == "dynamic" else amp.loss_scale
    scale = declare_scaler_state(program, LOSS_SCALE, torch.float32, start)
    _seed_with(program, scale)
    if ctx.inputs.accumulate_only:    # gradient merge: the scaled gradients are summed first
        return program
    unscaled, found_inf, skipped = _unscale(program, [v for _, v in grads], scale)
    new = dict(zip([s for s, _ in grads], unscaled))
    results = [(slot, new.get(slot, v)) for slot, v in program.results()]
    program.set_results(results + [(FOUND_INF, found_inf), (SCALE_USED, scale),
                                   (SKIPPED, skipped)])
    return program


def declare_scaler_state(program: Program, key: StateKey, dtype: torch.dtype,
                         fill: float) -> Value:
    """A 0-dim scaler state starting at ``fill``, declared with the other states at the top
    of the program."""
    op = state_op(key, TensorType((), dtype), fill=fill)
    at = next(i for i, o in enumerate(program.ops) if o.kind not in (OpKind.INPUT, OpKind.STATE))
    program.ops.insert(at, op)
    op.outputs[0].producer = op
    return op.result


def _seed_with(program: Program, scale: Value) -> None:
    """The backward's seed, ``ones_like(loss)``, becomes the scale (in the loss dtype)."""
    loss = program.result("loss")
    seeds = [op for op in program.ops if op.kind is OpKind.CALL and op.target == _SEED
             and op.role is Role.BACKWARD and op.args[:1] == (loss,)]
    if len(seeds) != 1:
        where = f"{loss.producer.target} ({loss.producer.module or 'top level'})"
        raise ScaleLossError(
            f"loss scaling: the loss {loss.type} made by {where} has {len(seeds)} backward "
            f"seeds ({_SEED} of the loss, role bwd), not one; cannot seed the backward "
            "with the loss scale")
    seed = seeds[0]
    value = scale
    if loss.type.dtype != torch.float32:   # autograd casts the gradient of loss*scale back
        cast = Op(OpKind.CALL, "aten._to_copy.default", (scale,), {"dtype": loss.type.dtype},
                  [Value(seed.result.type)], Role.BACKWARD, seed.module, seed.forward_op,
                  {LOSS_SCALING: "seed: the loss scale"})
        value = program.insert_after(seed, cast).result
    for op in program.ops:
        if op is not seed and seed.result in op.inputs:
            op.map_inputs(lambda v: value if v is seed.result else v)
    program.ops.remove(seed)
    if value is scale:
        _mark_readers(program, scale, "seeded with the loss scale")


def _mark_readers(program: Program, value: Value, text: str) -> None:
    for op in program.ops:
        if op.kind is OpKind.CALL and value in op.inputs:
            op.attrs.setdefault(LOSS_SCALING, text)


def _combined(found: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    any_found = torch.stack(found).amax()
    return any_found, any_found > 0


def _unscale(program: Program, grads: list[Value], scale: Value
             ) -> tuple[list[Value], Value, Value]:
    first = len(program.ops) - 1      # the new ops go in before the output op
    # GradScaler._unscale_grads_: the reciprocal in double, rounded to float
    inv_gm = make_fx(lambda s: s.double().reciprocal().float(), tracing_mode="fake")(
        torch.empty((), dtype=torch.float32))
    inv_scale = append_graph(program, inv_gm, [scale], Role.OPTIMIZER)
    checks = [program.add_call("autopar.unscale_checked", (g, inv_scale),
                               [g.type, TensorType((), torch.float32)], role=Role.OPTIMIZER,
                               module=g.producer.module if g.producer is not None else "")
              for g in grads]
    unscaled, found = [op.outputs[0] for op in checks], [op.outputs[1] for op in checks]
    gm = make_fx(_combined, tracing_mode="fake")([torch.empty(()) for _ in found])
    found_inf, skipped = append_graph(program, gm, found, Role.OPTIMIZER)
    for op in program.ops[first:]:
        if op.kind is OpKind.CALL:
            op.attrs[LOSS_SCALING] = "unscale and check for inf/nan"
    return unscaled, found_inf, skipped
