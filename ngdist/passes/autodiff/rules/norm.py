"""Normalization and regularization: BatchNormalization, LayerNormalization, Dropout.

BatchNormalization in training mode normalizes with the batch statistics; ONNX's op returns
no saved mean/variance, so the backward pass takes them again from X (two per-channel
reductions). Its running mean/variance outputs are state, not differentiated. In inference
mode the input mean and variance get gradients too. LayerNormalization reuses the forward
node's Mean and InvStdDev outputs (added to the node when absent). Dropout reuses the forward
node's mask (added when absent), so the seed and random stream stay the forward node's own.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import dims, ensure_output, known_rank


def _moments(ctx, x, axes, eps: float):
    """(mean, x - mean, 1/sqrt(var + eps)) over ``axes``, kept as broadcastable dims."""
    mean = ctx.op("ReduceMean", x, axes, keepdims=1)
    centered = ctx.op("Sub", x, mean)
    var = ctx.op("ReduceMean", ctx.op("Mul", centered, centered), axes, keepdims=1)
    one = ctx.scalar(1.0, x)
    return mean, centered, ctx.op("Div", one, ctx.op("Sqrt", ctx.op("Add", var,
                                                                     ctx.scalar(eps, x))))


def _normalized_grad(ctx, gxhat, xhat, invstd, axes):
    """d loss / d x of xhat = (x - mean(x)) * invstd, given d loss / d xhat."""
    m1 = ctx.op("ReduceMean", gxhat, axes, keepdims=1)
    m2 = ctx.op("ReduceMean", ctx.op("Mul", gxhat, xhat), axes, keepdims=1)
    return ctx.op("Mul", invstd, ctx.op("Sub", ctx.op("Sub", gxhat, m1), ctx.op("Mul", xhat, m2)))


def _count(ctx, x, axes_list: list[int], rank: int) -> ir.Value:
    """1 / (number of values per channel), shaped [1] * rank like x: a constant when the
    reduced sizes are static, else Size(x) / Shape(x)[1] at run time."""
    sizes = dims(x, "BatchNormalization input")
    if all(sizes[a] is not None for a in axes_list):
        return ctx.scalar(1.0 / math.prod(sizes[a] for a in axes_list), x)
    n = ctx.op("Div", ctx.op("Size", x), ctx.op("Shape", x, start=1, end=2))
    return ctx.op("Reshape", ctx.op("Div", ctx.scalar(1.0, x), ctx.op("CastLike", n, x)),
                  ctx.ints([1] * rank))


def _channels(scale: ir.Value) -> int | None:
    """The static channel count of a BatchNormalization (its scale's length), else None."""
    if scale.shape is None or scale.shape.rank() != 1 or not isinstance(scale.shape[0], int):
        return None
    return scale.shape[0]


def _channel_affine(ctx, t, a, b, channels: int) -> ir.Value:
    """a * t + b for per-channel a and b (shaped [1, C, 1, ...]; ``b`` may be None), as one
    inference-mode BatchNormalization with mean 0, variance 1 and epsilon 0. onnxruntime's Mul
    and Add broadcast a [1, C, 1, 1] operand slowly over small maps (104 us for [8, 960, 2, 2]
    against 38 us for the BatchNormalization; equal at 32x32)."""
    flat = ctx.ints([-1])
    zeros = ctx.const(np.zeros(channels, np.float32), like=t)
    ones = ctx.const(np.ones(channels, np.float32), like=t)
    bias = zeros if b is None else ctx.op("Reshape", b, flat)
    return ctx.op("BatchNormalization", t, ctx.op("Reshape", a, flat), bias, zeros, ones,
                  epsilon=0.0)


@register("BatchNormalization")
def batch_norm(ctx, node, gys):
    """Training mode: with per-channel sums gsum = sum(g), gc = sum(g * (x - mean)) and
    a = scale * invstd, dx = a * g - (a * invstd^2 * gc / n) * (x - mean) - a * gsum / n:
    two per-channel affine maps and one sum besides the statistics, the other terms per
    channel (the textbook form through xhat and gxhat takes twice the full-size passes).
    The per-channel maps are :func:`_channel_affine`."""
    x, scale, bias, mean_in, var_in = node.inputs[:5]
    g = gys[0]
    if g is None:  # only the running statistics are used: they are state, not differentiable
        return [None] * 5
    rank = known_rank(x, "BatchNormalization input")
    eps = attr(node, "epsilon", 1e-5)
    axes_list = [0, *range(2, rank)]
    axes = ctx.ints(axes_list)  # also the axes that unsqueeze [C] to [1, C, 1, ...]
    scale_b = ctx.op("Unsqueeze", scale, axes)
    out = [None] * 5
    if attr(node, "training_mode", 0):
        mean, centered, invstd = _moments(ctx, x, axes, eps)
        flat = ctx.ints([-1])
        gsum = ctx.op("ReduceSum", g, axes, keepdims=1)
        gc = None
        if ctx.needs(scale) or ctx.needs(x):
            gc = ctx.op("ReduceSum", ctx.op("Mul", g, centered), axes, keepdims=1)
        if ctx.needs(scale):
            out[1] = ctx.op("Reshape", ctx.op("Mul", gc, invstd), flat)
        if ctx.needs(bias):
            out[2] = ctx.op("Reshape", gsum, flat)
        if ctx.needs(x):
            a = ctx.op("Mul", scale_b, invstd)
            a_n = ctx.op("Mul", a, _count(ctx, x, axes_list, rank))
            k1 = ctx.op("Neg", ctx.op("Mul", ctx.op("Mul", a_n, gc),
                                      ctx.op("Mul", invstd, invstd)))
            k0 = ctx.op("Neg", ctx.op("Mul", a_n, gsum))
            channels = _channels(scale)
            if channels is None:
                out[0] = ctx.op("Add", ctx.op("Add", ctx.op("Mul", g, a), k0),
                                ctx.op("Mul", centered, k1))
            else:
                out[0] = ctx.op("Add", _channel_affine(ctx, g, a, k0, channels),
                                _channel_affine(ctx, centered, k1, None, channels))
        return out
    mean = ctx.op("Unsqueeze", mean_in, axes)
    var = ctx.op("Unsqueeze", var_in, axes)
    invstd = ctx.op("Div", ctx.const(1.0, like=x),
                    ctx.op("Sqrt", ctx.op("Add", var, ctx.const(eps, like=x))))
    centered = ctx.op("Sub", x, mean)
    if ctx.needs(x):
        channels = _channels(scale)
        a = ctx.op("Mul", scale_b, invstd)
        out[0] = ctx.op("Mul", g, a) if channels is None else \
            _channel_affine(ctx, g, a, None, channels)
    if ctx.needs(scale):
        out[1] = ctx.op("ReduceSum", ctx.op("Mul", g, ctx.op("Mul", centered, invstd)), axes,
                        keepdims=0)
    gsum = ctx.op("ReduceSum", g, axes, keepdims=0)
    if ctx.needs(bias):
        out[2] = gsum
    if ctx.needs(mean_in) or ctx.needs(var_in):
        inv = ctx.op("Reshape", invstd, ctx.ints([-1]))
    if ctx.needs(mean_in):
        out[3] = ctx.op("Neg", ctx.op("Mul", gsum, ctx.op("Mul", scale, inv)))
    if ctx.needs(var_in):
        gc = ctx.op("ReduceSum", ctx.op("Mul", g, centered), axes, keepdims=0)
        cube = ctx.op("Mul", inv, ctx.op("Mul", inv, inv))
        out[4] = ctx.op("Mul", ctx.op("Mul", gc, scale),
                        ctx.op("Mul", cube, ctx.const(-0.5, like=x)))
    return out


_LOW_PRECISION = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


@register("LayerNormalization")
def layer_norm(ctx, node, gys):
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    rank = known_rank(x, "LayerNormalization input")
    axis = attr(node, "axis", -1) % rank
    axes = ctx.ints(list(range(axis, rank)))
    stash = ir.DataType(attr(node, "stash_type", 1))
    y_shape = node.outputs[0].shape
    stat_shape = None if y_shape is None else \
        ir.Shape([*list(y_shape.dims)[:axis], *([1] * (rank - axis))])
    if x.dtype in _LOW_PRECISION or x.dtype == stash:
        # the forward node's statistics are at least as precise as x: reuse them
        mean = ctx.op("CastLike", ensure_output(node, 1, "mean", stash, stat_shape), x)
        invstd = ctx.op("CastLike", ensure_output(node, 2, "inv_std_dev", stash, stat_shape), x)
    else:  # e.g. float64 x with float32 statistics: recompute them at x's precision
        mean, _, invstd = _moments(ctx, x, axes, attr(node, "epsilon", 1e-5))
    xhat = ctx.op("Mul", ctx.op("Sub", x, mean), invstd)
    out: list = [None, None, None]
    g = gys[0]
    gx = None
    if g is not None:
        if ctx.needs(x):
            gx = _normalized_grad(ctx, ctx.op("Mul", g, scale), xhat, invstd, axes)
        if ctx.needs(scale):
            out[1] = ctx.unbroadcast(ctx.op("Mul", g, xhat), scale, grad_rank=rank)
        if ctx.needs(bias):
            out[2] = ctx.unbroadcast(g, bias, grad_rank=rank)
    if ctx.needs(x) and (len(gys) > 1 and (gys[1] is not None or
                                            (len(gys) > 2 and gys[2] is not None))):
        count = ctx.op("Div", ctx.op("CastLike", ctx.op("Size", x), x),
                       ctx.op("CastLike", ctx.op("Size", mean), x))
        extra = []
        if gys[1] is not None:  # d mean / dx = 1 / count
            extra.append(ctx.op("Div", ctx.op("CastLike", gys[1], x), count))
        if len(gys) > 2 and gys[2] is not None:  # d invstd / dx = -invstd^2 xhat / count
            coef = ctx.op("Div", ctx.op("Mul", invstd, invstd), count)
            extra.append(ctx.op("Neg", ctx.op("Mul", ctx.op("Mul", ctx.op(
                "CastLike", gys[2], x), coef), xhat)))
        base = gx if gx is not None else ctx.zeros_like(x)
        gx = ctx.op("Sum", base, *extra)
    out[0] = gx
    return out


@register("Dropout")
def dropout(ctx, node, gys):
    x = node.inputs[0]
    ratio = node.inputs[1] if len(node.inputs) > 1 else None
    training = node.inputs[2] if len(node.inputs) > 2 else None
    g = gys[0]
    if training is None:
        return [g, None, None]  # inference mode: the identity
    flag = ctx.constant_value(training)
    if flag is not None and not bool(np.asarray(flag).reshape(-1)[0]):
        return [g, None, None]
    mask = ensure_output(node, 1, "mask", ir.DataType.BOOL, node.outputs[0].shape)
    rate = ctx.scalar(0.5, x) if ratio is None else ctx.op("CastLike", ratio, x)
    one = ctx.scalar(1.0, x)
    scale = ctx.op("Div", one, ctx.op("Sub", one, rate))
    if flag is None:  # training_mode decided at run time
        scale = ctx.op("Where", training, scale, one)
    return [ctx.op("Mul", ctx.op("Mul", g, ctx.op("CastLike", mask, x)), scale), None, None]
