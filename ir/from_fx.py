"""fx graph -> IR: walk a traced graph in order and append the ops it stands for (an
import into the IR; "lowering" is what makes each rank's program, ``autopar.lower``).

Phase and module path come from the node metadata capture stamped; a backward op finds the
forward op it differentiates through the autograd sequence number they share.
"""
from __future__ import annotations

import hashlib
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from .attrs import CONST, INPUT_LAYOUT, MULTI, STRIDES, StateKey
from .core import Op, OpaqueType, OpKind, Program, Role, TensorType, Value, state_op
from .ops import UnknownOpError, op_info, target_name


class FxGraphError(RuntimeError):
    pass



_PHASE_ROLE = {"fwd": Role.FORWARD, "loss": Role.LOSS, "bwd": Role.BACKWARD, "opt": Role.OPTIMIZER}


def value_type(meta_val: Any) -> TensorType | OpaqueType:
    if isinstance(meta_val, torch.Tensor):
        return TensorType(tuple(int(d) for d in meta_val.shape), meta_val.dtype)
    if meta_val is None:
        return OpaqueType("none")
    return OpaqueType(type(meta_val).__name__)


def _target(node_target: Any) -> str:
    try:
        return target_name(node_target)
    except UnknownOpError:
        raise FxGraphError(f"cannot turn fx target {node_target!r}: only ATen-level operators "
                            "are expected after make_fx") from None


class FxImporter:
    """Walks an fx graph in order and appends the IR ops it stands for."""

    def __init__(self, program: Program, gm: fx.GraphModule, default_role: Role | None = None,
                 attribute_paths: dict[int, str] | None = None):
        self.program = program
        self.gm = gm
        self.default_role = default_role
        self.attribute_paths = attribute_paths or {}
        self.env: dict[fx.Node, Any] = {}
        self.constants: dict[str, Value] = {}
        self.first_op_by_seq: dict[int, Op] = {}

    def bind(self, node: fx.Node, value: Any) -> None:
        self.env[node] = value

    def run(self, placeholder_values: Sequence[Value]) -> Any:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, placeholder_values, strict=True):
            self.bind(node, value)
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                self.bind(node, self._constant(node))
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], lambda n: self.env[n])
        raise FxGraphError("traced graph has no output")

    def _constant(self, node: fx.Node) -> Value:
        """One CONST state per traced constant (make_fx reads a reused constant through
        several get_attr nodes of one target)."""
        if node.target in self.constants:
            return self.constants[node.target]
        tensor = getattr(self.gm, node.target)
        label = self.attribute_paths.get(id(tensor), node.target)
        op = state_op(StateKey.constant(f"const/{label}@{_digest(tensor)}"),
                      value_type(tensor), attrs={CONST: tensor})
        self.program.ops.insert(self._state_insert_point(), op)
        op.outputs[0].producer = op
        self.constants[node.target] = op.outputs[0]
        return op.outputs[0]

    def _state_insert_point(self) -> int:
        return sum(1 for op in self.program.ops if op.kind in (OpKind.INPUT, OpKind.STATE))

    def _role_and_link(self, node: fx.Node) -> tuple[Role, str, Op | None]:
        custom = node.meta.get("custom") or {}
        if self.default_role is not None:
            return self.default_role, custom.get("module", ""), None
        role = _PHASE_ROLE[custom.get("phase", "fwd")]
        module = custom.get("module", "")
        # a backward op made while an autograd node ran differentiates that node's forward
        # op; one made between nodes (gradient accumulation, the loss's seed) none
        seq = custom.get("grad_fn")
        if role is Role.BACKWARD and isinstance(seq, int) and seq in self.first_op_by_seq:
            forward = self.first_op_by_seq[seq]
            return role, forward.module, forward
        return role, module, None

    def _call(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            source, index = node.args
            self.bind(node, self.env[source][index])
            return
        role, module, forward = self._role_and_link(node)
        args = fx.node.map_arg(node.args, lambda n: self.env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        val = node.meta.get("val")
        multi = isinstance(val, (list, tuple))
        out_types = [value_type(v) for v in val] if multi else [value_type(val)]
        target = _target(node.target)
        op = self.program.add_call(target, tuple(args), out_types, role=role,
                                   module=module, kwargs=dict(kwargs), forward_op=forward)
        if multi:
            op.attrs[MULTI] = True   # the kernel returns a sequence, even of one element
        if op_info(target).random:
            # a random kernel's draws follow the memory layout of the tensor it fills, which
            # the IR's types do not keep: a rank replays the draw in the trace's layout
            op.attrs[STRIDES] = tuple(tuple(v.stride()) if isinstance(v, torch.Tensor)
                                           else None for v in (val if multi else [val]))
        if target in STRIDED_READS:
            _record_input_layout(op, node)
        seq = node.meta.get("seq_nr")
        if role in (Role.FORWARD, Role.LOSS) and isinstance(seq, int):
            self.first_op_by_seq.setdefault(seq, op)
        self.bind(node, list(op.outputs) if multi else op.outputs[0])


# ops that read their input's memory through given strides, not its values by index
STRIDED_READS = ("aten.as_strided.default",)


def _record_input_layout(op: Op, node: fx.Node) -> None:
    """What memory an ``as_strided`` reads: its input's traced strides and storage offset
    (``passes/strided_views.py`` turns it into plain views where that layout allows)."""
    source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if isinstance(source, torch.Tensor):
        op.attrs[INPUT_LAYOUT] = (tuple(source.stride()), source.storage_offset())


def _digest(tensor: torch.Tensor) -> str:
    """Content address of a constant. Programs of one engine share one state table, and
    fx numbers constants per trace (``_tensor_constant0`` in train and eval need not be the
    same tensor), so a constant's state name must say what it holds."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha1(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()[:10]


def append_graph(program: Program, gm: fx.GraphModule, inputs: Sequence[Value], role: Role) -> Any:
    """Append a traced helper graph (clipping, loss scaling, ...) to ``program`` with one role,
    reading ``inputs`` for its placeholders; returns its outputs as Values."""
    return FxImporter(program, gm, default_role=role).run(inputs)
