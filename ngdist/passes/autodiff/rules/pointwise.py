"""Unary and binary math: Erf, Pow, Sqrt, Exp, Log, Abs, Reciprocal, Clip.

Rules use the forward outputs where the derivative is a function of them (Exp, Sqrt,
Reciprocal). Pow's integer exponents get no gradient.
"""
from __future__ import annotations

import math

from ngdist.passes.autodiff.registry import register


@register("Erf")
def erf(ctx, node, gys):
    (x,) = node.inputs
    bell = ctx.op("Exp", ctx.op("Neg", ctx.op("Mul", x, x)))
    return [ctx.op("Mul", gys[0], ctx.op("Mul", bell, ctx.scalar(2.0 / math.sqrt(math.pi), x)))]


@register("Pow")
def pow_(ctx, node, gys):
    (g,), (a, b), (y,) = gys, node.inputs, node.outputs
    out = [None, None]
    if ctx.needs(a):
        bf = ctx.op("CastLike", b, a)
        da = ctx.op("Mul", bf, ctx.op("Pow", a, ctx.op("Sub", bf, ctx.scalar(1.0, bf))))
        out[0] = ctx.unbroadcast(ctx.op("Mul", g, da), a)
    if ctx.needs(b):  # d a^b / db = a^b log a (a > 0)
        out[1] = ctx.unbroadcast(ctx.op("Mul", g, ctx.op("Mul", y, ctx.op("Log", a))), b)
    return out


@register("Sqrt")
def sqrt(ctx, node, gys):
    (y,) = node.outputs
    return [ctx.op("Div", ctx.op("Mul", gys[0], ctx.scalar(0.5, y)), y)]


@register("Exp")
def exp(ctx, node, gys):
    return [ctx.op("Mul", gys[0], node.outputs[0])]


@register("Log")
def log(ctx, node, gys):
    return [ctx.op("Div", gys[0], node.inputs[0])]


@register("Abs")
def abs_(ctx, node, gys):
    return [ctx.op("Mul", gys[0], ctx.op("Sign", node.inputs[0]))]


@register("Reciprocal")
def reciprocal(ctx, node, gys):
    (y,) = node.outputs
    return [ctx.op("Neg", ctx.op("Mul", gys[0], ctx.op("Mul", y, y)))]


@register("Clip")
def clip(ctx, node, gys):
    """x gets the gradient where lo <= x <= hi; a bound gets it where it clips (usually the
    bounds are constants and get nothing)."""
    x = node.inputs[0]
    lo = node.inputs[1] if len(node.inputs) > 1 else None
    hi = node.inputs[2] if len(node.inputs) > 2 else None
    g = gys[0]
    zero = ctx.scalar(0.0, g)
    out = [None, None, None]
    keep = None
    for i, (bound, test) in enumerate(((lo, "GreaterOrEqual"), (hi, "LessOrEqual")), start=1):
        if bound is None:
            continue
        inside = ctx.op(test, x, bound)
        keep = inside if keep is None else ctx.op("And", keep, inside)
        if ctx.needs(bound):  # (lo <= hi) the bound is the output where x is beyond it
            out[i] = ctx.op("ReduceSum", ctx.op("Where", inside, zero, g), keepdims=0)
    out[0] = g if keep is None else ctx.op("Where", keep, g, zero)
    return out
