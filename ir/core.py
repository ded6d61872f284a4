"""The autopar IR: a Program is a flat list of Ops over SSA Values.

Few closed op kinds, open op targets (the lesson of torch.fx): the kind says how an op
enters or leaves the program, the target names the computation as data
(``aten.mm.default``, ``optim.adam``, later ``comm.all_reduce``). Passes are plain functions
over these classes; nothing here knows about parallelism except the empty ``dist`` slot that
completion fills.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from .attrs import (  # noqa: F401
    CONST,
    FILL,
    NAME,
    SLOTS,
    STATE,
    Attr,
    Slot,
    StateKey,
    StateKind,
    check_attrs,
)

if TYPE_CHECKING:
    from .dist_attr import DistAttr
    from .reason import Reason


class OpKind(str, enum.Enum):
    INPUT = "input"    # fed per step: a batch tensor, a label, optimizer hyper-parameters
    STATE = "state"    # lives across steps: parameter, buffer, constant, optimizer state
    CALL = "call"      # a computation, target names it
    COMM = "comm"      # communication inserted by reshard (later issues)
    OUTPUT = "output"  # the single terminator; its slots say what each result means


class Role(str, enum.Enum):
    FORWARD = "fwd"
    LOSS = "loss"
    BACKWARD = "bwd"
    OPTIMIZER = "opt"
    COMM = "comm"


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"{dtype_abbrev(self.dtype)}[{dims}]"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class OpaqueType:
    """A non-tensor runtime value: optimizer hyper-parameters, a possibly absent buffer."""

    name: str

    def __str__(self) -> str:
        return self.name


ValueType = TensorType | OpaqueType

_DTYPE_ABBREV = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "i1", torch.complex64: "c64",
}


def dtype_abbrev(dtype: torch.dtype) -> str:
    return _DTYPE_ABBREV.get(dtype, str(dtype).removeprefix("torch."))


class Value:
    """An SSA value. ``dist`` is its placement, which completion fills (None: not placed,
    or a serial program); ``why`` records how it was chosen (an annotation, a rule, a
    consumer), for explain."""

    __slots__ = ("type", "producer", "index", "dist", "why")

    def __init__(self, type: ValueType, producer: "Op | None" = None, index: int = 0):
        self.type = type
        self.producer = producer
        self.index = index
        self.dist: DistAttr | None = None
        self.why: Reason | None = None

    @property
    def is_tensor(self) -> bool:
        return isinstance(self.type, TensorType)

    def __repr__(self) -> str:
        return f"Value({self.type})"


_op_ids = itertools.count()


@dataclass(eq=False)
class Op:
    """One operation. ``args``/``kwargs`` keep the call's structure with Values in place of
    tensors, so generated code calls the target exactly as the trace did."""

    kind: OpKind
    target: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: list[Value] = field(default_factory=list)
    role: Role = Role.FORWARD
    module: str = ""
    forward_op: "Op | None" = None     # for a backward op: the forward op it differentiates
    attrs: dict[Attr, Any] = field(default_factory=dict)   # typed keys (ir.attrs)
    uid: int = field(default_factory=lambda: next(_op_ids))
    # Set by completion: the placement each tensor input must have (``op.inputs`` order,
    # tensors only). Where it differs from the input's own, reshard inserts communication.
    needs: tuple = ()
    # a recomputed clone's original (passes/recompute.py): the forward op it runs again so
    # the backward need not keep its results
    recomputes: "Op | None" = None

    @property
    def inputs(self) -> list[Value]:
        # Cached against the identity of args/kwargs: passes replace them (map_inputs, or
        # assigning new ones), they never edit them in place. Passes ask this a lot.
        cached = self.__dict__.get("_inputs")
        if cached is not None and cached[0] is self.args and cached[1] is self.kwargs:
            return list(cached[2])
        found: list[Value] = []
        _collect_values(self.args, found)
        _collect_values(self.kwargs, found)
        self.__dict__["_inputs"] = (self.args, self.kwargs, tuple(found))
        return found

    @property
    def result(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"{self.target} has {len(self.outputs)} results, not one")
        return self.outputs[0]

    def map_inputs(self, fn: Callable[[Value], Value]) -> None:
        self.args = _map_values(self.args, fn)
        self.kwargs = _map_values(self.kwargs, fn)


# Op arguments are nests of tuples, lists and dicts (what an fx node's args are). Walked by
# hand: torch's pytree is general and, on programs of thousands of ops, the slow part.
def state_op(key: StateKey, type: "TensorType | OpaqueType", role: Role = Role.FORWARD,
             fill: float | None = None, attrs: dict[Attr, Any] | None = None) -> Op:
    """A STATE op reading the state ``key`` (named ``key.name``); ``fill``: what every element
    of a fresh one starts at (absent: its value comes from the model or the optimizer)."""
    extra = {FILL: float(fill)} if fill is not None else {}
    return Op(OpKind.STATE, "state", outputs=[Value(type)], role=role,
              attrs={STATE: key, NAME: key.name, **extra, **(attrs or {})})


def _collect_values(a: Any, found: list[Value]) -> None:
    if isinstance(a, Value):
        found.append(a)
    elif isinstance(a, (tuple, list)):
        for x in a:
            _collect_values(x, found)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_values(x, found)


def _map_values(a: Any, fn: Callable[[Value], Value]) -> Any:
    if isinstance(a, Value):
        return fn(a)
    if isinstance(a, (tuple, list)):
        return type(a)(_map_values(x, fn) for x in a)
    if isinstance(a, dict):
        return {k: _map_values(x, fn) for k, x in a.items()}
    return a


class Program:
    """An ordered list of ops ending in one OUTPUT op; order is a valid execution order."""

    def __init__(self, ops: Iterable[Op] = ()):
        self.ops: list[Op] = list(ops)

    # -- construction -------------------------------------------------------------------
    def add(self, op: Op) -> Op:
        """Append ``op``; once the program has its output op, new ops go just before it."""
        for i, v in enumerate(op.outputs):
            v.producer, v.index = op, i
        if self.ops and self.ops[-1].kind is OpKind.OUTPUT and op.kind is not OpKind.OUTPUT:
            self.ops.insert(len(self.ops) - 1, op)
        else:
            self.ops.append(op)
        return op

    def add_call(self, target: str, args: tuple, out_types: list[ValueType], *,
                 role: Role, module: str = "", kwargs: dict | None = None,
                 forward_op: Op | None = None, attrs: dict[Attr, Any] | None = None) -> Op:
        op = Op(OpKind.CALL, target, args, kwargs or {}, [Value(t) for t in out_types],
                role, module, forward_op, dict(attrs or {}))
        return self.add(op)

    def relink_forward_ops(self, replaced: dict["Op", "Op"]) -> None:
        """Backward ops that differentiate a replaced forward op now point at the op that
        makes its result (a pass that decomposes a forward op keeps the links whole)."""
        for op in self.ops:
            if op.forward_op in replaced:
                op.forward_op = replaced[op.forward_op]

    def insert_after(self, anchor: Op, op: Op) -> Op:
        for i, v in enumerate(op.outputs):
            v.producer, v.index = op, i
        self.ops.insert(self.ops.index(anchor) + 1, op)
        return op

    # -- queries --------------------------------------------------------------------------
    @property
    def output_op(self) -> Op:
        op = self.ops[-1]
        if op.kind is not OpKind.OUTPUT:
            raise ValueError("program does not end in an output op")
        return op

    def results(self) -> list[tuple[Slot, Value]]:
        out = self.output_op
        return list(zip(out.attrs[SLOTS], out.args))

    def result(self, kind: str, name: str = "") -> Value:
        for slot, value in self.results():
            if slot == Slot(kind, name):
                return value
        raise KeyError(f"program has no result {Slot(kind, name)}")

    def ops_of(self, kind: OpKind) -> Iterator[Op]:
        return (op for op in self.ops if op.kind is kind)

    def states(self, state_kind: StateKind | None = None) -> list[Op]:
        return [op for op in self.ops_of(OpKind.STATE)
                if state_kind is None or op.attrs[STATE].kind is state_kind]

    def users(self) -> dict[Value, list[Op]]:
        table: dict[Value, list[Op]] = {}
        for op in self.ops:
            for v in op.inputs:
                table.setdefault(v, []).append(op)
        return table

    def set_results(self, results: list[tuple[Slot, Value]]) -> None:
        out = self.output_op
        out.attrs[SLOTS] = tuple(s for s, _ in results)
        out.args = tuple(v for _, v in results)

    # -- copying --------------------------------------------------------------------------
    def copy(self) -> "Program":
        """A structural copy: new Ops and Values, same targets and attributes. Passes that
        specialise a program (per rank, per stage) start from one."""
        remap: dict[Value, Value] = {}
        copied = Program()
        for op in self.ops:
            new = Op(op.kind, op.target, op.args, dict(op.kwargs),
                     [Value(v.type) for v in op.outputs], op.role, op.module,
                     op.forward_op, dict(op.attrs))
            new.map_inputs(lambda v: remap[v])
            new.needs = op.needs
            for old_v, new_v in zip(op.outputs, new.outputs):
                new_v.dist, new_v.why = old_v.dist, old_v.why
                remap[old_v] = new_v
            copied.add(new)
        forward_map = {old.uid: new for old, new in zip(self.ops, copied.ops)}
        for old, new in zip(self.ops, copied.ops):
            if new.forward_op is not None:
                new.forward_op = forward_map.get(new.forward_op.uid)
            if old.recomputes is not None:
                new.recomputes = forward_map.get(old.recomputes.uid)
        return copied
