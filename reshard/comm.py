"""How a comm op records, in the IR, the communication it runs: typed op attributes the
reshard, bucketing and pipeline passes write and read, and lowering binds to collectives.

* ``RESHARD_STEP`` — the one reshard step a ``comm.<kind>`` op runs;
* ``BUCKET_STEPS`` — a ``comm.all_reduce_start``'s steps, one per bucketed input;
* ``FOR_ROLE``, ``FOR_TARGET`` — the role and target of the consumer the value moves for
  (a gradient all-reduce is ``for`` the optimizer: bucketing and explain read it).
"""
from __future__ import annotations

from ..ir.attrs import Attr
from ..ir.core import Role
from .steps import Step

__all__ = ["RESHARD_STEP", "BUCKET_STEPS", "FOR_ROLE", "FOR_TARGET"]

RESHARD_STEP: Attr[Step] = Attr("reshard_step", Step, "the reshard step a comm op runs")
BUCKET_STEPS: Attr[tuple] = Attr("bucket_steps", tuple, "a bucket's steps, one per input",
                                 element=Step)
FOR_ROLE: Attr[Role] = Attr("for_role", Role, "the role of the consumer a value moves for")
FOR_TARGET: Attr[str] = Attr("for_target", str, "the target of the consumer a value moves for")
