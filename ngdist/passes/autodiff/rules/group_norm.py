"""Normalizations that return no statistics: InstanceNormalization (also what the
TorchScript exporter makes of ``nn.GroupNorm``), GroupNormalization (opset 21: scale and bias
per channel; the deprecated per-group form of opsets 18-20 is refused), RMSNormalization,
MeanVarianceNormalization, LpNormalization (p = 1 or 2) and LRN.

None of these ops returns its statistics: the backward pass takes them again from X, at X's
precision (GroupNormalization's stash_type only sets the forward's working precision).
"""
from __future__ import annotations

import numpy as np

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import known_rank
from ngdist.passes.autodiff.rules.norm import _moments, _normalized_grad


@register("InstanceNormalization")
def instance_norm(ctx, node, gys):
    """Per (sample, channel) statistics over the spatial axes; scale and bias per channel."""
    x, scale, bias = node.inputs
    g = gys[0]
    rank = known_rank(x, "InstanceNormalization input")
    spatial = ctx.ints(list(range(2, rank)))
    per_channel = ctx.ints([0, *range(2, rank)])
    _, centered, invstd = _moments(ctx, x, spatial, attr(node, "epsilon", 1e-5))
    xhat = ctx.op("Mul", centered, invstd)
    out = [None, None, None]
    if ctx.needs(x):
        gxhat = ctx.op("Mul", g, ctx.op("Unsqueeze", scale, per_channel))
        out[0] = _normalized_grad(ctx, gxhat, xhat, invstd, spatial)
    if ctx.needs(scale):
        out[1] = ctx.op("ReduceSum", ctx.op("Mul", g, xhat), per_channel, keepdims=0)
    if ctx.needs(bias):
        out[2] = ctx.op("ReduceSum", g, per_channel, keepdims=0)
    return out


@register("GroupNormalization")
def group_norm(ctx, node, gys):
    """x [N, C, ...] viewed [N, G, C/G * spatial]: statistics over the last axis; scale and
    bias per channel (opset 21)."""
    x, scale, bias = node.inputs
    g = gys[0]
    if ctx.opset < 21:
        raise ValueError("GroupNormalization before opset 21 (a scale and bias per group) is "
                         "deprecated by ONNX and not differentiated; export with opset 21, or "
                         "with an opset below 18 (nn.GroupNorm becomes InstanceNormalization)")
    rank = known_rank(x, "GroupNormalization input")
    shape = ctx.op("Shape", x)
    view, last = ctx.ints([0, attr(node, "num_groups"), -1]), ctx.ints([2])
    _, centered, invstd = _moments(ctx, ctx.op("Reshape", x, view), last,
                                   attr(node, "epsilon", 1e-5))
    xhat3 = ctx.op("Mul", centered, invstd)
    channel_axes = ctx.ints([0, *range(2, rank)])
    out = [None, None, None]
    if ctx.needs(x):
        gxhat = ctx.op("Mul", g, ctx.op("Unsqueeze", scale, channel_axes))
        dx3 = _normalized_grad(ctx, ctx.op("Reshape", gxhat, view), xhat3, invstd, last)
        out[0] = ctx.op("Reshape", dx3, shape)
    if ctx.needs(scale):
        xhat = ctx.op("Reshape", xhat3, shape)
        out[1] = ctx.op("ReduceSum", ctx.op("Mul", g, xhat), channel_axes, keepdims=0)
    if ctx.needs(bias):
        out[2] = ctx.op("ReduceSum", g, channel_axes, keepdims=0)
    return out


@register("LpNormalization")
def lp_norm(ctx, node, gys):
    """y = x / ||x||_p along ``axis``: dx = (g - d ||x|| / dx * sum(g y)) / ||x||, where
    d ||x|| / dx is y (p = 2) or sign(x) (p = 1); 0 where the norm is 0."""
    (x,), (y,), g = node.inputs, node.outputs, gys[0]
    p = attr(node, "p", 2)
    if p not in (1, 2):
        raise ValueError(f"LpNormalization with p={p} (only 1 and 2 exist)")
    axes = ctx.ints([attr(node, "axis", -1)])
    norm = ctx.op("ReduceL2" if p == 2 else "ReduceL1", x, axes, keepdims=1)
    dnorm = y if p == 2 else ctx.op("Sign", x)
    inner = ctx.op("ReduceSum", ctx.op("Mul", g, y), axes, keepdims=1)
    zero = ctx.scalar(0.0, x)
    null = ctx.op("Equal", norm, zero)
    safe = ctx.op("Where", null, ctx.scalar(1.0, x), norm)
    dx = ctx.op("Div", ctx.op("Sub", g, ctx.op("Mul", dnorm, inner)), safe)
    return [ctx.op("Where", null, zero, dx)]


