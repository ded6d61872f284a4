"""Writes into tensors the step made itself become out-of-place ops, so every value is SSA.

Models build some inputs by writing into a fresh tensor through views (T5's shifted decoder
inputs: ``new_zeros``, then ``copy_`` into ``[..., 1:]`` and ``fill_`` of ``[..., 0]``, then a
``masked_fill_``). In place, the write changes the base through the view, an aliasing no
SPMD rule can see: a rank that wrote into a resharded copy of the view would change nothing.
So each write is replaced by its out-of-place form and scattered back into the base:

    %v = slice(%b, 1, 1, max)             %v = slice(%b, 1, 1, max)
    %w = copy_(%v, %src)          ->      %w = copy(%v, %src)
                                          %b2 = slice_scatter(%b, %w, 1, 1, max)

and every later reader of the base (or of a view taken before the write) reads the newest
version (a view is taken again from it). The scatter ops have SPMD rules
(``spmd/rules/view_writes.py``): the written dim stays whole, the others shard.

Only bases the program makes itself (a factory or compute op) are rewritten, and only when
every write into the base and every view on the way is of a kind below; otherwise the base
is left as captured (its in-place ops then run replicated, with a missing-rule warning).
Writes into parameters, buffers and batch inputs are state updates, not rewritten here.

First, ``as_strided`` views become the plain views they equal (``strided_views.py``): the
backward of an ``as_strided`` read writes its gradient into a zero buffer through one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import Op, OpKind, Program, Value
from ..ir.ops import UnknownOpError, op_info, schema_args
from ..pass_infra.context import PassContext
from .strided_views import plain_views


# view target -> how the written view goes back into the view's input:
# (view op, its input's newest value, the new view value) -> args of the scatter call
def _slice_back(op: Op, base: Value, new: Value) -> tuple[str, tuple]:
    a = schema_args(op)
    return "aten.slice_scatter.default", (base, new, a["dim"], a["start"], a["end"], a["step"])


def _select_back(op: Op, base: Value, new: Value) -> tuple[str, tuple]:
    a = schema_args(op)
    return "aten.select_scatter.default", (base, new, a["dim"], a["index"])


def _reshape_back(op: Op, base: Value, new: Value) -> tuple[str, tuple]:
    # every view of this kind keeps the logical (row-major) order of the elements
    return "aten.reshape.default", (new, list(base.type.shape))


def _transpose_back(op: Op, base: Value, new: Value) -> tuple[str, tuple]:
    a = schema_args(op)
    return "aten.transpose.int", (new, a["dim0"], a["dim1"])


def _permute_back(op: Op, base: Value, new: Value) -> tuple[str, tuple]:
    dims = [d % len(base.type.shape) for d in schema_args(op)["dims"]]
    return "aten.permute.default", (new, sorted(range(len(dims)), key=dims.__getitem__))


def _t_back(op: Op, base: Value, new: Value) -> tuple[str, tuple]:
    return "aten.t.default", (new,)


BACK: dict[str, Callable[[Op, Value, Value], tuple[str, tuple]]] = {
    "aten.slice.Tensor": _slice_back,
    "aten.select.int": _select_back,
    "aten.view.default": _reshape_back,
    "aten._unsafe_view.default": _reshape_back,
    "aten.unsqueeze.default": _reshape_back,
    "aten.squeeze.dim": _reshape_back,
    "aten.squeeze.dims": _reshape_back,
    "aten.transpose.int": _transpose_back,
    "aten.permute.default": _permute_back,
    "aten.t.default": _t_back,
}


@dataclass(frozen=True)
class _Alias:
    """A value that is its root's memory: the root itself (``chain`` empty) or a view of it
    through ``chain``, taken when the root was at ``version``."""

    root: Value
    chain: tuple[Op, ...]
    version: int


def out_of_place(target: str) -> str | None:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor`` (None when torch has no such op)."""
    namespace, name, overload = target.split(".")
    if not name.endswith("_") or name.startswith("_"):
        return None
    candidate = f"{namespace}.{name[:-1]}.{overload}"
    try:
        op_info(candidate)
    except UnknownOpError:
        return None
    return candidate


def _writes(op: Op) -> bool:
    return op.kind is OpKind.CALL and op_info(op.target).mutates


def _is_view(op: Op) -> bool:
    return op.kind is OpKind.CALL and op_info(op.target).view


