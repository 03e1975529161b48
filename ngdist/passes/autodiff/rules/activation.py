"""Activations: Relu, Sigmoid, Tanh, Softmax, LogSoftmax, LeakyRelu, Gelu (exact and tanh),
HardSigmoid, HardSwish."""
from __future__ import annotations

import math

from ngdist.passes.autodiff.registry import attr, register


@register("Relu")
def relu(ctx, node, gys):
    # y > 0 exactly where x > 0 (NaN: neither): reading the output lets x die at the Relu,
    # so onnxruntime fuses the Relu into the Gemm or Conv that makes x
    (y,) = node.outputs
    mask = ctx.op("CastLike", ctx.op("Greater", y, ctx.scalar(0.0, y)), gys[0])
    return [ctx.op("Mul", gys[0], mask)]


@register("Sigmoid")
def sigmoid(ctx, node, gys):
    (y,) = node.outputs
    one_minus = ctx.op("Sub", ctx.scalar(1.0, y), y)
    return [ctx.op("Mul", gys[0], ctx.op("Mul", y, one_minus))]


@register("Tanh")
def tanh(ctx, node, gys):
    (y,) = node.outputs
    return [ctx.op("Mul", gys[0], ctx.op("Sub", ctx.scalar(1.0, y), ctx.op("Mul", y, y)))]


def _axis(ctx, node) -> int:
    if ctx.opset < 13:
        raise ValueError(f"{node.op_type} before opset 13 flattens its input; convert the model "
                         "to opset 13 or newer")
    return attr(node, "axis", -1)


@register("Softmax")
def softmax(ctx, node, gys):
    (y,) = node.outputs
    axes = ctx.ints([_axis(ctx, node)])
    gy = ctx.op("Mul", gys[0], y)
    return [ctx.op("Sub", gy, ctx.op("Mul", y, ctx.op("ReduceSum", gy, axes, keepdims=1)))]


@register("LogSoftmax")
def log_softmax(ctx, node, gys):
    (y,) = node.outputs
    axes = ctx.ints([_axis(ctx, node)])
    total = ctx.op("ReduceSum", gys[0], axes, keepdims=1)
    return [ctx.op("Sub", gys[0], ctx.op("Mul", ctx.op("Exp", y), total))]


@register("LeakyRelu")
def leaky_relu(ctx, node, gys):
    (x,), g = node.inputs, gys[0]
    slope = ctx.scalar(attr(node, "alpha", 0.01), x)
    return [ctx.op("Where", ctx.op("Greater", x, ctx.scalar(0.0, x)), g,
                   ctx.op("Mul", g, slope))]


@register("Gelu")
def gelu(ctx, node, gys):
    (x,), g = node.inputs, gys[0]
    half, one = ctx.scalar(0.5, x), ctx.scalar(1.0, x)
    if attr(node, "approximate", "none") == "tanh":
        # y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        x2 = ctx.op("Mul", x, x)
        u = ctx.op("Mul", ctx.scalar(c, x),
                   ctx.op("Mul", x, ctx.op("Add", one, ctx.op("Mul", ctx.scalar(k, x), x2))))
        t = ctx.op("Tanh", u)
        du = ctx.op("Mul", ctx.scalar(c, x),
                    ctx.op("Add", one, ctx.op("Mul", ctx.scalar(3 * k, x), x2)))
        sech2 = ctx.op("Sub", one, ctx.op("Mul", t, t))
        dy = ctx.op("Add", ctx.op("Mul", half, ctx.op("Add", one, t)),
                    ctx.op("Mul", ctx.op("Mul", half, x), ctx.op("Mul", sech2, du)))
    else:  # y = x Phi(x): dy = Phi(x) + x phi(x)
        cdf = ctx.op("Mul", half, ctx.op("Add", one, ctx.op(
            "Erf", ctx.op("Mul", x, ctx.scalar(1.0 / math.sqrt(2.0), x)))))
        pdf = ctx.op("Mul", ctx.scalar(1.0 / math.sqrt(2.0 * math.pi), x), ctx.op(
            "Exp", ctx.op("Mul", ctx.op("Mul", x, x), ctx.scalar(-0.5, x))))
        dy = ctx.op("Add", cdf, ctx.op("Mul", x, pdf))
    return [ctx.op("Mul", g, dy)]


def _inside(ctx, x, alpha: float, beta: float):
    """1 where 0 < alpha x + beta < 1 (the linear piece of a hard sigmoid), else 0, like x."""
    z = ctx.op("Add", ctx.op("Mul", x, ctx.scalar(alpha, x)), ctx.scalar(beta, x))
    return ctx.op("CastLike", ctx.op("And", ctx.op("Greater", z, ctx.scalar(0.0, x)),
                                     ctx.op("Less", z, ctx.scalar(1.0, x))), x), z


@register("HardSigmoid")
def hard_sigmoid(ctx, node, gys):
    """y = max(0, min(1, alpha x + beta)): dy/dx = alpha on the linear piece, else 0."""
    (x,), g = node.inputs, gys[0]
    alpha = attr(node, "alpha", 0.2)
    inside, _ = _inside(ctx, x, alpha, attr(node, "beta", 0.5))
    return [ctx.op("Mul", g, ctx.op("Mul", inside, ctx.scalar(alpha, x)))]


@register("HardSwish")
def hard_swish(ctx, node, gys):
    """y = x * hardsigmoid(x) with alpha 1/6, beta 1/2: dy/dx = 0 below -3, 1 above 3, and
    x/3 + 1/2 between."""
    (x,), g = node.inputs, gys[0]
    inside, z = _inside(ctx, x, 1.0 / 6.0, 0.5)
    above = ctx.op("CastLike", ctx.op("GreaterOrEqual", z, ctx.scalar(1.0, x)), x)
    slope = ctx.op("Add", ctx.op("Mul", x, ctx.scalar(1.0 / 3.0, x)), ctx.scalar(0.5, x))
    return [ctx.op("Mul", g, ctx.op("Add", ctx.op("Mul", inside, slope), above))]
