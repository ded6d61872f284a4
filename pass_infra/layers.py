"""A program's repeated layers: which ops of a model's identical layers correspond, so the
placement ILP can solve them once (every identical layer takes the same strategy, as Alpa
clusters layers), and recompute knows what to recompute when the strategy names no modules
(``passes/recompute.py``: every repeated layer, as torchtitan's and Paddle's defaults).

A layer instance is a child of a module list: the ops whose module path (a CALL's
``op.module``; a parameter's, buffer's or optimizer state's name; fed inputs are in no
layer) is ``<container>.<i>.<rest>`` with
``i`` the first all-digit component (``blocks.3.attn.qkv``, Hugging Face's
``model.layers.3.mlp``, the optimizer state ``blocks.3.fc1.weight/exp_avg``), in whatever
role (forward, backward, optimizer step). An op the capture left without a module (``""``:
the backward's gradient sums at a residual, a root ``forward``'s adds) joins the layer of
its inputs' producers when those with a module path lie in exactly one layer instance.

Two instances of one container are identical when their ops, in program order, have the
same kind, target, role, path below the instance, non-tensor arguments, attributes (names
aside), output types and placements, and the same inputs: the same position inside the
instance, or, from outside it, the same type and placement. The corresponding ops of a
class of identical instances are tied to the one among them the program runs first.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from ..ir import Op, OpKind, Program, Value
from ..ir.attrs import NAME, STATE
from ..pipeline.phases import HOMES, STAGE

__all__ = ["LayerClass", "RepeatedLayers", "repeated_layers", "layer_of"]

Instance = tuple[str, int]          # (container path, index in it)


@dataclass(frozen=True)
class LayerClass:
    """Identical instances of one container."""

    container: str
    indices: tuple[int, ...]
    ops: int                        # per instance


@dataclass
class RepeatedLayers:
    """``ties``: each op of a layer class -> the corresponding op of the class's instance
    that comes first in the program (a forward op's in the first layer, a backward op's in
    the last: the backward runs the layers in reverse), for all but that op."""

    ties: dict[Op, Op] = field(default_factory=dict)
    classes: list[LayerClass] = field(default_factory=list)
    untied: list[Instance] = field(default_factory=list)    # instances alone in their class

    def summary(self) -> str:
        parts = [f"{c.container}[{','.join(map(str, c.indices))}] ({c.ops} ops each)"
                 for c in self.classes]
        alone = f"; alone: {', '.join(f'{p}.{i}' for p, i in self.untied)}" \
            if self.untied else ""
        return (f"{len(self.ties)} ops tied in {len(self.classes)} layer classes: "
                f"{'; '.join(parts) or 'none'}{alone}")


def layer_of(path: str) -> tuple[str, int, str] | None:
    """(container, index, rest) of a module path or state name, None outside any layer."""
    parts = path.split(".")
    for k, part in enumerate(parts):
        if k and part.isdigit():
            return ".".join(parts[:k]), int(part), ".".join(parts[k + 1:])
    return None


def _path(op: Op) -> str:
    return op.attrs[NAME] if op.kind is OpKind.STATE else op.module


def _instances(program: Program) -> tuple[dict[Instance, list[Op]], dict[Op, str]]:
    """Each instance's ops in program order, and each op's path below its instance."""
    owner: dict[Op, Instance] = {}
    rest: dict[Op, str] = {}
    members: dict[Instance, list[Op]] = defaultdict(list)
    for op in program.ops:
        if op.kind not in (OpKind.STATE, OpKind.CALL):
            continue
        found = layer_of(_path(op))
        if found is not None:
            container, index, below = found
            where: Instance | None = (container, index)
        elif op.kind is OpKind.CALL and op.module == "":
            where, below = _joined(op, owner), ""
        else:
            where = None
        if where is None:
            continue
        owner[op], rest[op] = where, below
        members[where].append(op)
    return members, rest


def _joined(op: Op, owner: dict[Op, Instance]) -> Instance | None:
    """The one instance holding the producers (with a module path of their own) of an op
    the capture gave no module; None when they lie in none or in several."""
    seen = {owner[v.producer] for v in op.inputs
            if v.producer is not None and v.producer in owner
            and layer_of(_path(v.producer)) is not None}
    return seen.pop() if len(seen) == 1 else None


def _leaf(a: Any, local: dict[Value, tuple[int, int]]) -> Hashable:
    """A hashable picture of one argument: a value by where it comes from."""
    if isinstance(a, Value):
        if a in local:
            return ("local", *local[a])
        return ("outside", str(a.type), a.dist if a.is_tensor else None)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, *(_leaf(x, local) for x in a))
    if isinstance(a, dict):
        return ("dict", *((k, _leaf(x, local)) for k, x in a.items()))
    if isinstance(a, torch.Tensor):     # a constant: its values do not place it
        return ("tensor", tuple(a.shape), a.dtype)
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


_ASIDE = (NAME, STATE, STAGE, HOMES)


def _signature(ops: list[Op], rest: dict[Op, str], instance: Instance) -> tuple:
    local: dict[Value, tuple[int, int]] = {}
    own = f"{instance[0]}.{instance[1]}."
    sig = []
    for k, op in enumerate(ops):
        # names aside: a text attribute naming the instance's own modules (a ZeRO gather's
        # origin) says the same of every instance; and so does a layer on another pipeline
        # stage (the stage says where it runs, not what it computes)
        attrs = tuple(sorted((key.name, v.replace(own, "<layer>.") if isinstance(v, str)
                              else _leaf(v, {}))
                             for key, v in op.attrs.items() if key not in _ASIDE))
        outs = tuple((str(v.type), v.dist if v.is_tensor else None) for v in op.outputs)
        kind = op.attrs[STATE].kind if op.kind is OpKind.STATE else None    # names aside
        sig.append((op.kind, kind, op.target, op.role, rest[op], _leaf(op.args, local),
                    _leaf(op.kwargs, local), attrs, outs))
        for i, v in enumerate(op.outputs):
            local[v] = (k, i)
    return tuple(sig)


def repeated_layers(program: Program) -> RepeatedLayers:
    """The classes of identical layer instances in ``program`` and the op ties they give."""
    members, rest = _instances(program)
    order = {op: k for k, op in enumerate(program.ops)}
    by_sig: dict[tuple, list[Instance]] = defaultdict(list)
    for inst in sorted(members):
        by_sig[(inst[0], _signature(members[inst], rest, inst))].append(inst)
    found = RepeatedLayers()
    for insts in by_sig.values():
        if len(insts) < 2:
            found.untied.extend(insts)
            continue
        for same in zip(*(members[inst] for inst in insts)):
            rep = min(same, key=order.__getitem__)
            found.ties.update((op, rep) for op in same if op is not rep)
        found.classes.append(LayerClass(insts[0][0], tuple(i for _, i in insts),
                                        len(members[insts[0]])))
    found.classes.sort(key=lambda c: (c.container, c.indices))
    found.untied.sort()
    return found
