"""Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceSumSquare, ReduceL1, ReduceL2,
ReduceLogSum, ReduceLogSumExp, ReduceProd (axes as input or attribute, keepdims, empty axes).
ReduceMax/Min share the gradient equally among tied maxima (as torch.amax does)."""
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


def _spread(ctx, node, v):
    """``v`` (shaped like the output) expanded back to the input's shape, for reductions
    whose empty-axes no-op form runtimes disagree on (squared or not): that form is refused."""
    if _axes(ctx, node) == []:
        raise ValueError(f"{node.op_type} with empty axes and noop_with_empty_axes=1 is not "
                         "differentiated (runtimes differ on what it computes); give the "
                         "reduced axes explicitly")
    return _expand_back(ctx, node, v)[0]


@register("ReduceSumSquare")
def reduce_sum_square(ctx, node, gys):
    x = node.inputs[0]
    return [ctx.op("Mul", _spread(ctx, node, gys[0]), ctx.op("Mul", x, ctx.scalar(2.0, x))),
            None]


@register("ReduceL1")
def reduce_l1(ctx, node, gys):
    """d sum|x| = sign(x): 0 at x == 0, as torch's norm(p=1) gives."""
    return [ctx.op("Mul", _spread(ctx, node, gys[0]), ctx.op("Sign", node.inputs[0])), None]


@register("ReduceL2")
def reduce_l2(ctx, node, gys):
    """g x / ||x||; 0 where the norm is 0 (torch's norm backward)."""
    x, (y,) = node.inputs[0], node.outputs
    zero = ctx.scalar(0.0, y)
    null = ctx.op("Equal", y, zero)
    scaled = ctx.op("Where", null, zero,
                    ctx.op("Div", gys[0], ctx.op("Where", null, ctx.scalar(1.0, y), y)))
    return [ctx.op("Mul", _spread(ctx, node, scaled), x), None]


@register("ReduceLogSum")
def reduce_log_sum(ctx, node, gys):
    """y = log(sum x): dx = g / sum x = g * exp(-y)."""
    (y,) = node.outputs
    return [_spread(ctx, node, ctx.op("Div", gys[0], ctx.op("Exp", y))), None]


@register("ReduceLogSumExp")
def reduce_log_sum_exp(ctx, node, gys):
    """dx = g * exp(x - y): the softmax of x over the reduced axes."""
    x, (y,) = node.inputs[0], node.outputs
    return [ctx.op("Mul", _spread(ctx, node, gys[0]),
                   ctx.op("Exp", ctx.op("Sub", x, _spread(ctx, node, y)))), None]


@register("ReduceProd")
def reduce_prod(ctx, node, gys):
    """dx_i = g * prod_{j != i} x_j, exact with zeros: y / x where the reduced slice has no
    zero; where it has one, the zero gets the product of the others and the rest get 0;
    with two or more every entry gets 0 (as torch's prod backward)."""
    x, (y,) = node.inputs[0], node.outputs
    g = _spread(ctx, node, gys[0])
    axes = _axes(ctx, node)
    zero, one = ctx.scalar(0.0, x), ctx.scalar(1.0, x)
    is_zero = ctx.op("Equal", x, zero)
    red = [ctx.ints(axes)] if axes else []
    nonzero = ctx.op("Where", is_zero, one, x)
    shape = ctx.op("Shape", x)
    zeros = ctx.op("Expand", ctx.op("ReduceSum", ctx.op("CastLike", is_zero, x), *red,
                                    keepdims=1), shape)
    others = ctx.op("Expand", ctx.op("ReduceProd", nonzero, *red, keepdims=1), shape)
    lone = ctx.op("And", is_zero, ctx.op("Equal", zeros, one))
    part = ctx.op("Where", ctx.op("Equal", zeros, zero),
                  ctx.op("Div", _spread(ctx, node, y), nonzero),
                  ctx.op("Where", lone, others, zero))
    return [ctx.op("Mul", g, part), None]
