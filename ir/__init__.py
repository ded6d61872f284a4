"""The autopar IR: programs, values, typed attributes, placements, printer, verifier."""
from .attrs import NAME, STATE, Attr
from .core import (
    Op,
    OpaqueType,
    OpKind,
    Program,
    Role,
    Slot,
    StateKey,
    StateKind,
    TensorType,
    Value,
    ValueType,
    state_op,
)
from .dist_attr import DistAttr
from .mesh import ProcessMesh
from .placements import Partial, Placement, Replicate, Shard
from .printer import format_program, value_names
from .verifier import VerificationError, verify

__all__ = ["NAME", "STATE", "Attr", "DistAttr", "Partial", "Placement", "ProcessMesh",
           "Replicate", "Shard", "OpaqueType", "Op", "OpKind", "Program", "Role", "Slot",
           "StateKey", "StateKind", "TensorType", "Value", "ValueType", "state_op",
           "format_program", "value_names", "verify", "VerificationError"]
