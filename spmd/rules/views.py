"""View-family and other data-movement ops. None of them computes, so every Partial passes
through (``linear="sum"`` with all four reduce ops) and no letter may vanish into a
reduction (``reduce=None``). A dim the op cuts, pads, gathers, repeats or reverses is
replicated; reshapes come from dim transforms (``dim_transforms.py``).

Letters follow the op's own semantics (what ``unsqueeze(dim)`` does to a local piece), not
its output shape: a size-1 dim that is sharded holds size 0 on some ranks, and a local
unsqueeze/squeeze must still line up with the global one.
"""
from __future__ import annotations

from typing import Any, Sequence

from ...ir.core import Op
from ..dim_transforms import MOVE_PARTIALS, view_spec
from ..registry import register, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters


def _move(inputs: Sequence[str], outputs: Sequence[str], replicated: Sequence[str] = ()) -> Spec:
    return Spec(tuple(inputs), tuple(outputs), replicated=frozenset(replicated),
                reduce=None, linear="sum", partial_ops=MOVE_PARTIALS)


def _param(op: Op, index: int, name: str, default: Any = None) -> Any:
    """An op argument by position or keyword (ATen schemas allow both)."""
    if len(op.args) > index:
        return op.args[index]
    return op.kwargs.get(name, default)


def _shape(op: Op, i: int = 0) -> tuple[int, ...]:
    return tuple(tensor_inputs(op)[i].type.shape)


def _out_shape(op: Op, o: int = 0) -> tuple[int, ...]:
    return tuple(op.outputs[o].type.shape)


def _dim(d: int, ndim: int) -> int:
    """Normalise a possibly negative dim; a 0-d tensor accepts 0 and -1."""
    return d % max(ndim, 1)


def _drop(s: str, d: int) -> str:
    return s[:d] + s[d + 1:]


def _insert(s: str, d: int, c: str = UNSHARDABLE) -> str:
    return s[:d] + c + s[d:]


# --------------------------------------------------------------------- reshapes

@register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
          "aten._reshape_alias.default")
def view(op: Op) -> Spec:
    # Shapes from the value types: the size argument may hold -1.
    return view_spec(_shape(op), _out_shape(op))


@register("aten.unsqueeze.default")
def unsqueeze(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [_insert(a, _dim(_param(op, 1, "dim"), len(a) + 1))])


@register("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims")
def squeeze(op: Op) -> Spec:
    shape = _shape(op)
    a = letters(len(shape))
    if op.target == "aten.squeeze.default":
        targeted = set(range(len(shape)))
    else:
        dims = _param(op, 1, "dim")
        dims = [dims] if isinstance(dims, int) else list(dims)
        targeted = {_dim(d, len(shape)) for d in dims} if shape else set()
    # A targeted dim of size 1 vanishes. A targeted dim of another size stays, but a shard
    # of it may have size 1 on some rank, where a local squeeze would drop it: replicated.
    ins = "".join(UNSHARDABLE if d in targeted and n == 1 else c
                  for d, (c, n) in enumerate(zip(a, shape)))
    out = "".join(c for d, c in enumerate(ins) if not (d in targeted and shape[d] == 1))
    return _move([ins], [out], [a[d] for d in targeted if shape[d] != 1])


@register("aten.expand.default")
def expand(op: Op) -> Spec:
    shape, out_shape = _shape(op), _out_shape(op)
    out = letters(len(out_shape))
    offset = len(out_shape) - len(shape)
    # New leading dims and broadcast size-1 dims are output-only letters: the input has
    # nothing to shard there, but a consumer may ask for the output sharded.
    ins = "".join(out[offset + i] if n == out_shape[offset + i] else UNSHARDABLE
                  for i, n in enumerate(shape))
    return _move([ins], [out])


@register("aten.repeat.default")
def repeat(op: Op) -> Spec:
    shape, repeats = _shape(op), list(_param(op, 1, "repeats"))
    out = letters(len(repeats))
    offset = len(repeats) - len(shape)
    # A repeated dim holds copies of the whole input dim, not of one shard.
    tiled = [out[offset + i] for i, r in enumerate(repeats[offset:]) if r != 1]
    leading = "".join(UNSHARDABLE for _ in range(offset))
    return _move([out[offset:]], [leading + out[offset:]], tiled)


# --------------------------------------------------------------------- permutations

@register("aten.transpose.int")
def transpose(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    if not a:
        return _move([a], [a])
    d0, d1 = _dim(_param(op, 1, "dim0"), len(a)), _dim(_param(op, 2, "dim1"), len(a))
    out = list(a)
    out[d0], out[d1] = a[d1], a[d0]
    return _move([a], ["".join(out)])


@register("aten.t.default")
def t(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [a[::-1]])


@register("aten.permute.default")
def permute(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], ["".join(a[_dim(d, len(a))] for d in _param(op, 1, "dims"))])


@register("aten.clone.default", "aten.alias.default", "aten.lift_fresh.default")
def identity(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [a])


@register("aten.flip.default")
def flip(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    return _move([a], [a], [a[_dim(d, len(a))] for d in _param(op, 1, "dims")])


@register("aten.roll.default")
def roll(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    dims = list(_param(op, 2, "dims", []) or [])
    # Without dims, roll shifts the flattened tensor: every dim moves.
    rolled = [a[_dim(d, len(a))] for d in dims] if dims else list(a)
    return _move([a], [a], rolled)


# --------------------------------------------------------------------- cutting and joining

@register("aten.split.Tensor", "aten.split_with_sizes.default")
def split(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 2, "dim", 0), len(a))
    return _move([a], [a] * len(op.outputs), [a[d]])


@register("aten.unbind.int")
def unbind(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(a))
    return _move([a[:d] + UNSHARDABLE + a[d + 1:]], [_drop(a, d)] * len(op.outputs))


@register("aten.cat.default")
def cat(op: Op) -> Spec:
    out = letters(len(_out_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(out))
    # Legacy code may cat a 1-D empty tensor onto n-D ones; torch skips it.
    ins = [UNSHARDABLE if t.type.shape == (0,) and len(out) != 1 else out
           for t in tensor_inputs(op)]
    return _move(ins, [out], [out[d]] if out else [])


@register("aten.stack.default")
def stack(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(a) + 1)
    return _move([a] * len(tensor_inputs(op)), [_insert(a, d)])


@register("aten.slice.Tensor")
def slice_(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim", 0), len(a))
    # A slice that keeps the whole dim (start <= 0, end >= size, any step on a size <= 1
    # dim) slices every local piece whole too; any other slice cuts across shards.
    full = _shape(op)[d] == _out_shape(op)[d]
    return _move([a], [a], [] if full else [a[d]])


@register("aten.slice_backward.default")
def slice_backward(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 2, "dim"), len(a))
    full = _shape(op)[d] == _out_shape(op)[d]
    return _move([a], [a], [] if full else [a[d]])


@register("aten.select.int")
def select(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 1, "dim"), len(a))
    return _move([a[:d] + UNSHARDABLE + a[d + 1:]], [_drop(a, d)])


@register("aten.select_backward.default")
def select_backward(op: Op) -> Spec:
    a = letters(len(_shape(op)))
    d = _dim(_param(op, 2, "dim"), len(a) + 1)
    return _move([a], [_insert(a, d)])
