"""Selection: Where (the condition gets no gradient) and variadic Max / Min.

Max and Min share the gradient equally among the inputs that tie for the result (as
``torch.maximum`` does for two), so the rule is deterministic and its sum is exact.
"""
from __future__ import annotations

from ngdist.passes.autodiff.registry import register


@register("Where")
def where(ctx, node, gys):
    cond, a, b = node.inputs
    g = gys[0]
    zero = ctx.scalar(0.0, g)
    out = [None, None, None]
    if ctx.needs(a):
        out[1] = ctx.unbroadcast(ctx.op("Where", cond, g, zero), a)
    if ctx.needs(b):
        out[2] = ctx.unbroadcast(ctx.op("Where", cond, zero, g), b)
    return out


@register("Max", "Min")
def max_min(ctx, node, gys):
    (y,), g = node.outputs, gys[0]
    if len(node.inputs) == 1:
        return [g]
    masks = [ctx.op("CastLike", ctx.op("Equal", x, y), g) for x in node.inputs]
    share = ctx.op("Div", g, ctx.op("Sum", *masks))
    return [ctx.unbroadcast(ctx.op("Mul", share, m), x) if ctx.needs(x) else None
            for x, m in zip(node.inputs, masks)]
