"""``as_strided`` views become the plain views they equal (``view``, ``slice``, ``select``,
``permute``, ``unsqueeze``, ``expand``), run by ``functionalize_writes`` before its writes.

``as_strided(x, size, stride, offset)`` reads ``x``'s memory, not its values by index: no
SPMD rule can say which piece of a sharded ``x`` a rank's result comes from, and a write
into it (the backward of an ``as_strided`` pooling head: ``new_zeros``, ``as_strided``,
``copy_``) aliases the buffer in a way no rule sees. Where the traced input is contiguous
(capture records its layout, ``INPUT_LAYOUT``) and the strides pick a regular block of
its elements, the same elements come from plain views of ``x``'s values, which have rules
and which ``functionalize_writes`` can scatter writes back through:

    x [4,4,8] contiguous; as_strided(x, [4,8], [32,1], 0)  ==  view(x, [4,32])[:, 0:8]

The block: sort the result's dims by stride (largest first: ``t0 > t1 > ... > tk``), view
the ``n`` elements as ``[n/t0, t0/t1, ..., t(k-1)/tk, tk]``, write the offset in that
mixed radix, slice each dim from its digit, select the last dim's digit, and permute back;
size-1 dims come back by ``unsqueeze``, stride-0 dims by ``expand``. Strides that do not
divide each other, overlapping dims, or reads past ``x``'s elements stay ``as_strided``
(and run replicated, with the missing-rule warning).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import Op, OpKind, Program, TensorType, Value
from ..ir.attrs import INPUT_LAYOUT
from ..ir.ops import schema_args

AS_STRIDED = "aten.as_strided.default"


@dataclass(frozen=True)
class _Block:
    """The plain views an ``as_strided`` equals, as data: view ``x`` as ``radix``; slice
    dim i to ``[start[i], start[i] + length[i])`` for the leading dims, select ``last`` of
    the trailing one; then ``order`` permutes the kept dims into the result's order."""

    radix: tuple[int, ...]
    start: tuple[int, ...]
    length: tuple[int, ...]
    last: int
    order: tuple[int, ...]


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _block(n: int, size: list[int], stride: list[int], offset: int) -> _Block | None:
    """The block of ``n`` contiguous elements the strided read picks (None: not a block)."""
    dims = sorted((d for d in range(len(size)) if size[d] > 1 and stride[d] > 0),
                  key=lambda d: -stride[d])
    steps = [n] + [stride[d] for d in dims]
    if any(a % b for a, b in zip(steps, steps[1:])) or len(set(steps[1:])) < len(dims):
        return None
    radix = tuple(a // b for a, b in zip(steps, steps[1:])) + (steps[-1],)
    digits, rest = [], offset
    for r in reversed(radix):
        digits.append(rest % r)
        rest //= r
    digits.reverse()
    if rest or any(digits[i] + size[d] > radix[i] for i, d in enumerate(dims)):
        return None
    order = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
    return _Block(radix, tuple(digits[:-1]), tuple(size[d] for d in dims), digits[-1], order)


class _Emitter:
    """Emits the views of one ``as_strided`` op in its place."""

    def __init__(self, op: Op):
        self.op, self.ops = op, []
        self.dtype = op.outputs[0].type.dtype

    def emit(self, target: str, args: tuple, shape: tuple[int, ...]) -> Value:
        out = Value(TensorType(tuple(shape), self.dtype))
        op = Op(OpKind.CALL, target, args, {}, [out], self.op.role, self.op.module,
                self.op.forward_op)
        out.producer = op
        self.ops.append(op)
        return out

    def views(self, x: Value, block: _Block, size: list[int], stride: list[int]) -> Value:
        # a unit innermost stride leaves a trailing radix of 1: nothing to select there
        shape = list(block.radix[:-1] if block.radix[-1] == 1 else block.radix)
        v = x
        if tuple(x.type.shape) != tuple(shape):
            v = self.emit("aten.view.default", (v, list(shape)), tuple(shape))
        for d, (start, length) in enumerate(zip(block.start, block.length)):
            if (start, length) != (0, shape[d]):
                shape[d] = length
                v = self.emit("aten.slice.Tensor", (v, d, start, start + length), tuple(shape))
        if block.radix[-1] != 1:
            shape.pop()
            v = self.emit("aten.select.int", (v, len(shape), block.last), tuple(shape))
        if block.order != tuple(range(len(block.order))):
            shape = [shape[i] for i in block.order]
            v = self.emit("aten.permute.default", (v, list(block.order)), tuple(shape))
        v = self._broadcast(v, size, stride)
        if not self.ops:    # the read is ``x`` itself: an identity view holds the result
            v = self.emit("aten.view.default", (v, list(size)), tuple(size))
        return v

    def _broadcast(self, v: Value, size: list[int], stride: list[int]) -> Value:
        """Put back the size-1 dims (unsqueeze) and the stride-0 dims (unsqueeze, expand)."""
        shape = list(v.type.shape)
        for d, n in enumerate(size):
            if n == 1 or stride[d] == 0:
                shape.insert(d, 1)
                v = self.emit("aten.unsqueeze.default", (v, d), tuple(shape))
        if tuple(shape) != tuple(size):
            v = self.emit("aten.expand.default", (v, list(size)), tuple(size))
        return v


def _rewrite(op: Op) -> list[Op] | None:
    """The plain views equal to ``op`` (None: its read is no regular block)."""
    layout = op.attrs.get(INPUT_LAYOUT)
    a = schema_args(op)
    x, size, stride = a["self"], list(a["size"]), list(a["stride"])
    if layout is None or 0 in size or not _contiguous(x.type.shape, layout[0]):
        return None
    offset = (a["storage_offset"] if a["storage_offset"] is not None else layout[1]) - layout[1]
    n = math.prod(x.type.shape)
    if not all(isinstance(k, int) for k in [*size, *stride, offset]) or offset < 0 or n == 0:
        return None
    block = _block(n, size, stride, offset)
    if block is None:
        return None
    emitter = _Emitter(op)
    last = emitter.views(x, block, size, stride)
    last.producer.outputs = [op.outputs[0]]
    op.outputs[0].producer = last.producer
    return emitter.ops


def plain_views(program: Program) -> Program:
    """Every ``as_strided`` of a contiguous traced input that reads a regular block of it
    becomes the plain views that read the same elements."""
    ops: list[Op] = []
    for op in program.ops:
        views = _rewrite(op) if op.kind is OpKind.CALL and op.target == AS_STRIDED else None
        ops += views if views is not None else [op]
    program.ops = ops
    return program
