"""Matrix products: a sharded contracted letter makes the result Partial(sum); each product
is linear in each operand separately, so one Partial operand passes through."""
from __future__ import annotations

from ..registry import register
from ..spec import Spec


@register("aten.mm.default")
def mm(op) -> Spec:
    return Spec.parse("mk,kn->mn", linear="each")


@register("aten.bmm.default")
def bmm(op) -> Spec:
    return Spec.parse("bmk,bkn->bmn", linear="each")
