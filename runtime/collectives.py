"""Reshard steps as c10d collectives, with exactly the semantics of ``reshard.simulate``.

Every collective is a functional one (``torch.ops._c10d_functional``): it returns a new
tensor that is ready after ``wait_tensor``. Uncompiled, the op starts the collective and the
wait ends it; under ``torch.compile`` (``runtime/compiled.py``) both are nodes of the graph,
so the compiler sees each collective, and an asynchronous start our passes placed early
(a bucket's all-reduce, a ZeRO-3 prefetch, an early reduce-scatter) stays before the compute
it overlaps and its wait after.

Each comm op of a rank's program is bound once, when its executor is made, to a small
callable ``piece -> new piece``: the comm spec lowering made (the step and every group
member's piece shape, known statically from the global shape and placements) and this
rank's group along the step's mesh dim, so a step does no shape arithmetic.

Uneven shards (torch.chunk sizes) travel padded to the largest piece and are cut back:
gloo's all-gather refuses pieces of different sizes, and the padded fixed-size collectives
are the fast ones on NCCL too. Members are ordered by their index along the mesh dim, not by
c10d group rank (``MeshAxisGroup.order``). A grouped shard (``S(t)xg``) moves the same
blocks reordered: reduce-scatter sends member j its chunk of every group
(``chunk_grouped``), all-gather lays the gathered blocks back group by group
(``cat_grouped``). A norm partial (``P(norm2)``) reduces as the p-norm of the terms: each
member raises its piece to ``|x|^p``, the collective sums, the result is taken to ``1/p``
(``norminf``: the collective takes the max).

A shift (``Shift``: member i gets the piece of member (i - k) mod n, a ring pass) is one
``all_to_all_single`` whose splits send the whole piece to member i + k and receive the
whole of member i - k's: the functional collectives have no send or receive, and Dynamo
refuses ``batch_isend_irecv`` ("P2P compilation disabled"), so this is the form that runs
the same compiled and uncompiled. NCCL runs it as one group of sends and receives in which
only the two non-empty blocks carry data: a p2p pass. Gloo also exchanges the empty blocks
with the other members (messages of no bytes, a latency that grows with the group). A
whole turn (k = 0 mod n) is a local copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..ir.dist import (
    Partial,
    cat_grouped,
    chunk_grouped,
    group_widths,
    keeps_partial_value,
    local_offset,
    local_size,
    norm_order,
)
from ..lower.executable import (
    GATHERED_REDUCE_BYTES,
    BucketStart,
    BucketWait,
    GatherStart,
    GatherWait,
    ScatterStart,
    ScatterWait,
    StepComm,
)
from ..reshard.steps import (
    AllGather,
    AllReduce,
    AllToAll,
    MakePartial,
    ReduceScatter,
    Shift,
    Slice,
    Step,
)
from .process_groups import MeshAxisGroup, MeshGroups

__all__ = ["bind", "bind_step", "wait_bucket", "wait_unit", "Collective"]

Collective = Callable[[torch.Tensor], torch.Tensor]

FUNCTIONAL = torch.ops._c10d_functional


def bind(comm: StepComm | BucketStart | BucketWait | GatherStart | GatherWait | ScatterStart
         | ScatterWait, groups: MeshGroups) -> Callable:
    """The callable that runs ``comm`` (a comm spec lowering made) on this process's groups."""
    if isinstance(comm, BucketStart):
        return _bucket_start(comm, groups)
    if isinstance(comm, BucketWait):
        return wait_bucket
    if isinstance(comm, GatherStart):
        return _gather_start(comm, groups)
    if isinstance(comm, (GatherWait, ScatterWait)):
        return wait_unit
    if isinstance(comm, ScatterStart):
        return _scatter_start(comm, groups)
    return bind_step(comm, groups)


