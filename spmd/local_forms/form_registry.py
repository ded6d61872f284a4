"""The registry of local forms, and ``local_call``/``run_local`` that apply them."""
from __future__ import annotations

from typing import Any, Callable, Mapping

from torch.utils import _pytree as pytree

from ...ir.core import Op, Value
from ...ir.ops import draws_random, resolve
from .local_call import LocalCall, LocalContext, UnsupportedLocalForm

LocalForm = Callable[[Op, LocalContext], "LocalCall | None"]
LOCAL_FORMS: dict[str, LocalForm] = {}


def register_local_form(*targets: str) -> Callable[[LocalForm], LocalForm]:
    def add(fn: LocalForm) -> LocalForm:
        for target in targets:
            if target in LOCAL_FORMS:
                raise ValueError(f"local form for {target!r} registered twice")
            LOCAL_FORMS[target] = fn
        return fn
    return add


def local_call(op: Op, ctx: LocalContext) -> LocalCall:
    """The call this rank makes for ``op`` (the op's own call when no form applies)."""
    form = LOCAL_FORMS.get(op.target)
    call = form(op, ctx) if form is not None else None
    if call is None:
        if form is None and draws_random(op) and any(
                ctx.out_sharded(i) for i, v in enumerate(op.outputs) if v.is_tensor):
            raise UnsupportedLocalForm(
                f"random op {op.target} ({op.module or 'top level'}) has a sharded output "
                f"{[str(d) for d in ctx.outputs]} but no local form in "
                "autopar/spmd/local_forms/: its ranks would draw unrelated numbers")
        return LocalCall(op.target, op.args, dict(op.kwargs))
    return call


def run_local(op: Op, ctx: LocalContext, values: Mapping[Value, Any]) -> Any:
    """Execute this rank's call of ``op``: ``values`` maps each input Value of ``op`` to the
    rank's runtime value (its local tensor, or a non-tensor input as it is)."""
    call = local_call(op, ctx)
    swap = lambda a: values[a] if isinstance(a, Value) else a  # noqa: E731
    args, kwargs = pytree.tree_map(swap, (call.args, call.kwargs))
    return resolve(call.target)(*args, **kwargs)
