"""The plan next to eager torch: where does the captured and rewritten step first stop
computing what the user's own model computes?

The divergence locator's default reference is the plan's own global program on one device,
which finds where parallelism goes wrong but cannot see a capture or rewrite bug: both sides
share it. This reference is the user's model itself, run eagerly on one device (a copy of
it, so nothing changes) with the same random draws and, under ``amp`` O1, the same
autocast. Each module's forward output (recorded by forward hooks) is compared with the
value the plan's global program makes for that module: the last value its forward ops make
that an op outside it reads, of the same shape. Modules are judged in the order they finish,
so the innermost, earliest one that differs is reported, with the plan's ops inside it.
When every forward output agrees, the loss and then each parameter's gradient (as the
backward hands it to the update, before clipping or unscaling) are compared, modules in
backward order. Tolerances are ``torch.testing``'s defaults for the value's dtype.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..capture import call_model, loss_from_output
from ..ir import NAME, Op, OpKind, Program, Role, Value

__all__ = ["EagerDivergence", "EagerStep", "compare_with_eager", "run_eager"]

# torch.testing.assert_close's default (rtol, atol) per dtype
_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
              torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}


@dataclass(frozen=True)
class EagerDivergence:
    module: str                 # the module path ('<loss>' for the loss)
    what: str                   # 'forward output', 'loss' or 'gradient of <param>'
    max_abs: float
    max_rel: float
    dtype: torch.dtype
    ops: tuple[str, ...]        # the plan's ops inside the module

    def __str__(self) -> str:
        rtol, atol = _TOLERANCE.get(self.dtype, (0.0, 0.0))
        lines = [f"first divergence from eager torch: {self.module or 'top level'}: its "
                 f"{self.what} differs by max abs {self.max_abs:.3g}, max rel "
                 f"{self.max_rel:.3g} (beyond {str(self.dtype).removeprefix('torch.')}'s "
                 f"rtol {rtol:g}, atol {atol:g})",
                 f"  the plan's {'backward ' if 'gradient' in self.what else ''}ops inside "
                 f"it ({len(self.ops)}):"]
        lines += [f"    {op}" for op in self.ops[:20]]
        if len(self.ops) > 20:
            lines.append(f"    ... {len(self.ops) - 20} more")
        return "\n".join(lines)


@dataclass
class EagerStep:
    """What eager torch computed for one training step on one device."""

    outputs: dict[str, list[torch.Tensor]]    # each module's forward output, in finish order
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]            # by parameter name


def run_eager(model: torch.nn.Module, loss_fn: Callable | None, inputs: Any, labels: Any,
              seed: int, autocast: torch.dtype | None = None) -> EagerStep:
    """One forward and backward of a copy of ``model``, each module's first output kept."""
    twin = copy.deepcopy(model)
    outputs: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):
        def hook(module, args, out):
            if name not in outputs:
                outputs[name] = [t.detach().clone() for t in pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor)]
        return hook
    handles = [m.register_forward_hook(keep(n)) for n, m in twin.named_modules() if n]
    device = next((p.device.type for p in twin.parameters()), "cpu")
    try:
        with torch.random.fork_rng(devices=[]), torch.autocast(
                device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            torch.manual_seed(seed)
            args, kwargs = call_model(twin, inputs, labels, loss_fn)
            out = twin(*args, **kwargs)
            loss = loss_fn(out, labels) if loss_fn is not None else loss_from_output(out)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    grads = {n: p.grad.detach() for n, p in twin.named_parameters() if p.grad is not None}
    return EagerStep(outputs, loss.detach(), grads)


def compare_with_eager(program: Program, values: dict[Value, Any], eager: EagerStep,
                       names: dict[Value, str]) -> EagerDivergence | None:
    """The first module whose output, then the loss, then the first module (in backward
    order) whose parameters' gradients differ; None when the plan computes what eager
    does."""
    escaping = _escaping_values(program)
    for module, leaves in eager.outputs.items():
        for want, got in _paired(leaves, escaping.get(module, []), values):
            found = _differs(got, want) if got is not None else None
            if found is not None:
                return EagerDivergence(module, "forward output", *found, want.dtype,
                                       _ops_inside(program, module, Role.FORWARD, names))
    loss = next((v for slot, v in program.results() if slot.kind == "loss"), None)
    found = _differs(values.get(loss), eager.loss) if loss is not None else None
    if found is not None:
        return EagerDivergence("<loss>", "loss", *found, eager.loss.dtype,
                               _ops_inside(program, "<loss>", Role.LOSS, names))
    return _first_gradient(program, values, eager, names)


def _first_gradient(program: Program, values: dict[Value, Any], eager: EagerStep,
                    names: dict[Value, str]) -> EagerDivergence | None:
    planned = _raw_gradients(program)
    by_module: dict[str, list[str]] = defaultdict(list)
    for param in eager.grads:
        by_module[param.rpartition(".")[0]].append(param)
    order = [m for m in reversed(eager.outputs) if m in by_module]
    order += [m for m in by_module if m not in order]
    for module in order:
        for param in by_module[module]:
            got = planned.get(param)
            # a gradient eager computes and the plan does not is a divergence too
            found = _differs(values.get(got), eager.grads[param]) if got is not None \
                else (float("inf"), float("inf"))
            if found is not None:
                return EagerDivergence(module, f"gradient of {param}", *found,
                                       eager.grads[param].dtype,
                                       _ops_inside(program, module, Role.BACKWARD, names))
    return None


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def _escaping_values(program: Program) -> dict[str, list[Value]]:
    """Per module path (and each enclosing one), the forward values its ops make that an op
    outside it reads (or the step returns), in program order."""
    readers: dict[Value, list[Op]] = defaultdict(list)
    for op in program.ops:
        for v in op.inputs:
            readers[v].append(op)
    out: dict[str, list[Value]] = defaultdict(list)
    for op in program.ops:
        if op.kind is not OpKind.CALL or op.role is not Role.FORWARD or not op.module:
            continue
        parts = op.module.split(".")
        for k in range(1, len(parts) + 1):
            module = ".".join(parts[:k])
            out[module] += [v for v in op.outputs if v.is_tensor and any(
                r.kind is OpKind.OUTPUT or (r.role in (Role.FORWARD, Role.LOSS)
                                            and not _inside(r.module, module))
                for r in readers[v])]
    return out


def _paired(leaves: list[torch.Tensor], candidates: list[Value], values: dict[Value, Any]
            ) -> list[tuple[torch.Tensor, Any]]:
    """Each output leaf of a module with the plan's value for it: of the values the module
    hands out with that leaf's shape, the last ones, in order (a module's outputs are the
    last values it hands out: ``(cos, sin)`` pairs with the last two of their shape)."""
    by_shape: dict[tuple, list[Any]] = defaultdict(list)
    for v in candidates:
        got = values.get(v)
        if isinstance(got, torch.Tensor):
            by_shape[tuple(got.shape)].append(got)
    wanted: dict[tuple, int] = defaultdict(int)
    for leaf in leaves:
        wanted[tuple(leaf.shape)] += 1
    seen: dict[tuple, int] = defaultdict(int)
    out = []
    for leaf in leaves:
        shape = tuple(leaf.shape)
        found, n = by_shape[shape], wanted[shape]
        index = len(found) - n + seen[shape]
        seen[shape] += 1
        out.append((leaf, found[index] if index >= 0 else None))
    return out


def _differs(got: Any, want: torch.Tensor) -> tuple[float, float] | None:
    """(max abs error, max rel error) when ``got`` is beyond ``want``'s dtype's tolerance."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None if got is None else (float("inf"), float("inf"))
    if not want.is_floating_point():
        return None if torch.equal(got, want) else (float("inf"), float("inf"))
    rtol, atol = _TOLERANCE.get(want.dtype, (1.3e-6, 1e-5))
    error = (got.to(want.dtype).double() - want.double()).abs()
    if bool((error <= atol + rtol * want.double().abs()).all()):
        return None
    largest = want.double().abs().max().item()
    return error.max().item(), error.max().item() / max(largest, 1e-30)


def _raw_gradients(program: Program) -> dict[str, Value]:
    """Each parameter's gradient as the backward hands it to the update (followed back
    through the update's own ops: clipping, unscaling)."""
    states = {op.outputs[0]: op.attrs[NAME] for op in program.ops if op.kind is OpKind.STATE}
    found = {}
    for op in program.ops:
        if op.kind is OpKind.CALL and op.role is Role.OPTIMIZER and len(op.args) > 1 \
                and op.args[0] in states and isinstance(op.args[1], Value):
            grad = op.args[1]
            while grad.producer is not None and grad.producer.role is Role.OPTIMIZER \
                    and grad.producer.kind is OpKind.CALL and grad.producer.args \
                    and isinstance(grad.producer.args[0], Value):
                grad = grad.producer.args[0]
            found[states[op.args[0]]] = grad
    return found


def _ops_inside(program: Program, module: str, role: Role, names: dict[Value, str]
                ) -> tuple[str, ...]:
    return tuple(f"{names.get(op.outputs[0], '?') if op.outputs else '-'} = "
                 f"{op.target.removesuffix('.default')} ({op.module or '-'})"
                 for op in program.ops
                 if op.kind is OpKind.CALL and op.role is role and _inside(op.module, module))