def _bucket_start(comm: BucketStart, groups: MeshGroups) -> Callable:
    """Start one asynchronous all-reduce over a bucket of gradients (flattened into one
    buffer); ``wait_bucket`` ends it and hands back views of the reduced buffer."""
    mesh_dim, reduce = comm.steps[0].mesh_dim, comm.steps[0].op
    shapes = comm.shapes
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    name, rop = groups[mesh_dim].group.group_name, _reduce_op(reduce)
    into, out_of = _norm_io(reduce)

    gathered = _GatheredReduce.on(groups[mesh_dim], rop) if comm.gathered else None

    def all_reduce_start(*grads: torch.Tensor):
        flat = into(torch.cat([g.reshape(-1) for g in grads]))
        if gathered is not None:
            # the handle holds the flat terms too: the gather reads them until the wait
            return (gathered.start(flat), sizes, shapes,
                    lambda out: out_of(gathered.finish(out)), flat)
        # uncompiled, in place: the bucket's one flat buffer is reduced where it is (the
        # functional all_reduce copies it: two buffers until the wait); Inductor, which
        # refuses the in-place op, reuses the buffer itself
        reduce = FUNCTIONAL.all_reduce if torch.compiler.is_compiling() else \
            FUNCTIONAL.all_reduce_
        return reduce(flat, rop, name), sizes, shapes, out_of
    return all_reduce_start


def wait_bucket(handle) -> tuple[torch.Tensor, ...]:
    pending, sizes, shapes, out_of = handle[:4]
    flat = out_of(FUNCTIONAL.wait_tensor(pending))
    return tuple(piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes))


