"""One pipeline job as a program: the ops a ``RankJobs`` gives the job, each as a rank runs
it for one micro-batch (``partition``'s local call and types, made op by op: a job copies
only its own ops), with explicit IR for everything that crosses the job's edge:

    %3: f32[2,16,32] = input '%136'                  # kept by an earlier job of this rank
    %4: f32[2,16,32] = comm.recv() {step='%233 mb0 from rank 1 (B0@s1)'}
    autopar.set_rng_state(%9)                         # a random op draws what eager draws
    comm.send(%40) {step='%136 mb0 to rank 1 (F0@s1)'}
    output carry[%136]=..., accumulate[%439]=...

So a job dumps, verifies and compiles like any program. Reductions over micro-batches run
in the runtime between jobs; a micro-batch's own slice or term of a value replicated over
micro-batches (a ``comm`` step over ``mb`` that moves no data) becomes a local call.
"""
from __future__ import annotations

from typing import Sequence

from ..ir import Op, OpKind, Program, Role, Slot, Value
from ..ir.attrs import COMM_TEXT, LOCAL_NOTE, NAME, SLOTS, Attr
from ..ir.dist import ProcessMesh, micro_batch_dim
from ..ir.kernels.generator_state import RNG_STATE
from ..ir.ops import draws_random
from ..pipeline.jobs import MESSAGE, JobId, PipelineJobs, RankJobs
from ..pipeline.phases import Phase
from ..reshard.comm import RESHARD_STEP
from ..reshard.steps import MakePartial, Slice
from .partition import local_form, local_type

GLOBAL_OP: Attr[Op] = Attr("global_op", Op, "a job's comm op: the global op it was cut from")


def job_program(program: Program, mesh: ProcessMesh, coordinate: tuple[int, ...],
                by_key: dict[str, Value], plan: PipelineJobs, rank: RankJobs, job: JobId
                ) -> Program:
    """The program of ``job`` on the process of ``rank`` at ``coordinate`` of the logical
    ``mesh``, its last entry the job's micro-batch (any for a once-a-step job): its ops of
    the global ``program`` as that process runs them (``partition``'s local calls and
    types), cut op by op so no other op is copied. ``by_key``: the global values by name
    (``plan.names`` turned round)."""
    return _JobBuilder(program, mesh, coordinate, by_key, plan, rank, job).build()


