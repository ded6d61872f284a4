"""Histograms: ``histc`` counts the input's values into a fixed number of bins (a
mixture-of-experts load-balancing loss counts the tokens routed to each expert). A count
over a sharded input is the sum of each piece's counts, so every input dim may shard and
makes the output Partial(sum); the bins are a new dim, never sharded. Counts are not linear
in the values, so a Partial input is resolved first.
"""
from __future__ import annotations

from ...ir.core import Op
from ..rule_registry import register, tensor_inputs
from ..spec import UNSHARDABLE, Spec, letters


@register("aten.histc.default")
def histc(op: Op) -> Spec:
    rank = len(tensor_inputs(op)[0].type.shape)
    return Spec((letters(rank),), (UNSHARDABLE,), reduce="sum")