def _gather_start(comm: GatherStart, groups: MeshGroups) -> Callable:
    """Start one asynchronous all-gather of a unit of pieces: each member's pieces flattened
    end to end, padded to the largest member's total (uneven torch.chunk pieces; gloo wants
    equal sizes); ``wait_unit`` ends it and lays each tensor's pieces back together."""
    axis, numels, width = _unit_layout(comm, groups)
    n, name, order = axis.size, axis.group.group_name, axis.order
    mine = sum(sizes[axis.index] for sizes in numels)

    def unpack(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = {j: out[g * width:(g + 1) * width] for g, j in enumerate(order)}
        results = []
        for k, (step, shapes) in enumerate(zip(comm.steps, comm.member_shapes)):
            pieces = []
            for j in range(n):
                offset = sum(numels[q][j] for q in range(k))
                pieces.append(blocks[j][offset:offset + numels[k][j]].view(shapes[j]))
            results.append(cat_grouped(pieces, step.tensor_dim, step.groups))
        return tuple(results)

    def all_gather_start(*pieces: torch.Tensor):
        flat = torch.cat([p.reshape(-1) for p in pieces]
                         + ([pieces[0].new_zeros(width - mine)] if width > mine else []))
        return FUNCTIONAL.all_gather_into_tensor(flat, n, name), unpack, flat   # as below
    return all_gather_start


def _unit_layout(comm: GatherStart | ScatterStart, groups: MeshGroups
                 ) -> tuple[MeshAxisGroup, list[list[int]], int]:
    """A unit collective's group axis, each input's piece sizes by member, and the flat
    block width (the largest member's total: gloo wants equal sizes)."""
    axis = groups[comm.steps[0].mesh_dim]
    numels = [[int(torch.Size(shapes[j]).numel()) for j in range(axis.size)]
              for shapes in comm.member_shapes]
    return axis, numels, max(sum(sizes[j] for sizes in numels) for j in range(axis.size))


def _scatter_start(comm: ScatterStart, groups: MeshGroups) -> Callable:
    """Start one asynchronous reduce-scatter of a unit of whole gradients: member j's block
    is its chunk of every gradient, end to end, padded to the largest member's total (FSDP's
    flat reduce-scatter); ``wait_unit`` ends it and cuts this process's block into its
    pieces."""
    axis, numels, width = _unit_layout(comm, groups)
    n, order = axis.size, axis.order
    op = _reduce_op(comm.steps[0].op)
    scatter = _flat_reduce_scatter(axis, op)

    def unpack(out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = scatter.finish(out)
        results, offset = [], 0
        for step, shapes, sizes in zip(comm.steps, comm.member_shapes, numels):
            mine = shapes[axis.index]
            moved = (mine[step.tensor_dim],) + tuple(
                s for d, s in enumerate(mine) if d != step.tensor_dim)
            piece = out[offset:offset + sizes[axis.index]].view(moved)
            results.append(piece.movedim(0, step.tensor_dim).contiguous())
            offset += sizes[axis.index]
        return tuple(results)

    def block(grads: tuple[torch.Tensor, ...], j: int) -> list[torch.Tensor]:
        """Member j's chunks of every gradient, end to end, zeros after."""
        parts = [chunk_grouped(g.movedim(s.tensor_dim, 0), 0, n, j, s.groups).reshape(-1)
                 for g, s in zip(grads, comm.steps)]
        pad = width - sum(numel[j] for numel in numels)
        return parts + ([grads[0].new_zeros(pad)] if pad else [])

    def reduce_scatter_start(*grads: torch.Tensor):
        flat = torch.cat([part for j in order for part in block(grads, j)])   # one copy
        # the handle holds the flat input too: the collective reads it until the wait
        # (what the memory estimate counts, and the meter sees)
        return scatter.start(flat), unpack, flat
    return reduce_scatter_start


def wait_unit(handle) -> tuple[torch.Tensor, ...]:
    """The end of a unit's gather or reduce-scatter: its tensors, unpacked from the buffer."""
    pending, unpack = handle[:2]
    return unpack(FUNCTIONAL.wait_tensor(pending))


def bind_step(comm: StepComm, groups: MeshGroups) -> Collective:
    """The collective that runs one reshard step on this process's group along its dim."""
    binder = BINDERS.get(type(comm.step))
    if binder is None:
        raise NotImplementedError(f"no c10d collective for reshard step {comm.step}")
    return binder(comm.step, groups[comm.step.mesh_dim], list(comm.member_shapes))


def _all_reduce(step: AllReduce, axis: MeshAxisGroup, shapes) -> Collective:
    op, name = _reduce_op(step.op), axis.group.group_name
    gathered = _GatheredReduce.on(axis, op)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        if gathered is not None and gathered.fits(x):
            out = FUNCTIONAL.wait_tensor(gathered.start(x.reshape(-1)))
            return gathered.finish(out).view(x.shape)
        return FUNCTIONAL.wait_tensor(FUNCTIONAL.all_reduce(x, op, name))
    return _as_norm(all_reduce, step.op)


@dataclass(frozen=True)
class _GatheredReduce:
    """An all-reduce over a pair of gloo processes as one all-gather and a local sum of the
    two terms (the same order on both, so both hold the same bits). Gloo's own all-reduce
    of a pair runs a reduce-scatter and an all-gather, two latency-bound phases (about 2 ms
    from 64 KiB to 1 MiB on loopback, against 1 ms for the all-gather) for the same bytes
    each way; with more members the gather would move more bytes, so they keep gloo's, as
    do terms over ``GATHERED_REDUCE_BYTES``."""

    n: int
    op: str
    group_name: str

    @staticmethod
    def on(axis: MeshAxisGroup, op: str) -> "_GatheredReduce | None":
        if axis.size != 2 or dist.get_backend(axis.group) != "gloo":
            return None
        return _GatheredReduce(axis.size, op, axis.group.group_name)

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= GATHERED_REDUCE_BYTES

    def start(self, flat: torch.Tensor) -> torch.Tensor:
        return FUNCTIONAL.all_gather_into_tensor(flat, self.n, self.group_name)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """The reduced flat value, from the waited gather (the terms end to end)."""
        return _reduce_blocks(out.view(self.n, -1), self.op, self.n)


def _reduce_blocks(blocks: torch.Tensor, op: str, n: int) -> torch.Tensor:
    """The members' terms (stacked along dim 0, by group rank) combined by ``op`` in that
    order."""
    if op in ("sum", "avg"):
        reduced = blocks.sum(0)
        return reduced / n if op == "avg" else reduced
    return blocks.amax(0) if op == "max" else blocks.amin(0)


def _reduce_op(op: str) -> str:
    """The functional collective's op that combines the terms: sum, avg, max, min; a norm's
    powered terms add (norminf: max)."""
    order = norm_order(op)
    if order is None:
        return op
    return "max" if order == float("inf") else "sum"


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _norm_io(op: str) -> tuple[Collective, Collective]:
    """What goes into the collective and what comes out of it for ``P(norm<p>)`` terms:
    ``|x|^p`` in, summed, ``^(1/p)`` out (norminf: ``|x|`` in, max) -- ``reshard.simulate``'s
    p-norm of the terms. Identities for sum/avg/max/min."""
    order = norm_order(op)
    if order is None:
        return _same, _same
    if order in (1, float("inf")):
        return torch.abs, _same
    if order == 2:
        return (lambda x: x * x), torch.sqrt
    return (lambda x: x.abs().pow(order)), (lambda y: y.pow(1.0 / order))


def _as_norm(collective: Collective, op: str) -> Collective:
    """``collective`` between ``_norm_io(op)``'s ends (itself for other ops)."""
    into, out_of = _norm_io(op)
    if into is _same:
        return collective
    return lambda x: out_of(collective(into(x)))


@dataclass(frozen=True)
class _FlatReduceScatter:
    """Reduce a flat buffer of ``n`` equal blocks (block j for the member of group rank j)
    over an axis group: this member gets its block, reduced. On NCCL (and any backend
    but gloo) one ``reduce_scatter_tensor``. Gloo has no reduce-scatter of its own (c10d
    runs it as an all-reduce of the whole buffer, then a copy): there the blocks travel by
    one ``all_to_all_single`` (each member sends block j to member j: (n-1)/n of the buffer,
    half an all-reduce's traffic) and the member reduces the n blocks it received."""

    n: int
    op: str
    group_name: str
    exchange: bool            # gloo: all-to-all, then reduce locally

    def start(self, flat: torch.Tensor) -> torch.Tensor:
        if self.exchange:
            splits = [flat.shape[0] // self.n] * self.n       # blocks along dim 0
            return FUNCTIONAL.all_to_all_single(flat, splits, splits, self.group_name)
        return FUNCTIONAL.reduce_scatter_tensor(flat, self.op, self.n, self.group_name)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """This member's reduced block, from the waited output of ``start``."""
        if not self.exchange:
            return out
        blocks = out.view((self.n, out.shape[0] // self.n) + tuple(out.shape[1:]))
        return _reduce_blocks(blocks, self.op, self.n)

    def run(self, flat: torch.Tensor) -> torch.Tensor:
        return self.finish(FUNCTIONAL.wait_tensor(self.start(flat)))


def _flat_reduce_scatter(axis: MeshAxisGroup, op: str) -> _FlatReduceScatter:
    exchange = dist.get_backend(axis.group) == "gloo"
    return _FlatReduceScatter(axis.size, op, axis.group.group_name, exchange)


def _chunks(size: int, n: int) -> list[tuple[int, int]]:
    """(offset, length) of each torch.chunk piece of ``size`` into ``n``."""
    return [(local_offset(size, n, j), local_size(size, n, j)) for j in range(n)]


def _stack_blocks(blocks: list[torch.Tensor], width: int) -> torch.Tensor:
    """Blocks (cut along dim 0) laid end to end, each padded to ``width`` rows."""
    if all(b.shape[0] == width for b in blocks):
        return torch.cat(blocks) if len(blocks) > 1 else blocks[0].contiguous()
    out = blocks[0].new_zeros((width * len(blocks),) + tuple(blocks[0].shape[1:]))
    for g, b in enumerate(blocks):
        out[g * width:g * width + b.shape[0]] = b
    return out


def _reduce_scatter(step: ReduceScatter, axis: MeshAxisGroup, shapes) -> Collective:
    if step.groups != 1:
        return _reduce_scatter_grouped(step, axis, shapes)
    t, n, i = step.tensor_dim, axis.size, axis.index
    parts = _chunks(shapes[i][t], n)
    width = parts[0][1]
    order = axis.order
    scatter = _flat_reduce_scatter(axis, _reduce_op(step.op))
    identity = order == tuple(range(n)) and all(length == width for _, length in parts)

    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        xt = x.movedim(t, 0)
        if identity:
            flat = xt.contiguous()
        else:
            flat = _stack_blocks([xt.narrow(0, *parts[j]) for j in order], width)
        out = scatter.run(flat)
        return out[:parts[i][1]].movedim(0, t).contiguous()
    return _as_norm(reduce_scatter, step.op)


def _reduce_scatter_grouped(step: ReduceScatter, axis: MeshAxisGroup, shapes) -> Collective:
    t, n, i, g = step.tensor_dim, axis.size, axis.index, step.groups
    widths = group_widths(g, shapes[i][t])
    width = sum(local_size(w, n, 0) for w in widths)      # the largest member's piece
    mine = sum(local_size(w, n, i) for w in widths)
    order = axis.order
    scatter = _flat_reduce_scatter(axis, _reduce_op(step.op))

    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        xt = x.movedim(t, 0)
        flat = _stack_blocks([chunk_grouped(xt, 0, n, j, g) for j in order], width)
        out = scatter.run(flat)
        return out[:mine].movedim(0, t).contiguous()
    return _as_norm(reduce_scatter, step.op)


def _all_gather(step: AllGather, axis: MeshAxisGroup, shapes) -> Collective:
    t, n = step.tensor_dim, axis.size
    sizes = [s[t] for s in shapes]
    width = max(sizes)
    name, order = axis.group.group_name, axis.order
    groups = step.groups
    identity = order == tuple(range(n)) and all(s == width for s in sizes) and groups == 1

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        xt = x.movedim(t, 0)
        mine = _stack_blocks([xt], width)
        out = FUNCTIONAL.wait_tensor(FUNCTIONAL.all_gather_into_tensor(mine, n, name))
        if not identity:
            by_index = {j: out[g * width:g * width + sizes[j]] for g, j in enumerate(order)}
            out = cat_grouped([by_index[j] for j in range(n)], 0, groups)
        return out.movedim(0, t).contiguous()
    return all_gather


def _slice(step: Slice, axis: MeshAxisGroup, shapes) -> Collective:
    t, n, i = step.tensor_dim, axis.size, axis.index
    if step.groups != 1:
        groups = step.groups
        return lambda x: chunk_grouped(x, t, n, i, groups)
    offset, length = _chunks(shapes[i][t], n)[i]

    def slice_(x: torch.Tensor) -> torch.Tensor:
        return x.narrow(t, offset, length).clone(memory_format=torch.contiguous_format)
    return slice_


def _all_to_all(step: AllToAll, axis: MeshAxisGroup, shapes) -> Collective:
    f, t, n, i = step.from_dim, step.to_dim, axis.size, axis.index
    parts = _chunks(shapes[i][t], n)          # how the to-dim is cut, same on every member
    name, order = axis.group.group_name, axis.order
    # what member j sends me: its piece, cut to my chunk of the to-dim
    incoming = [tuple(parts[i][1] if d == t else s for d, s in enumerate(shapes[j]))
                for j in range(n)]
    in_splits = [int(torch.Size(incoming[j]).numel()) for j in order]

    def all_to_all(x: torch.Tensor) -> torch.Tensor:
        blocks = [x.narrow(t, *parts[j]).reshape(-1) for j in order]
        out_splits = [b.numel() for b in blocks]
        send = torch.cat(blocks)
        recv = FUNCTIONAL.wait_tensor(
            FUNCTIONAL.all_to_all_single(send, in_splits, out_splits, name))
        pieces = {j: r.view(incoming[j]) for j, r in zip(order, recv.split(in_splits))}
        return torch.cat([pieces[j] for j in range(n)], dim=f)
    return all_to_all


def _make_partial(step: MakePartial, axis: MeshAxisGroup, shapes) -> Collective:
    keeps = keeps_partial_value(Partial(step.op), axis.index)

    def make_partial(x: torch.Tensor) -> torch.Tensor:
        return x.clone() if keeps else torch.zeros_like(x)
    return make_partial


def _shift(step: Shift, axis: MeshAxisGroup, shapes) -> Collective:
    n, i = axis.size, axis.index
    if len(set(map(tuple, shapes))) != 1:
        raise ValueError(f"{step}: the group's pieces differ in shape ({list(shapes)}); a "
                         "shift needs equal pieces, or it would break S(t)'s chunk sizes")
    if step.shift % n == 0:                   # a whole turn: every member keeps its piece
        return lambda x: x.clone(memory_format=torch.contiguous_format)
    to, source = (i + step.shift) % n, (i - step.shift) % n
    numel, shape = int(torch.Size(shapes[i]).numel()), tuple(shapes[source])
    # splits by group rank (order[g]: its mesh index): the whole piece to one member, the
    # whole of another's back
    send = [numel if j == to else 0 for j in axis.order]
    receive = [numel if j == source else 0 for j in axis.order]
    name = axis.group.group_name

    def shift(x: torch.Tensor) -> torch.Tensor:
        out = FUNCTIONAL.all_to_all_single(x.reshape(-1), receive, send, name)
        return FUNCTIONAL.wait_tensor(out).view(shape)
    return shift


BINDERS: dict[type[Step], Callable[[Step, MeshAxisGroup, list], Collective]] = {
    AllReduce: _all_reduce, ReduceScatter: _reduce_scatter, AllGather: _all_gather,
    Slice: _slice, AllToAll: _all_to_all, MakePartial: _make_partial, Shift: _shift,
}
