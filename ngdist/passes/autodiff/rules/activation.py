"""Activations: Relu, Sigmoid, Tanh, Softmax, LogSoftmax, LeakyRelu, Gelu (exact and tanh),
HardSigmoid, HardSwish, Elu, Selu, Celu, Softplus, Softsign, Mish, Swish, PRelu,
ThresholdedRelu, Shrink. At a kink the gradient is torch's one-sided choice (x > 0 takes the
positive piece)."""
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


def _positive(ctx, x, threshold: float = 0.0):
    return ctx.op("Greater", x, ctx.scalar(threshold, x))


@register("Elu")
def elu(ctx, node, gys):
    """x > 0: 1, else y + alpha (alpha e^x)."""
    (x,), (y,), g = node.inputs, node.outputs, gys[0]
    neg = ctx.op("Add", y, ctx.scalar(attr(node, "alpha", 1.0), y))
    return [ctx.op("Mul", g, ctx.op("Where", _positive(ctx, x), ctx.scalar(1.0, x), neg))]


@register("Selu")
def selu(ctx, node, gys):
    """x > 0: gamma, else y + alpha gamma."""
    (x,), (y,), g = node.inputs, node.outputs, gys[0]
    alpha = attr(node, "alpha", 1.67326319217681884765625)
    gamma = attr(node, "gamma", 1.05070102214813232421875)
    neg = ctx.op("Add", y, ctx.scalar(alpha * gamma, y))
    return [ctx.op("Mul", g, ctx.op("Where", _positive(ctx, x), ctx.scalar(gamma, x), neg))]


@register("Celu")
def celu(ctx, node, gys):
    """x > 0: 1, else e^(x / alpha) = y / alpha + 1."""
    (x,), (y,), g = node.inputs, node.outputs, gys[0]
    alpha = attr(node, "alpha", 1.0)
    neg = ctx.op("Add", ctx.op("Mul", y, ctx.scalar(1.0 / alpha, y)), ctx.scalar(1.0, y))
    return [ctx.op("Mul", g, ctx.op("Where", _positive(ctx, x), ctx.scalar(1.0, x), neg))]


@register("Softplus")
def softplus(ctx, node, gys):
    return [ctx.op("Mul", gys[0], ctx.op("Sigmoid", node.inputs[0]))]


@register("Softsign")
def softsign(ctx, node, gys):
    """1 / (1 + |x|)^2."""
    (x,) = node.inputs
    den = ctx.op("Add", ctx.scalar(1.0, x), ctx.op("Abs", x))
    return [ctx.op("Div", gys[0], ctx.op("Mul", den, den))]


@register("Mish")
def mish(ctx, node, gys):
    """y = x tanh(softplus(x)): tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2)."""
    (x,), g = node.inputs, gys[0]
    t = ctx.op("Tanh", ctx.op("Softplus", x))
    sech2 = ctx.op("Sub", ctx.scalar(1.0, x), ctx.op("Mul", t, t))
    dy = ctx.op("Add", t, ctx.op("Mul", ctx.op("Mul", x, ctx.op("Sigmoid", x)), sech2))
    return [ctx.op("Mul", g, dy)]


@register("Swish")
def swish(ctx, node, gys):
    """y = x sigmoid(alpha x): s + alpha y (1 - s)."""
    (x,), (y,), g = node.inputs, node.outputs, gys[0]
    alpha = attr(node, "alpha", 1.0)
    s = ctx.op("Sigmoid", ctx.op("Mul", x, ctx.scalar(alpha, x)))
    dy = ctx.op("Add", s, ctx.op("Mul", ctx.op("Mul", y, ctx.scalar(alpha, y)),
                                 ctx.op("Sub", ctx.scalar(1.0, x), s)))
    return [ctx.op("Mul", g, dy)]


@register("PRelu")
def prelu(ctx, node, gys):
    """x > 0: 1, else slope; the slope (broadcast to x) gets g x where x <= 0."""
    (x, slope), g = node.inputs, gys[0]
    pos = _positive(ctx, x)
    zero = ctx.scalar(0.0, g)
    out = [None, None]
    if ctx.needs(x):
        out[0] = ctx.op("Where", pos, g, ctx.op("Mul", g, slope))
    if ctx.needs(slope):
        out[1] = ctx.unbroadcast(ctx.op("Where", pos, zero, ctx.op("Mul", g, x)), slope)
    return out


@register("ThresholdedRelu")
def thresholded_relu(ctx, node, gys):
    (x,), g = node.inputs, gys[0]
    keep = _positive(ctx, x, attr(node, "alpha", 1.0))
    return [ctx.op("Where", keep, g, ctx.scalar(0.0, g))]


@register("Shrink")
def shrink(ctx, node, gys):
    """1 outside [-lambd, lambd], 0 inside."""
    (x,), g = node.inputs, gys[0]
    lambd = attr(node, "lambd", 0.5)
    outside = ctx.op("Or", _positive(ctx, x, lambd), ctx.op("Less", x, ctx.scalar(-lambd, x)))
    return [ctx.op("Where", outside, g, ctx.scalar(0.0, g))]