@register("RMSNormalization")
def rms_norm(ctx, node, gys):
    """y = x s w with s = 1 / sqrt(mean(x^2) + eps) over the axes from ``axis``:
    dx = s gw - x s^3 mean(gw x), gw = g w; the scale gets g x s summed to its shape."""
    x, scale = node.inputs[:2]
    g = gys[0]
    rank = known_rank(x, "RMSNormalization input")
    axes = ctx.ints(list(range(attr(node, "axis", -1) % rank, rank)))
    mean_sq = ctx.op("ReduceMean", ctx.op("Mul", x, x), axes, keepdims=1)
    s = ctx.op("Reciprocal", ctx.op("Sqrt", ctx.op("Add", mean_sq, ctx.scalar(
        attr(node, "epsilon", 1e-5), x))))
    out = [None, None]
    if ctx.needs(x):
        gw = ctx.op("Mul", g, scale)
        inner = ctx.op("ReduceMean", ctx.op("Mul", gw, x), axes, keepdims=1)
        s3 = ctx.op("Mul", s, ctx.op("Mul", s, s))
        out[0] = ctx.op("Sub", ctx.op("Mul", gw, s), ctx.op("Mul", x, ctx.op("Mul", s3, inner)))
    if ctx.needs(scale):
        out[1] = ctx.unbroadcast(ctx.op("Mul", g, ctx.op("Mul", x, s)), scale, grad_rank=rank)
    return out


@register("MeanVarianceNormalization")
def mean_variance_norm(ctx, node, gys):
    """y = c / (sigma + 1e-9), c = x - mean, sigma = sqrt(mean(c^2)) (ONNX's function body):
    dx = u - mean(u), u = g / d - c mean(g c) / (d^2 sigma), d = sigma + 1e-9."""
    (x,), g = node.inputs, gys[0]
    axes = ctx.ints(list(attr(node, "axes", None) or [0, 2, 3]))
    centered = ctx.op("Sub", x, ctx.op("ReduceMean", x, axes, keepdims=1))
    sigma = ctx.op("Sqrt", ctx.op("ReduceMean", ctx.op("Mul", centered, centered), axes,
                                  keepdims=1))
    d = ctx.op("Add", sigma, ctx.scalar(1e-9, x))
    inner = ctx.op("ReduceMean", ctx.op("Mul", g, centered), axes, keepdims=1)
    coef = ctx.op("Div", inner, ctx.op("Mul", ctx.op("Mul", d, d), sigma))
    u = ctx.op("Sub", ctx.op("Div", g, d), ctx.op("Mul", centered, coef))
    return [ctx.op("Sub", u, ctx.op("ReduceMean", u, axes, keepdims=1))]


def _channel_window_sum(ctx, v, size: int, before: int, after: int):
    """sum of ``v`` [N, C, ...] over channels c - before .. c + after (zeros beyond the
    ends), as a Conv of v viewed [N, 1, C, rest] with a ones kernel."""
    view = ctx.op("Concat", ctx.op("Shape", v, start=0, end=1), ctx.ints([1]),
                  ctx.op("Shape", v, start=1, end=2), ctx.ints([-1]), axis=0)
    flat = ctx.op("Reshape", v, view)
    ones = ctx.const(np.ones([1, 1, size, 1], np.float32), like=v)
    summed = ctx.op("Conv", flat, ones, pads=[before, 0, after, 0])
    return ctx.op("Reshape", summed, ctx.op("Shape", v))


@register("LRN")
def lrn(ctx, node, gys):
    """y = x den^-beta, den = bias + alpha / size * sum of x^2 over the channel window
    [c - floor((size-1)/2), c + ceil((size-1)/2)]: dx = g den^-beta - 2 alpha beta / size *
    x * (window sum, reversed, of g x den^(-beta-1))."""
    (x,), (y,), g = node.inputs, node.outputs, gys[0]
    size = attr(node, "size")
    alpha, beta = attr(node, "alpha", 1e-4), attr(node, "beta", 0.75)
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    den = ctx.op("Add", ctx.scalar(attr(node, "bias", 1.0), x), ctx.op(
        "Mul", ctx.scalar(alpha / size, x), _channel_window_sum(ctx, ctx.op("Mul", x, x), size,
                                                                lo, hi)))
    direct = ctx.op("Mul", g, ctx.op("Pow", den, ctx.scalar(-beta, x)))
    through = ctx.op("Div", ctx.op("Mul", g, y), den)  # g x den^(-beta-1)
    spread = _channel_window_sum(ctx, through, size, hi, lo)
    return [ctx.op("Sub", direct, ctx.op("Mul", ctx.op("Mul", x, spread),
                                         ctx.scalar(2.0 * alpha * beta / size, x)))]
