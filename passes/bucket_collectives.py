"""Bucket gradient all-reduces: many small collectives become a few large, asynchronous ones.

After reshard, every gradient that reaches the optimizer as a Partial has its own
``comm.all_reduce`` just before the optimizer: a hundred latency-bound collectives per step
for a small transformer, none overlapping compute. Here, all-reduces of backward results
that feed the optimizer are grouped (same mesh dim, reduce op and dtype, in the order the
backward produces them) into buckets of about ``data_parallel.bucket_mb`` MiB, DDP's
recipe, the first of at most 1 MiB so that communication starts early in the backward.
Each bucket becomes two ops:

    %h = comm.all_reduce_start(%g1, %g2, ...)   # right after the last of its gradients
    %r1, %r2, ... = comm.wait(%h)               # right before the first reader

so a bucket travels while the backward computes the next gradients. A pipeline's gradients
are summed over micro-batches first (then the bucket runs in the ``post`` job, its
all-reduces concurrent with each other and with the updates of earlier buckets).

The results keep the old comm ops' values, so readers do not change. Any other all-reduce
of a value made well before it is read (the reported loss, read only at the end of the
step; the token count of a mean loss, made from the labels; a tensor-parallel backward's
input gradient, made before its layer's weight gradient: Megatron's asynchronous all-
reduce) likewise starts where its value is made (views of it move up to it) and is waited
for where it is read, so it does not stop the ranks in between.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Op, OpKind, Program, Role, Value
from ..ir.attrs import COMM_TEXT, MULTI
from ..ir.core import OpaqueType
from ..ir.dist import micro_batch_dim
from ..pass_infra.context import PassContext
from ..pipeline.phases import STAGE
from ..reshard.comm import BUCKET_STEPS, FOR_ROLE, RESHARD_STEP
from ..reshard.steps import AllReduce

HANDLE = OpaqueType("!comm.handle")
MIB = 1 << 20
FIRST_BUCKET = 1 * MIB   # DDP's first bucket too: the last layers' gradients leave early
EARLY = 8                # ops between a value and its first reader that make waiting later pay
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
           "aten.convolution.default", "aten.convolution_backward.default")
VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
         "aten.t.default", "aten.transpose.int", "aten.permute.default")


def bucket_collectives(program: Program, ctx: PassContext) -> Program:
    cap = bucket_bytes(ctx)
    if ctx.state.mesh is None or cap == 0:
        return program
    _hoist_views(program)
    _hoist_accumulations(program)
    position = {op: i for i, op in enumerate(program.ops)}
    first_reader = _first_readers(program, position)
    buckets = _buckets(_candidates(program, position), position, first_reader, cap)
    bucketed = {c for b in buckets for c in b.comms}
    buckets += [_Bucket([op], op.args[0].type.numel * op.args[0].type.dtype.itemsize,
                        position[op.args[0].producer], first_reader[op.outputs[0]])
                for op in _early_reductions(program, position, first_reader)
                if op not in bucketed]
    if buckets:
        program.ops = _rewrite(program.ops, buckets, position, first_reader)
    return program


def bucket_bytes(ctx: PassContext) -> float:
    """``data_parallel.bucket_mb`` in bytes (25 MiB without the section: DDP's)."""
    dp = ctx.strategy.data_parallel
    return (dp.bucket_mb if dp is not None else 25.0) * MIB


def _first_readers(program: Program, position: dict[Op, int]) -> dict[Value, int]:
    first: dict[Value, int] = {}
    for op in program.ops:
        for v in op.inputs:
            first.setdefault(v, position[op])
    return first


def _over_micro_batches(op: Op) -> bool:
    """Whether an all-reduce step is over a pipeline's micro-batch dim: accumulation over
    time on one rank, not a collective, so never bucketed."""
    return op.attrs[RESHARD_STEP].mesh_dim == micro_batch_dim(op.args[0].dist.mesh)


def _is_all_reduce(op: Op) -> bool:
    """A single all-reduce over a mesh dim of processes."""
    return (op.kind is OpKind.COMM and isinstance(op.attrs.get(RESHARD_STEP), AllReduce)
            and not _over_micro_batches(op))


def _computed_by(value: Value) -> Op | None:
    """The call that made ``value``, looking through its accumulation over micro-batches."""
    producer = value.producer
    while (producer is not None and producer.kind is OpKind.COMM
           and isinstance(producer.attrs.get(RESHARD_STEP), AllReduce)
           and _over_micro_batches(producer)):
        producer = producer.args[0].producer
    return producer if producer is not None and producer.kind is OpKind.CALL else None


def _candidates(program: Program, position: dict[Op, int]) -> list[Op]:
    """Single-step gradient all-reduces: a backward op's result (accumulated over a
    pipeline's micro-batches, if any), read by the optimizer (or clipping) only, in the
    order the backward produces the gradients."""
    found = [op for op in program.ops
             if _is_all_reduce(op) and op.attrs.get(FOR_ROLE) is Role.OPTIMIZER
             and (made := _computed_by(op.args[0])) is not None
             and made.role is Role.BACKWARD]
    return sorted(found, key=lambda op: position[op.args[0].producer])


def _early_reductions(program: Program, position: dict[Op, int],
                      first_reader: dict[Value, int]) -> list[Op]:
    """Single all-reduces of a value a call makes ``EARLY`` or more ops before anything
    reads the result."""
    return [op for op in program.ops
            if _is_all_reduce(op)
            and op.args[0].producer is not None and op.args[0].producer.kind is OpKind.CALL
            and _pays(program.ops[position[op.args[0].producer] + 1:first_reader[op.outputs[0]]])]


def _pays(between: list[Op]) -> bool:
    """Whether waiting after ``between`` (the ops from a value to its first reader) pays: many
    ops, or a matmul (a tensor-parallel backward's weight gradient, made after the input's
    gradient that is all-reduced: Megatron's asynchronous grad-input all-reduce)."""
    return len(between) > EARLY or any(op.target in MATMULS for op in between)


def _hoist_views(program: Program) -> None:
    """An all-reduce of a view of a computed value (``mm`` then ``view`` back to ``[B, T, C]``)
    can start where the value is computed: the views move right after their base's producer
    (a view computes nothing and reads only its base), so ops between, such as the weight
    gradient made after the input's gradient, overlap the collective."""
    for comm in [op for op in program.ops if _is_all_reduce(op)]:
        chain, base = [], comm.args[0]
        while (base.producer is not None and base.producer.kind is OpKind.CALL
               and base.producer.target in VIEWS and len(base.producer.inputs) == 1):
            chain.append(base.producer)
            base = base.producer.inputs[0]
        if not chain or base.producer is None:
            continue
        moved = set(chain)
        ops = [op for op in program.ops if op not in moved]
        at = ops.index(base.producer) + 1
        program.ops = ops[:at] + chain[::-1] + ops[at:]


def _hoist_accumulations(program: Program) -> None:
    """A pipeline's gradient is summed over micro-batches by its own all-reduce over ``mb``
    (the runtime adds each micro-batch's term as its job ends), placed by reshard just before
    the all-reduce over processes and the optimizer that reads it. Moved right after the
    backward op that makes the terms, every gradient of a stage is ready for a bucket in the
    order the backward makes it, not interleaved with the updates that read the previous
    one (where no bucket could hold two)."""
    sums = [op for op in program.ops
            if op.kind is OpKind.COMM and isinstance(op.attrs.get(RESHARD_STEP), AllReduce)
            and _over_micro_batches(op) and op.attrs.get(FOR_ROLE) is Role.OPTIMIZER
            and op.args[0].producer is not None and op.args[0].producer.kind is OpKind.CALL]
    after: dict[Op, list[Op]] = {}
    for op in sums:
        after.setdefault(op.args[0].producer, []).append(op)
    moved = set(sums)
    ops = []
    for op in program.ops:            # one pass: planning stays linear in the program
        if op not in moved:
            ops.append(op)
            ops += after.get(op, [])
    program.ops = ops


def _stage_of(comm: Op) -> int | None:
    """The pipeline stage whose values a comm op moves (None without a pipeline): a bucket
    is one collective, so it never mixes stages."""
    made = _computed_by(comm.args[0])
    return made.attrs.get(STAGE) if made is not None else None


@dataclass
class _Bucket:
    comms: list[Op] = field(default_factory=list)
    bytes: int = 0
    ready: int = -1          # position of the last gradient's producer
    needed: int = 1 << 62    # position of the first reader of any result

    def key(self) -> tuple:
        return _key(self.comms[0])


def _key(comm: Op) -> tuple:
    step, v = comm.attrs[RESHARD_STEP], comm.args[0]
    return step.mesh_dim, step.op, v.type.dtype, _stage_of(comm)


def _buckets(candidates: list[Op], position: dict[Op, int], first_reader: dict[Value, int],
             cap: float) -> list[_Bucket]:
    open_: dict[tuple, _Bucket] = {}
    done: list[_Bucket] = []
    for comm in candidates:
        v = comm.args[0]
        key = _key(comm)
        ready, needed = position[v.producer], first_reader[comm.outputs[0]]
        bucket = open_.get(key)
        limit = min(cap, FIRST_BUCKET) if not any(b.key() == key for b in done) else cap
        if bucket is not None and (bucket.bytes >= limit or ready >= bucket.needed):
            done.append(open_.pop(key))
        bucket = open_.setdefault(key, _Bucket())
        bucket.comms.append(comm)
        bucket.bytes += v.type.numel * v.type.dtype.itemsize
        bucket.ready, bucket.needed = max(bucket.ready, ready), min(bucket.needed, needed)
    done += open_.values()
    return [b for b in done if len(b.comms) > 1]   # a bucket of one is its own all-reduce


def _rewrite(ops: list[Op], buckets: list[_Bucket], position: dict[Op, int],
             first_reader: dict[Value, int]) -> list[Op]:
    after: dict[int, list[Op]] = {}     # ops to place right after position i
    before: dict[int, list[Op]] = {}    # ops to place right before position i
    dropped: set[Op] = set()
    for number, bucket in enumerate(buckets):
        start, wait = _pair(bucket, number)
        after.setdefault(bucket.ready, []).append(start)
        before.setdefault(bucket.needed, []).append(wait)
        dropped.update(bucket.comms)
    out: list[Op] = []
    for i, op in enumerate(ops):
        out += before.get(i, [])
        if op not in dropped:
            out.append(op)
        out += after.get(i, [])
    return out


def _pair(bucket: _Bucket, number: int) -> tuple[Op, Op]:
    comms = bucket.comms
    step = comms[0].attrs[RESHARD_STEP]
    inputs = tuple(c.args[0] for c in comms)
    handle = Value(HANDLE)
    what = "gradients" if comms[0].attrs[FOR_ROLE] is Role.OPTIMIZER else "values"
    text = f"bucket {number}: {len(comms)} {what}, {bucket.bytes / MIB:.2f} MiB, {step}"
    start = Op(OpKind.COMM, "comm.all_reduce_start", inputs, outputs=[handle],
               role=Role.COMM, module=comms[-1].module,
               attrs={COMM_TEXT: text, BUCKET_STEPS: tuple(c.attrs[RESHARD_STEP] for c in comms),
                      FOR_ROLE: comms[0].attrs[FOR_ROLE]})
    start.needs = tuple(v.dist for v in inputs)
    handle.producer, handle.index = start, 0
    results = [c.outputs[0] for c in comms]
    wait = Op(OpKind.COMM, "comm.wait", (handle,), outputs=results, role=Role.COMM,
              module=comms[0].module, attrs={COMM_TEXT: f"bucket {number}", MULTI: True,
                                             FOR_ROLE: comms[0].attrs[FOR_ROLE]})
    for index, v in enumerate(results):
        v.producer, v.index = wait, index
    return start, wait
