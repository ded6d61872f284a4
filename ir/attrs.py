"""Typed op attributes: what an op carries besides its target and operands.

An attribute key is an ``Attr``: a name, the type its values must have, and how dumps show
it. Keys are objects, not strings (``op.attrs[STAGE]``), declared once next to the type they
carry: the IR's own below, the reshard steps a comm op runs in ``reshard/comm.py``, a
pipeline op's stage and homes in ``pipeline/phases.py``, a pipeline message in
``pipeline/jobs.py``. The verifier checks every attribute of every op against its key,
so a pass cannot hand a later one an untyped value.

The values some of them carry are declared here too: ``StateKind``, ``StateKey`` and
``Slot``.

What the IR itself records:

* ``NAME``, ``STATE``, ``FILL`` — an input's or a state's name, what the state is
  (``StateKey``) and, for state that starts at a constant, that constant;
* ``SLOTS`` — what each result of the output op means;
* ``CONST`` — the value of a constant state (a tensor the trace baked in);
* ``MULTI`` — the kernel returns a sequence (even of one value);
* ``STRIDES`` — a random op's traced output strides (its draws follow the memory layout);
* ``INPUT_LAYOUT`` — an ``as_strided`` op's traced input layout (it reads memory, not values);
* ``DIST``, ``PINNED_DIMS``, ``ORIGIN`` — a placement annotation op's placement, the mesh
  dims it pins (all when absent) and who made it;
* ``COMM_TEXT`` — a comm op's collective in words, for dumps;
* ``LOCAL_NOTE`` — why a rank's call differs from the global one;
* ``DECOMPOSES`` — which fused op a decomposition replaced;
* ``ON_HOST`` — a state kept in host memory (``sharding.offload``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

import torch

from .dist_attr import DistAttr

__all__ = ["StateKind", "StateKey", "Slot", "SLOT_KINDS", "Attr", "AttrError", "NAME",
           "BATCH_PATH", "REGROUP_DIMS", "STATE", "FILL", "SLOTS", "CONST", "MULTI", "STRIDES",
           "INPUT_LAYOUT", "DIST", "PINNED_DIMS", "ORIGIN", "COMM_TEXT", "LOCAL_NOTE",
           "DECOMPOSES", "ON_HOST", "check_attrs"]

T = TypeVar("T")


class StateKind(str, enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    CONST = "const"
    OPTIM = "optim"
    GRAD_MERGE = "grad_merge"   # a gradient-merge accumulator (passes/merge_gradients.py)
    SCALER = "scaler"           # loss scaling's scale and growth tracker (passes/scale_loss.py)


@dataclass(frozen=True)
class StateKey:
    """What a STATE op reads, typed: its kind, the parameter it belongs to and its own key.
    ``name`` is the program's name for it (dumps, the runtime's state dicts); nothing
    splits a name to recover the rest. Made by capture and the passes that declare state,
    carried by lowering into each process's ``StatePiece``.

    * ``PARAM`` / ``BUFFER``: ``param`` is the module path (``blocks.0.fc1.weight``);
    * ``OPTIM``: the optimizer state ``key`` (torch's ``exp_avg``) of parameter ``param``;
    * ``GRAD_MERGE``: the gradient-merge accumulator of parameter ``param``;
    * ``SCALER``: loss scaling's ``key`` (``loss_scale``, ``growth_tracker``);
    * ``CONST``: a constant the trace baked in, named ``key``.
    """

    kind: StateKind
    param: str = ""
    key: str = ""

    @classmethod
    def of_param(cls, fqn: str) -> "StateKey":
        return cls(StateKind.PARAM, fqn)

    @classmethod
    def of_buffer(cls, fqn: str) -> "StateKey":
        return cls(StateKind.BUFFER, fqn)

    @classmethod
    def optimizer(cls, param: str, key: str) -> "StateKey":
        return cls(StateKind.OPTIM, param, key)

    @classmethod
    def accumulator(cls, param: str) -> "StateKey":
        return cls(StateKind.GRAD_MERGE, param)

    @classmethod
    def scaler(cls, key: str) -> "StateKey":
        return cls(StateKind.SCALER, "", key)

    @classmethod
    def constant(cls, name: str) -> "StateKey":
        return cls(StateKind.CONST, "", name)

    @property
    def name(self) -> str:
        """The program's name: ``<fqn>``, ``<fqn>/<key>``, ``gradient_merge/<fqn>``,
        ``amp/<key>`` or the constant's own."""
        return {StateKind.PARAM: self.param, StateKind.BUFFER: self.param,
                StateKind.OPTIM: f"{self.param}/{self.key}",
                StateKind.GRAD_MERGE: f"gradient_merge/{self.param}",
                StateKind.SCALER: f"amp/{self.key}", StateKind.CONST: self.key}[self.kind]

    @property
    def of_module(self) -> bool:
        """A parameter or buffer of the model (what ``state_dict`` holds)."""
        return self.kind in (StateKind.PARAM, StateKind.BUFFER)


@dataclass(frozen=True)
class Slot:
    """What one program result means: the loss, a parameter's gradient, a model output,
    the new value of a piece of state (written back by the runtime), or what the step
    reports besides its loss (``report[loss_scale]``, ``report[skipped]``: the engine keeps
    each in its history under the name)."""

    # "loss" | "grad" | "output" | "update" | "report" | "scaler"; a pipeline job's:
    # "carry" | "accumulate"
    kind: str
    name: str = ""

    def __str__(self) -> str:
        return f"{self.kind}[{self.name}]" if self.name else self.kind


SLOT_KINDS = ("loss", "grad", "output", "update", "report", "scaler", "carry", "accumulate")


class AttrError(TypeError):
    """An op attribute whose key is not an ``Attr`` or whose value has the wrong type."""


_DECLARED: dict[str, "Attr"] = {}


def declared(name: str) -> "Attr":
    """The attribute declared as ``name`` (how a pickled program finds its keys again:
    keys compare by identity)."""
    return _DECLARED[name]


@dataclass(frozen=True, eq=False)
class Attr(Generic[T]):
    """A declared op attribute. ``shown``: printed in dumps after the call as
    ``{name=value}``; ``note``: printed in the op's trailing comment as ``note(value)``
    (a pipeline op's ``@s0:F``), unless an attribute the op also has ``replaces`` it. Keys
    compare by identity; names are unique."""

    name: str
    type: type | tuple[type, ...]
    doc: str
    shown: bool = False
    note: Callable[[Any], str] | None = field(default=None, repr=False)
    element: type | tuple[type, ...] | None = None     # a tuple's items, when a tuple
    replaces: tuple[str, ...] = ()     # attributes whose note this one's supersedes

    def __post_init__(self) -> None:
        if self.name in _DECLARED:
            raise ValueError(f"op attribute {self.name!r} declared twice")
        _DECLARED[self.name] = self

    def __reduce__(self):
        return declared, (self.name,)

    def check(self, value: Any) -> None:
        if not isinstance(value, self.type):
            raise AttrError(f"op attribute {self.name!r} holds a {type(value).__name__}, "
                            f"not {_type_name(self.type)}")
        if self.element is not None and not all(isinstance(x, self.element) for x in value):
            raise AttrError(f"op attribute {self.name!r} holds an item that is not "
                            f"{_type_name(self.element)}")

    def __repr__(self) -> str:
        return f"Attr({self.name!r})"


def _type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def check_attrs(attrs: dict) -> None:
    """Every key is an ``Attr`` and every value has its key's type."""
    for key, value in attrs.items():
        if not isinstance(key, Attr):
            raise AttrError(f"op attribute key {key!r} is not a declared Attr "
                            "(autopar.ir.attrs)")
        key.check(value)


NAME: Attr[str] = Attr("name", str, "an input's feed name or a state's name")
REGROUP_DIMS: Attr[tuple] = Attr("regroup_dims", tuple,
                                 "mesh dims on which a reshape may keep a merged shard as a "
                                 "grouped shard (passes/regroup_flattens.py)")
BATCH_PATH: Attr[str] = Attr("path", str, "where a fed tensor sits in (inputs, labels): "
                             "inputs.input_ids, labels", shown=True)
STATE: Attr[StateKey] = Attr("state", StateKey, "what a STATE op reads (its NAME is the key's)")
FILL: Attr[float] = Attr("fill", float, "the value every element of a fresh state starts "
                        "at (a gradient-merge accumulator, the loss scale)")
SLOTS: Attr[tuple] = Attr("slots", tuple, "what each result of the output op means",
                          element=Slot)
CONST: Attr[torch.Tensor] = Attr("const", torch.Tensor,
                                 "the value of a constant state the trace baked in")
MULTI: Attr[bool] = Attr("multi", bool, "the kernel returns a sequence, even of one value")
STRIDES: Attr[tuple] = Attr("strides", tuple,
                            "a random op's traced output strides (None: not a tensor)")
INPUT_LAYOUT: Attr[tuple] = Attr("input_layout", tuple,
                                 "an as_strided op's traced input: (strides, storage offset)")
DIST: Attr[DistAttr] = Attr("dist", DistAttr, "a placement annotation's placement",
                            shown=True)
PINNED_DIMS: Attr[tuple] = Attr("mesh_dims", tuple,
                                "the mesh dims an annotation pins (absent: all)", shown=True,
                                element=int)
ORIGIN: Attr[str] = Attr("origin", str, "what made an annotation op", shown=True)
COMM_TEXT: Attr[str] = Attr("step", str, "a comm op's collective, in words", shown=True)
LOCAL_NOTE: Attr[str] = Attr("local_note", str, "why a rank's call differs from the global "
                             "one", shown=True)
DECOMPOSES: Attr[str] = Attr("decomposes", str, "the fused op a decomposition replaced",
                             shown=True)
ON_HOST: Attr[bool] = Attr("on_host", bool, "a state kept in host memory, not the device's "
                           "(sharding.offload: passes/offload_states.py)", shown=True)
