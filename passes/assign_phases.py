"""Assign phases: where (which stage) and when (which phase) every op of the planned program
runs, as ``op.attrs[HOMES]``; lowering cuts each pipeline rank's jobs out of these.

What varies per micro-batch is read off the data flow: everything computed from the batch
inputs, up to the reductions over the ``mb`` mesh dim (``comm.all_reduce`` /
``comm.all_gather`` over ``mb``: gradient accumulation, the summed loss, gathered outputs).
Those reductions are the *boundaries* between the per-micro-batch jobs and the once-a-step
phases. Then:

* forward and loss ops run on the stage ``split_stages`` gave them, in ``F``; backward ops
  on their forward op's stage, in ``B`` (``W`` for the weight-grad part when the schedule
  splits the backward: whatever no input gradient sent to an earlier stage needs);
* every other op runs where its inputs are (a collective next to the value it moves, a
  gradient norm next to the gradient), or, when it reads only parameters, inputs and
  constants, on every stage that needs it (each stage holding a tied weight updates its own
  copy; an input-derived mask is recomputed rather than sent);
* once-a-step values the micro-batches read (a transposed weight, a mean loss's token
  count) run in ``pre``, the micro-batch pieces of such a count in ``pre_mb``; the rest in
  ``post``.

Every value one stage reads from another must flow the way a pipeline runs: forward values
to later stages, backward values to earlier ones, once-a-step values anywhere. An op that
needs otherwise (a BatchNorm-like statistic of the whole batch in the middle of the
forward) is refused, naming it.
"""
from __future__ import annotations

from ..ir import Op, OpKind, Program, Role, StateKind, Value
from ..ir.attrs import COMM_TEXT, NAME, SLOTS, STATE
from ..ir.dist import micro_batch_dim
from ..ir.kernels.offload import before_copies
from ..ir.printer import value_names
from ..pass_infra.context import PassContext
from ..pipeline.phases import BOUNDARY, HOMES, STAGE, Home, Homes, Phase
from ..pipeline.schedules import splits_backward
from ..reshard.comm import BUCKET_STEPS, FOR_TARGET, RESHARD_STEP
from ..reshard.steps import AllGather, AllReduce, MakePartial, Slice
from ..spmd import lookup

# How a refusal of a whole-batch read ends: in general, for a batch norm, for a loss.
_BATCH_NORM_HINT = ("; or normalize each micro-batch by its own statistics, as "
                    "torch.distributed.pipelining does: pipeline.batch_norm: per_micro_batch")
_WHOLE_BATCH = (
    ": a statistic of the whole batch (like BatchNorm's), an op without a rule, or a reshape "
    "that merges the batch dim into a dim before it cannot work on a micro-batch's rows; use "
    "pipeline.micro_batches: 1, or give the op a rule / keep the batch dim leading")
_NO_RULE = (
    ": {} has no SPMD rule, so it runs replicated, on the whole batch, which a micro-batch "
    "never holds; add a rule in autopar/spmd/rules/ (debug.strict_rules: true names every "
    "such op), or use pipeline.micro_batches: 1")
_COUPLED_LOSS = (
    ": the loss couples micro-batches (it reads every row of the batch, as a contrastive "
    "a @ b.T with arange(batch) targets does): a loss per micro-batch would change the math "
    "(each micro-batch its own negatives), and a loss of the gathered batch needs every "
    "micro-batch's forward before any backward, which no pipeline schedule runs. Exact "
    "alternatives: pipeline: {schedule: FThenB, micro_batches: 1}, or data_parallel; or "
    "write the loss per micro-batch yourself if that is the objective you mean")


class PipelineError(ValueError):
    """The program cannot run as the pipeline the strategy asks for."""


def assign_phases(program: Program, ctx: PassContext) -> Program:
    if ctx.state.pipeline is None:
        return program
    _PhaseAssignment(program, ctx).run()
    return program


