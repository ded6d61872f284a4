"""Ring attention's operators (``ir/kernels/ring.py``, context parallelism ``method: ring``).

Letters: query ``bhle``, key ``bhle``, value ``bhlf``, output ``bhlf``, log-sum-exp ``bhl``.
A block pairs query chunk ``i`` with key chunk ``i`` (the ring has already brought each
rank its keys), so the query's and the keys' sequences are one letter ``l``: it shards
evenly (a rank must hold whole chunks, checked by the local form), with the batch and the
heads. Grouped key/value heads shard with the query's only evenly, as in ``attention.py``.
The blocks are not linear in anything a partial could pass through.

``ring_shift`` rolls one dim by whole pieces: every dim keeps its letter; the rolled one
shards evenly (over the ring of ``pieces`` ranks it becomes a ``comm.shift``,
``passes/ring_shifts.py``). A roll is linear, so partial terms roll as they are.
"""
from __future__ import annotations

from ...ir.core import Op
from ...ir.ops import schema_args
from ..rule_registry import register
from ..spec import Spec

R = "autopar.ring_"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _grouped(op: Op) -> frozenset[str]:
    a = schema_args(op)
    return frozenset({"h"}) if a["k"].type.shape[1] != a["q"].type.shape[1] else frozenset()


@register(R + "block.default")
def _block(op: Op) -> Spec:
    return Spec(("bhle", "bhle", "bhlf"), ("bhlf", "bhl"), replicated={"e", "f"},
                even={"l"} | _grouped(op))


@register(R + "block_backward.default")
def _block_backward(op: Op) -> Spec:
    return Spec(("bhlf", "bhle", "bhle", "bhlf", "bhlf", "bhl"), ("bhle", "bhle", "bhlf"),
                replicated={"e", "f"}, even={"l"} | _grouped(op))


@register(R + "shift.default")
def _shift(op: Op) -> Spec:
    a = schema_args(op)
    letters = LETTERS[:len(a["x"].type.shape)]
    return Spec((letters,), (letters,), even={letters[a["dim"]]}, linear="sum")
