"""Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin (axes as input or attribute, keepdims,
empty axes). ReduceMax/Min share the gradient equally among tied maxima (as torch.amax does)."""
from __future__ import annotations

import numpy as np

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import known_rank


def _axes(ctx, node) -> list[int] | None:
    """The reduced axes (None = all), from the axes input or the pre-opset-18 attribute."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        value = ctx.constant_value(node.inputs[1])
        if value is None:
            raise ValueError("reduction axes must be constant to differentiate")
        axes = [int(a) for a in np.asarray(value).reshape(-1)]
    else:
        axes = attr(node, "axes")
        axes = None if axes is None else list(axes)
    if not axes:
        return [] if attr(node, "noop_with_empty_axes", 0) else None
    return axes


def _expand_back(ctx, node, g):
    x = node.inputs[0]
    axes = _axes(ctx, node)
    if axes == []:  # noop
        return g, None
    keepdims = attr(node, "keepdims", 1)
    if not keepdims and axes is not None:
        rank = known_rank(x, f"{node.op_type} input")
        g = ctx.op("Unsqueeze", g, ctx.ints(sorted(a % rank for a in axes)))
    return ctx.op("Expand", g, ctx.op("Shape", x)), axes


@register("ReduceSum")
def reduce_sum(ctx, node, gys):
    out, _ = _expand_back(ctx, node, gys[0])
    return [out, None]


@register("ReduceMean")
def reduce_mean(ctx, node, gys):
    x, (y,) = node.inputs[0], node.outputs
    out, axes = _expand_back(ctx, node, gys[0])
    if axes == []:
        return [out, None]
    ratio = ctx.op("Div", ctx.op("CastLike", ctx.op("Size", y), x),
                   ctx.op("CastLike", ctx.op("Size", x), x))
    return [ctx.op("Mul", out, ratio), None]


@register("ReduceMax", "ReduceMin")
def reduce_max(ctx, node, gys):
    x, (y,) = node.inputs[0], node.outputs
    g, axes = _expand_back(ctx, node, gys[0])
    if axes == []:
        return [g, None]
    full, _ = _expand_back(ctx, node, y)
    mask = ctx.op("CastLike", ctx.op("Equal", x, full), x)
    count = ctx.op("ReduceSum", mask, *([ctx.ints(axes)] if axes else []), keepdims=1)
    return [ctx.op("Div", ctx.op("Mul", g, mask), count), None]
