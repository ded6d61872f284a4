"""Local forms: how one rank runs an op whose operands are sharded, when the call differs
from the global one.

Most ops run unchanged on local pieces (a matmul of shards is a shard of the matmul). The
exceptions carry something global in their non-tensor arguments or in what they compute:

* a shape argument (``view``, ``expand``, ``zeros`` ...) names the global shape;
* ``arange`` and ``tril``/``triu`` depend on where the piece sits in the global tensor;
* ``mean`` divides by the number of elements, which is global;
* a vocab-sharded ``embedding`` holds only some rows, so other ids give 0 (a *masked*
  ``Partial(sum)``), and its backward scatters only into the rows the rank holds;
  likewise a class-sharded ``nll_loss`` reads only the targets in its class range;
* random ops must give every rank its slice of one global random tensor, or a sharded run
  would not equal the single-device run (a random op with a sharded output and no form
  raises ``UnsupportedLocalForm`` rather than run wrong);
* a few kernels crash on the empty pieces uneven shards leave (CPU flash attention).

A local form is a pure function ``(op, ctx) -> LocalCall | None`` that rewrites the call:
a target (an ATen overload, or an ``autopar.*`` kernel of ``ir/kernels``) and arguments
that still hold the op's input Values, which at run time are the rank's local tensors. The
partition pass applies it to every op of a rank's program; ``run_local`` executes it on
concrete local tensors (for tests and the simulator). ``None`` means "call unchanged".

Every form reads placements from ``ctx``: ``needs`` (what each tensor input holds, in
``op.inputs`` order, the rule's decision) and ``outputs`` (what each output holds).
"""
# the family modules, one per op family (like spmd/rules/): importing them fills
# LOCAL_FORMS
from . import (  # noqa: F401
    attention,
    batch_norm,
    embedding,
    guards,
    losses,
    random,
    reductions,
    ring_attention,
    shapes,
)
from .form_registry import LOCAL_FORMS, LocalForm, local_call, register_local_form, run_local
from .local_call import LocalCall, LocalContext, UnsupportedLocalForm
from .shapes import SHAPE_ARGS  # noqa: F401

__all__ = ["LocalCall", "LocalContext", "LocalForm", "LOCAL_FORMS", "register_local_form",
           "local_call", "run_local", "UnsupportedLocalForm"]
