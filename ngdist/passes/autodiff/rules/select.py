"""Selection: Where (the condition gets no gradient), variadic Max / Min, TopK (its values; the
indices output is an integer and carries none).

Max and Min share the gradient equally among the inputs that tie for the result (as
``torch.maximum`` does for two), so the rule is deterministic and its sum is exact.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import ensure_output, known_rank


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


@register("TopK")
def top_k(ctx, node, gys):
    """The values' gradient written back at the indices the forward node returns (added to
    it if unused); the k input gets none."""
    x, g = node.inputs[0], gys[0]
    if g is None:
        return [None, None]
    axis = attr(node, "axis", -1)
    if axis < 0:
        axis %= known_rank(x, "TopK input")
    indices = ensure_output(node, 1, "indices", ir.DataType.INT64, node.outputs[0].shape)
    zero = ctx.op("CastLike", ctx.op("ConstantOfShape", ctx.op("Shape", x),
                                     value=ir.tensor(np.zeros(1, np.float32))), g)
    return [ctx.op("ScatterElements", zero, indices, g, axis=axis), None]
