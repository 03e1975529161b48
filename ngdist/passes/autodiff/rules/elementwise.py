"""Elementwise arithmetic with numpy broadcasting: Add, Sub, Mul, Div, Neg, Identity, Cast,
CastLike (its target-type input gets no gradient), Sum, Mean, Mod."""
from __future__ import annotations

from ngdist.passes.autodiff.registry import register


@register("Add")
def add(ctx, node, gys):
    (g,) = gys
    a, b = node.inputs
    return [ctx.unbroadcast(g, a), ctx.unbroadcast(g, b)]


@register("Sub")
def sub(ctx, node, gys):
    (g,) = gys
    a, b = node.inputs
    return [ctx.unbroadcast(g, a), ctx.unbroadcast(ctx.op("Neg", g), b)]


@register("Mul")
def mul(ctx, node, gys):
    (g,) = gys
    a, b = node.inputs
    return [ctx.unbroadcast(ctx.op("Mul", g, b), a), ctx.unbroadcast(ctx.op("Mul", g, a), b)]


@register("Div")
def div(ctx, node, gys):
    (g,) = gys
    a, b = node.inputs
    (y,) = node.outputs
    ga = ctx.op("Div", g, b)
    gb = ctx.op("Neg", ctx.op("Mul", ga, y))  # -g * a / b^2 == -(g / b) * y
    return [ctx.unbroadcast(ga, a), ctx.unbroadcast(gb, b)]


@register("Neg")
def neg(ctx, node, gys):
    return [ctx.op("Neg", gys[0])]


@register("Identity")
def identity(ctx, node, gys):
    return [gys[0]]


@register("Cast")
def cast(ctx, node, gys):
    return [ctx.op("CastLike", gys[0], node.inputs[0])]


@register("CastLike")
def cast_like(ctx, node, gys):
    return [ctx.op("CastLike", gys[0], node.inputs[0]), None]


@register("Sum")
def sum_(ctx, node, gys):
    return [ctx.unbroadcast(gys[0], x) for x in node.inputs]


@register("Mean")
def mean(ctx, node, gys):
    share = ctx.op("Mul", gys[0], ctx.scalar(1.0 / len(node.inputs), gys[0]))
    return [ctx.unbroadcast(share, x) for x in node.inputs]


@register("Mod")
def mod(ctx, node, gys):
    """y = a - q b with q the integer quotient (truncated for fmod=1, floored otherwise):
    da = g, db = -g q, q read back as round((a - y) / b) so both modes share the rule (torch:
    fmod and remainder)."""
    (g,), (a, b), (y,) = gys, node.inputs, node.outputs
    out = [ctx.unbroadcast(g, a) if ctx.needs(a) else None, None]
    if ctx.needs(b):
        q = ctx.op("Round", ctx.op("Div", ctx.op("Sub", a, y), b))
        out[1] = ctx.unbroadcast(ctx.op("Neg", ctx.op("Mul", g, q)), b)
    return out