def _root_of(v: Value) -> tuple[Value, tuple[Op, ...]] | None:
    """The fresh tensor ``v`` is memory of, through supported views (None: a view of state
    or of an input, or a view kind not handled)."""
    chain: list[Op] = []
    while True:
        producer = v.producer
        if producer is None or producer.kind is not OpKind.CALL:
            return None
        if _writes(producer) and producer.args and producer.args[0] is not v:
            v = producer.args[0]            # a write's result is its destination
            continue
        if not _is_view(producer):
            return v, tuple(reversed(chain))
        if producer.target not in BACK:
            return None
        chain.append(producer)
        v = producer.args[0]


def _rewritable_roots(program: Program) -> set[Value]:
    """Roots whose every write has an out-of-place form and reaches it through views
    this pass can scatter back."""
    ok: dict[Value, bool] = {}
    for op in program.ops:
        if not _writes(op) or not op.args or not isinstance(op.args[0], Value):
            continue
        found = _root_of(op.args[0])
        if found is None:
            continue
        root = found[0]
        supported = out_of_place(op.target) is not None and len(op.outputs) == 1
        ok[root] = ok.get(root, True) and supported
    return {root for root, good in ok.items() if good}


class _Rewrite:
    def __init__(self, program: Program, roots: set[Value]):
        self.program, self.roots = program, roots
        self.alias: dict[Value, _Alias] = {}
        self.version: dict[Value, int] = {root: 0 for root in roots}
        self.newest: dict[Value, Value] = {root: root for root in roots}
        self.replayed: dict[tuple[Value, int], Value] = {}
        self.ops: list[Op] = []

    def run(self) -> None:
        for root in self.roots:
            self.alias[root] = _Alias(root, (), 0)
        for op in self.program.ops:
            op.map_inputs(lambda v, op=op: self._current(v, op))
            if _writes(op) and op.args and self._family(op.args[0]) is not None:
                self._functionalize(op)
                continue
            self.ops.append(op)
            if _is_view(op) and op.args and self._family(op.args[0]) is not None:
                parent = self.alias[op.args[0]]
                self.alias[op.outputs[0]] = _Alias(parent.root, parent.chain + (op,),
                                                   parent.version)
        self.program.ops = self.ops

    def _family(self, v) -> _Alias | None:
        return self.alias.get(v) if isinstance(v, Value) else None

    def _current(self, v: Value, reader: Op) -> Value:
        """``v`` as of now: a view taken before the latest write into its root is taken
        again from the root's newest version."""
        alias = self.alias.get(v)
        if alias is None or alias.version == self.version[alias.root]:
            return v
        key = (v, self.version[alias.root])
        if key not in self.replayed:
            value = self.newest[alias.root]
            for view in alias.chain:
                value = self._emit(view.target, (value, *view.args[1:]), view.outputs[0],
                                   like=view, kwargs=view.kwargs)
            self.alias[value] = _Alias(alias.root, alias.chain, self.version[alias.root])
            self.replayed[key] = value
        return self.replayed[key]

    def _functionalize(self, write: Op) -> None:
        dest = self.alias[write.args[0]]
        new = self._emit(out_of_place(write.target), write.args, write.outputs[0], like=write,
                         kwargs=write.kwargs)
        # back up the chain: each view's input takes the written view's new contents
        for view in reversed(dest.chain):
            scatter, args = BACK[view.target](view, view.args[0], new)
            new = self._emit(scatter, args, view.args[0], like=write)
        root = dest.root
        self.version[root] += 1
        self.newest[root] = new
        self.alias[new] = _Alias(root, (), self.version[root])
        # the write's own result is the destination view, as of now
        self.alias[write.outputs[0]] = _Alias(root, dest.chain, self.version[root] - 1)

    def _emit(self, target: str, args: tuple, like_value: Value, like: Op,
              kwargs: dict | None = None) -> Value:
        op = Op(OpKind.CALL, target, tuple(args), dict(kwargs or {}), [Value(like_value.type)],
                like.role, like.module, like.forward_op)
        op.outputs[0].producer = op
        self.ops.append(op)
        return op.outputs[0]


def functionalize_writes(program: Program, ctx: PassContext) -> Program:
    plain_views(program)
    roots = _rewritable_roots(program)
    if roots:
        _Rewrite(program, roots).run()
    return program
