"""Running sums: CumSum (exclusive and reverse). Its gradient is the running sum of the output
gradient in the other direction, with the same exclusivity: y_i = sum_{j <= i} x_j gives
dx_j = sum_{i >= j} g_i."""
from __future__ import annotations

from ngdist.passes.autodiff.registry import attr, register


@register("CumSum")
def cum_sum(ctx, node, gys):
    axis = node.inputs[1]
    return [ctx.op("CumSum", gys[0], axis, exclusive=attr(node, "exclusive", 0),
                   reverse=1 - attr(node, "reverse", 0)), None]
