"""Trigonometric and hyperbolic functions and their inverses: Sin, Cos, Tan, Asin, Acos, Atan,
Sinh, Cosh, Asinh, Acosh, Atanh. Tan reads its output (1 + y^2); the rest read the input."""
from __future__ import annotations

from ngdist.passes.autodiff.registry import register


@register("Sin")
def sin(ctx, node, gys):
    return [ctx.op("Mul", gys[0], ctx.op("Cos", node.inputs[0]))]


@register("Cos")
def cos(ctx, node, gys):
    return [ctx.op("Neg", ctx.op("Mul", gys[0], ctx.op("Sin", node.inputs[0])))]


@register("Tan")
def tan(ctx, node, gys):
    (y,) = node.outputs
    return [ctx.op("Mul", gys[0], ctx.op("Add", ctx.scalar(1.0, y), ctx.op("Mul", y, y)))]


@register("Sinh")
def sinh(ctx, node, gys):
    return [ctx.op("Mul", gys[0], ctx.op("Cosh", node.inputs[0]))]


@register("Cosh")
def cosh(ctx, node, gys):
    return [ctx.op("Mul", gys[0], ctx.op("Sinh", node.inputs[0]))]


def _over_root(ctx, g, x, sign_x2: float, const: float):
    """g / sqrt(sign_x2 * x^2 + const)."""
    x2 = ctx.op("Mul", x, x)
    if sign_x2 < 0:
        x2 = ctx.op("Neg", x2)
    return ctx.op("Div", g, ctx.op("Sqrt", ctx.op("Add", x2, ctx.scalar(const, x))))


@register("Asin")
def asin(ctx, node, gys):
    return [_over_root(ctx, gys[0], node.inputs[0], -1.0, 1.0)]


@register("Acos")
def acos(ctx, node, gys):
    return [ctx.op("Neg", _over_root(ctx, gys[0], node.inputs[0], -1.0, 1.0))]


@register("Asinh")
def asinh(ctx, node, gys):
    return [_over_root(ctx, gys[0], node.inputs[0], 1.0, 1.0)]


@register("Acosh")
def acosh(ctx, node, gys):
    return [_over_root(ctx, gys[0], node.inputs[0], 1.0, -1.0)]


@register("Atan")
def atan(ctx, node, gys):
    (x,) = node.inputs
    return [ctx.op("Div", gys[0], ctx.op("Add", ctx.scalar(1.0, x), ctx.op("Mul", x, x)))]


@register("Atanh")
def atanh(ctx, node, gys):
    (x,) = node.inputs
    return [ctx.op("Div", gys[0], ctx.op("Sub", ctx.scalar(1.0, x), ctx.op("Mul", x, x)))]
