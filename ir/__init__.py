"""The autopar IR: programs, values, printer, verifier and capture."""
from .core import (
    Op,
    OpaqueType,
    OpKind,
    Program,
    Role,
    Slot,
    StateKind,
    TensorType,
    Value,
    ValueType,
)
from .dist import DistAttr, Partial, Placement, ProcessMesh, Replicate, Shard
from .printer import format_program
from .verifier import VerificationError, verify

__all__ = ["DistAttr", "Partial", "Placement", "ProcessMesh", "Replicate", "Shard", "OpaqueType",
           "Op", "OpKind", "Program", "Role", "Slot", "StateKind", "TensorType", "Value",
           "ValueType", "format_program", "verify", "VerificationError"]
