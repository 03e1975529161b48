"""Activations: Relu, Sigmoid, Tanh, Softmax, LogSoftmax."""
from __future__ import annotations

from ngdist.passes.autodiff.registry import attr, register


@register("Relu")
def relu(ctx, node, gys):
    (x,) = node.inputs
    mask = ctx.op("CastLike", ctx.op("Greater", x, ctx.const(0.0, like=x)), gys[0])
    return [ctx.op("Mul", gys[0], mask)]


@register("Sigmoid")
def sigmoid(ctx, node, gys):
    (y,) = node.outputs
    one_minus = ctx.op("Sub", ctx.const(1.0, like=y), y)
    return [ctx.op("Mul", gys[0], ctx.op("Mul", y, one_minus))]


@register("Tanh")
def tanh(ctx, node, gys):
    (y,) = node.outputs
    return [ctx.op("Mul", gys[0], ctx.op("Sub", ctx.const(1.0, like=y), ctx.op("Mul", y, y)))]


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