class _PhaseAssignment:
    def __init__(self, program: Program, ctx: PassContext):
        self.program, self.layout = program, ctx.state.pipeline
        self.mb = micro_batch_dim(ctx.state.mesh)
        self.many = self.layout.micro_batches > 1
        self.users = program.users()
        self.per_mb: set[Value] = set()
        self.where: dict[Op, frozenset[int]] = {}     # stage sets of placed ops
        self.phase: dict[Op, Phase] = {}
        self.names = value_names(program)

    def run(self) -> None:
        self._mark_boundaries()
        self._mark_per_micro_batch()
        self._anchor()
        self._place_optimizer()
        self._push()
        self._pull()
        self._step_phases()
        homes = self._homes()
        if splits_backward(self.layout.schedule):
            self._split_weight_grads(homes)
        self._read_where_needed(homes)
        for op, found in homes.items():
            op.attrs[HOMES] = Homes(found)
        self._check_flows()

    # -- what varies per micro-batch ---------------------------------------------------------
    def _mb_step(self, op: Op):
        step = op.attrs.get(RESHARD_STEP)
        return step if step is not None and step.mesh_dim == self.mb else None

    def _mark_boundaries(self) -> None:
        for op in self.program.ops:
            if op.kind is not OpKind.COMM:
                continue
            steps = op.attrs.get(BUCKET_STEPS) or (op.attrs.get(RESHARD_STEP),)
            if any(s is not None and s.mesh_dim == self.mb for s in steps) and len(steps) > 1:
                raise PipelineError(f"{op.target} ({op.module or '-'}) bundles a reduction "
                                    "over micro-batches with other collectives")
            step = self._mb_step(op)
            if step is None or isinstance(step, (Slice, MakePartial)):
                continue      # a micro-batch's own slice or term: local to its job
            if not isinstance(step, (AllReduce, AllGather)):
                raise PipelineError(
                    f"{op.attrs.get(COMM_TEXT, op.target)} ({op.module or '-'}, for "
                    f"{op.attrs.get(FOR_TARGET, '?')}) moves data between micro-batches; a "
                    "pipeline can only sum or gather a value over every micro-batch")
            op.attrs[BOUNDARY] = step

    def _varies(self, v: Value) -> bool:
        """A value's placement says it differs between micro-batches (sharded or a term)."""
        return (self.many and v.is_tensor and v.dist is not None
                and not v.dist.placements[self.mb].is_replicate())

    def _mark_per_micro_batch(self) -> None:
        for op in self.program.ops:
            if op.kind is OpKind.INPUT:
                batch = op.attrs[NAME].startswith("batch/")
                if batch and (not self.many or self._varies(op.result)):
                    self.per_mb.add(op.result)
            elif op.kind in (OpKind.CALL, OpKind.COMM) and op.role is not Role.OPTIMIZER \
                    and BOUNDARY not in op.attrs:
                if any(v in self.per_mb for v in op.inputs) or any(map(self._varies, op.outputs)):
                    self.per_mb.update(op.outputs)

    def _is_per_mb(self, op: Op) -> bool:
        return bool(op.outputs) and op.outputs[0] in self.per_mb

    # -- stages: anchors, then near the inputs, then near the consumers -------------------------
    def _anchor(self) -> None:
        """Forward, loss and backward ops run on the stage ``split_stages`` gave them."""
        for op in self.program.ops:
            if STAGE in op.attrs:
                self.where[op] = frozenset({op.attrs[STAGE]})
                self._set_phase(op)

    def _set_phase(self, op: Op) -> None:
        phase = self._own_phase(op)
        if phase is not None:
            self.phase[op] = phase

    def _push(self) -> None:
        """An op reading placed values runs with them."""
        for op in self.program.ops:
            if op.kind in (OpKind.INPUT, OpKind.STATE, OpKind.OUTPUT) or op in self.where:
                continue
            placed = [v.producer for v in op.inputs if v.producer in self.where]
            if not placed:
                continue                                  # pulled later, from its consumers
            self._set_phase(op)
            common = frozenset.intersection(*(self.where[p] for p in placed))
            if common:
                self.where[op] = common
            elif self._is_per_mb(op):
                # forward values go on to later stages, backward ones back to earlier ones
                stages = [s for p in placed for s in self.where[p]]
                self.where[op] = frozenset({max(stages) if self.phase[op] is Phase.F
                                            else min(stages)})

    def _own_phase(self, op: Op) -> Phase | None:
        """F or B for a per-micro-batch op (its role, or the latest phase it reads)."""
        if not self._is_per_mb(op):
            return None
        if op.role is Role.BACKWARD:
            return Phase.B
        if op.role in (Role.FORWARD, Role.LOSS) and op.kind is OpKind.CALL:
            return Phase.F
        seen = [self.phase.get(v.producer) for v in op.inputs if v in self.per_mb]
        return Phase.B if Phase.B in seen else Phase.F

    def _place_optimizer(self) -> None:
        """An optimizer update runs on every stage that uses its parameter (a tied weight on
        two stages is updated on both, from the same gradient)."""
        for op in self.program.ops:
            if op.kind is OpKind.CALL and op.target.startswith("optim."):
                param = before_copies(op.args[0])     # offload copies it to the host
                while param.producer.target.startswith("comm."):   # ZeRO slices it first
                    param = before_copies(param.producer.args[0])
                stages = self._stages_using(param)
                if not stages:
                    raise PipelineError(f"{op.target} ({op.module or '-'}): its parameter is "
                                        "read by no forward or backward op of any stage")
                self.where[op] = stages

    def _stages_using(self, value: Value) -> frozenset[int]:
        found, todo, seen = set(), [value], set()
        while todo:
            v = todo.pop()
            for user in self.users.get(v, ()):
                if user.role is Role.OPTIMIZER or user.kind is OpKind.OUTPUT or user in seen:
                    continue
                seen.add(user)
                if user in self.where:
                    found |= self.where[user]
                else:
                    todo.extend(user.outputs)
        return frozenset(found)

    def _pull(self) -> None:
        """What reads only parameters, inputs and constants runs on every stage that needs it."""
        everywhere = frozenset(range(self.layout.stages))
        for op in reversed(self.program.ops):
            if op in self.where:
                continue
            if op.kind is OpKind.OUTPUT:
                self.where[op] = everywhere
                continue
            stages: set[int] = set()
            for v in op.outputs:
                for user in self.users.get(v, ()):
                    stages |= self._demand(user, v, everywhere)
            self.where[op] = frozenset(stages) or everywhere
            self._set_phase(op)

    def _demand(self, user: Op, value: Value, everywhere: frozenset[int]) -> frozenset[int]:
        """Stages where ``user`` reads ``value``: the output op reads an updated state where
        the state lives, and the loss and model outputs on every stage. A state not placed
        yet (no optimizer update places it: loss scaling's scale, which every stage's
        unscale reads) is updated on every stage, each from the same values."""
        if user.kind is not OpKind.OUTPUT:
            return self.where[user]
        stages: set[int] = set()
        for slot, v in zip(user.attrs[SLOTS], user.args):
            if v is value:
                stages |= (self.where.get(self._state(slot.name), everywhere)
                           if slot.kind == "update" else everywhere)
        return frozenset(stages)

    def _state(self, name: str) -> Op:
        return next(op for op in self.program.ops
                    if op.kind is OpKind.STATE and op.attrs[NAME] == name)

    # -- phases -----------------------------------------------------------------------------
    def _step_phases(self) -> None:
        """Once-a-step ops: ``pre`` if a micro-batch job reads them (directly or not), else
        ``post``."""
        early: set[Op] = set()
        for op in reversed(self.program.ops):
            if op.kind is OpKind.OUTPUT or op in self.phase:
                continue
            needed = any(u in early or (self._is_per_mb(u) and BOUNDARY not in u.attrs)
                         for v in op.outputs for u in self.users.get(v, ()))
            if needed:
                early.add(op)
            self.phase[op] = Phase.PRE if needed else Phase.POST

    def _homes(self) -> dict[Op, set[Home]]:
        homes: dict[Op, set[Home]] = {}
        for op in self.program.ops:
            if op.kind in (OpKind.INPUT, OpKind.STATE):
                continue
            phase = Phase.POST if op.kind is OpKind.OUTPUT else self.phase[op]
            homes[op] = {(s, phase) for s in self.where[op]}
        for boundary in (op for op in self.program.ops
                         if BOUNDARY in op.attrs and self.phase[op] is Phase.PRE):
            self._before_schedule(boundary, homes)
        return homes

    def _read_where_needed(self, homes: dict[Op, set[Home]]) -> None:
        """Inputs and state are read in every job that uses them."""
        for op in self.program.ops:
            if op.kind in (OpKind.INPUT, OpKind.STATE):
                homes[op] = {h for u in self.users.get(op.result, ()) for h in homes.get(u, ())}

    def _before_schedule(self, boundary: Op, homes: dict[Op, set[Home]]) -> None:
        """A value reduced over micro-batches that the micro-batches themselves read (a mean
        loss's token count): its per-micro-batch terms are computed before the schedule.
        They may read only inputs and constants, never what a stage computes."""
        todo, cone = [boundary.args[0]], set()
        while todo:
            v = todo.pop()
            op = v.producer
            if v not in self.per_mb or op.kind is OpKind.INPUT or op in cone:
                continue
            cone.add(op)
            if any(u.producer.kind is OpKind.STATE
                   and u.producer.attrs[STATE].kind is StateKind.PARAM for u in op.inputs):
                raise PipelineError(self._whole_batch_message(boundary, op))
            homes[op] |= {(s, Phase.PRE_MB) for s, _ in homes[op]}
            todo.extend(op.inputs)
        for op in cone:     # made only for the reduction: not again in the schedule's jobs
            if all(u in cone or BOUNDARY in u.attrs for v in op.outputs
                   for u in self.users.get(v, ())):
                homes[op] = {(s, Phase.PRE_MB) for s, _ in homes[op]}

    def _whole_batch_message(self, boundary: Op, op: Op) -> str:
        """Why ``boundary``'s reader cannot have the whole batch of what ``op`` computes."""
        reader = boundary.attrs.get(FOR_TARGET, "an op")
        head = (f"{reader} ({boundary.module or 'top level'}) needs the whole batch, "
                f"{boundary.attrs[COMM_TEXT]}, of a value {_describe(op)} computes while the "
                "pipeline runs")
        readers = [u for v in boundary.outputs for u in self.users.get(v, ())]
        unruled = sorted({u.target for u in readers if u.kind is OpKind.CALL and lookup(u) is None})
        if unruled:
            return head + _NO_RULE.format(", ".join(unruled))
        if any(u.role is Role.LOSS for u in readers):
            return head + _COUPLED_LOSS
        return head + _WHOLE_BATCH + (_BATCH_NORM_HINT if "batch_norm" in reader else "")

    def _split_weight_grads(self, homes: dict[Op, set[Home]]) -> None:
        """ZB-H1: a stage's B job keeps what the input gradients it sends to earlier stages
        need; the rest of its backward (weight gradients) becomes the W job."""
        backward = {op: {s for s, p in h if p is Phase.B} for op, h in homes.items()}
        for stage in range(self.layout.stages):
            ops = [op for op, h in homes.items() if (stage, Phase.B) in h]
            keep: set[Op] = set()
            todo = [op for op in ops if any(
                s < stage for v in op.outputs for u in self.users.get(v, ())
                for s in backward.get(u, ()))]
            while todo:
                op = todo.pop()
                if op in keep or (stage, Phase.B) not in homes.get(op, ()):
                    continue
                keep.add(op)
                todo.extend(v.producer for v in op.inputs if v.producer is not None)
            for op in ops:
                if op not in keep:
                    homes[op] = (homes[op] - {(stage, Phase.B)}) | {(stage, Phase.W)}

    # -- checks ---------------------------------------------------------------------------------
    def _check_flows(self) -> None:
        for op in self.program.ops:
            if op.kind is OpKind.OUTPUT:
                continue
            for stage, phase in op.attrs[HOMES]:
                for v in op.inputs:
                    if v.producer is not None and v.producer.kind not in (OpKind.INPUT,
                                                                          OpKind.STATE):
                        self._check_flow(v, op, stage, phase)

    def _check_flow(self, v: Value, op: Op, stage: int, phase: Phase) -> None:
        sources = op_homes = v.producer.attrs[HOMES]
        local = [p for s, p in op_homes if s == stage]
        if local:
            sources = [(stage, p) for p in local]
        if any(_may_flow(self.many, source, (stage, phase), BOUNDARY in op.attrs)
               for source in sources):
            return
        if BOUNDARY in op.attrs:
            raise PipelineError(f"pipeline: {op.attrs[COMM_TEXT]} on stage {stage} would sum "
                                f"micro-batch terms made on another stage ({_describe(op)})")
        src = ", ".join(f"stage {s} {p}" for s, p in op_homes)
        raise PipelineError(
            f"pipeline: {_describe(op)} on stage {stage} ({phase}) reads "
            f"{self.names.get(v, '?')} made by {_describe(v.producer)} on {src}: a pipeline "
            "sends forward values to later stages and gradients to earlier ones; check "
            "pipeline.split (layers used out of order, or a value shared across stages)")


def _may_flow(many: bool, source: Home, target: Home, into_boundary: bool) -> bool:
    """Whether a value made at ``source`` can be read at ``target`` in a pipelined step."""
    (s, p), (t, q) = source, target
    if not p.per_micro_batch:                   # once-a-step values: before or after
        return p is Phase.PRE or q is Phase.POST
    if not q.per_micro_batch:                   # a micro-batch's value read once a step:
        return (into_boundary and s == t) or not many   # only as a term of its reduction
    if p is Phase.PRE_MB:
        return True
    if s == t:
        return p.order <= q.order and q is not Phase.PRE_MB
    if p is Phase.F and q is Phase.F:
        return s < t
    if p is Phase.B and q in (Phase.B, Phase.W):   # W(t) follows B(t), which follows B(s)
        return s > t
    return p is Phase.F and q in (Phase.B, Phase.W)


def _describe(op: Op) -> str:
    return f"{op.target.removesuffix('.default')} ({op.module or 'top level'} {op.role.value})"


__all__ = ["assign_phases", "PipelineError"]