class _JobBuilder:
    def __init__(self, program: Program, mesh: ProcessMesh, coordinate: tuple[int, ...],
                 by_key: dict[str, Value], plan: PipelineJobs, rank: RankJobs, job: JobId):
        self.program, self.mesh, self.coordinate = program, mesh, coordinate
        self.keys, self.by_key_global = plan.names, by_key
        self.plan, self.rank, self.job = plan, rank, job
        self.out = Program()
        self.remap: dict[Value, Value] = {}     # global values to the job's
        self.by_key: dict[str, Value] = {}      # new values by key, once made
        self.mb = micro_batch_dim(plan.layout.logical_mesh)

    def build(self) -> Program:
        """The job's program (verified where lowering checks what it made)."""
        indices = self.rank.ops[self.job]
        self.waiting: dict[int, list] = {}      # by destination: sends in posting order
        for message in self.rank.sent.get(self.job, ()):
            self.waiting.setdefault(message.dst, []).append(message)
        self.sent_keys = {m.key for queue in self.waiting.values() for m in queue}
        self.ready: dict[str, Value] = {}
        recvs = {m.key: m for m in self.rank.received.get(self.job, ())}
        for key, _ in self.rank.carried_in.get(self.job, ()):
            self._carried(key)
        for op in (self.program.ops[i] for i in indices):
            if op.kind is OpKind.OUTPUT:
                continue
            for v in op.inputs:
                key = self.keys[v]
                if key in recvs and key not in self.by_key:
                    self._receive(recvs.pop(key))
            self._copy(op)
        for message in recvs.values():     # for the results, or for a later job of this rank
            self._receive(message)
        self._finish()
        return self.out

    def _local_type(self, op: Op, v: Value):
        return local_type(op, v, self.mesh, self.coordinate) if v.is_tensor else v.type

    # -- values entering the job ---------------------------------------------------------
    def _carried(self, key: str) -> None:
        v = self.by_key_global[key]
        op = Op(OpKind.INPUT, "input", outputs=[Value(self._local_type(v.producer, v))],
                role=Role.COMM,
                attrs={NAME: key})
        self._made(self.out.add(op).result, v, key)
        self._send(key, op.result)

    def _receive(self, message) -> None:
        v = self.by_key_global[message.key]
        op = Op(OpKind.COMM, "comm.recv", (), outputs=[Value(self._local_type(v.producer, v))],
                role=Role.COMM,
                attrs={COMM_TEXT: f"{message.key}{_mb(message)} from rank {message.src} "
                               f"({message.src_job})", MESSAGE: message})
        self._made(self.out.add(op).result, v, message.key)

    def _made(self, new: Value, old: Value, key: str) -> None:
        new.dist, new.why = old.dist, old.why
        self.remap[old] = new
        self.by_key[key] = new

    # -- the job's own ops -----------------------------------------------------------------
    def _copy(self, op: Op) -> None:
        """``op`` of the global program as this process runs it."""
        if op.kind is OpKind.CALL and draws_random(op):
            self._restore_rng(op)
        target, args, kwargs, kind, attrs = op.target, op.args, op.kwargs, op.kind, dict(op.attrs)
        call = local_form(op, self.mesh, self.coordinate) if kind is OpKind.CALL else None
        if call is not None:
            target, args, kwargs = call.target, tuple(call.args), dict(call.kwargs)
            if call.note:
                attrs[LOCAL_NOTE] = call.note
        local_step = self._micro_batch_step(op)
        if local_step is not None:
            kind, (target, args, kwargs) = OpKind.CALL, local_step
            attrs = {LOCAL_NOTE: attrs.get(COMM_TEXT, "")}
        if kind is OpKind.COMM:
            attrs[GLOBAL_OP] = op           # collectives are bound from the global op's types
        new = Op(kind, target, args, dict(kwargs),
                 [Value(self._local_type(op, v)) for v in op.outputs],
                 op.role, op.module, None, attrs)
        new.needs = op.needs
        new.map_inputs(self._input)
        self.out.add(new)
        for old_v, new_v in zip(op.outputs, new.outputs):
            self._made(new_v, old_v, self.keys[old_v])
        for old_v, new_v in zip(op.outputs, new.outputs):
            self._send(self.keys[old_v], new_v)

    def _input(self, v: Value) -> Value:
        if v not in self.remap:
            raise RuntimeError(f"pipeline job {self.job} of rank {self.rank.rank}: "
                               f"{self.keys[v]} ({v.producer.target}) is neither made in the "
                               "job, kept from an earlier one nor received")
        return self.remap[v]

    def _micro_batch_step(self, op: Op):
        """A step over ``mb`` that moves no data, as this micro-batch's local call."""
        step = op.attrs.get(RESHARD_STEP) if op.kind is OpKind.COMM else None
        if step is None or step.mesh_dim != self.mb:
            return None
        k, m = self.job.micro_batch, self.plan.layout.micro_batches
        if isinstance(step, Slice):
            return "autopar.micro_batch_slice", (op.args[0], step.tensor_dim, m, k,
                                                  step.groups), {}
        if isinstance(step, MakePartial):
            return "autopar.micro_batch_term", (op.args[0], step.op, k), {}
        raise ValueError(f"{op.attrs.get(COMM_TEXT, op.target)} in job {self.job}: a reduction "
                         "over micro-batches runs between jobs, not in one")

    def _restore_rng(self, global_op: Op) -> None:
        """Set the generator to the state eager has at this random op (``runtime.seeding``); a
        recomputed one's (passes/recompute.py) is its original's, so it redraws the same."""
        key = self.plan.names[(global_op.recomputes or global_op).outputs[0]]
        state = self.out.add(Op(OpKind.INPUT, "input", outputs=[Value(RNG_STATE)],
                                role=Role.COMM, attrs={NAME: f"rng/{key}"})).result
        self.out.add(Op(OpKind.CALL, "autopar.set_rng_state", (state,), outputs=[],
                        role=global_op.role, module=global_op.module))

    def _send(self, key: str, value: Value) -> None:
        """Send ``value`` where the job sends it, each pair's messages in the order both
        ranks post them (``Message.order``): a send first posts every earlier message of its
        pair, so one whose value comes later in the job (a sum read from the store comes
        first) waits for the earlier ones' values."""
        if key not in self.sent_keys:
            return
        self.ready[key] = value
        for queue in self.waiting.values():
            while queue and queue[0].key in self.ready:
                message = queue.pop(0)
                self.out.add(Op(OpKind.COMM, "comm.send", (self.ready[message.key],),
                                outputs=[], role=Role.COMM,
                                attrs={COMM_TEXT: f"{message.key}{_mb(message)} to rank "
                                                  f"{message.dst} ({message.dst_job})",
                                       MESSAGE: message}))

    # -- what leaves the job ---------------------------------------------------------------
    def _finish(self) -> None:
        if any(self.waiting.values()):
            missing = ", ".join(sorted({m.key for queue in self.waiting.values()
                                        for m in queue if m.key not in self.ready}))
            raise RuntimeError(f"pipeline job {self.job} of rank {self.rank.rank} is to send "
                               f"{missing} but never has it")
        results: list[tuple[Slot, Value]] = []
        for key in self.rank.kept.get(self.job, ()):
            results.append((Slot("carry", key), self.by_key[key]))
        for key in self.rank.accumulated.get(self.job, ()):
            results.append((Slot("accumulate", key), self.by_key[key]))
        if self.job.phase is Phase.POST:
            results += [(slot, self.by_key[key]) for slot, key in self.rank.results]
        self.out.add(Op(OpKind.OUTPUT, "output", tuple(v for _, v in results),
                        attrs={SLOTS: tuple(s for s, _ in results)}))


def _mb(message) -> str:
    return "" if message.micro_batch < 0 else f" mb{message.micro_batch}"


def random_ops(program: Program) -> Sequence[Op]:
    """The ops of the global program that draw random numbers, in program order, as eager
    draws them: once each (a recomputed clone redraws its original's state)."""
    return [op for op in program.ops
            if op.kind is OpKind.CALL and op.recomputes is None and draws_random(op)]


__all__ = ["job_program", "random_ops", "RNG_STATE", "GLOBAL_OP"]
