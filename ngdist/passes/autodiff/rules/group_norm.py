"""Normalization over groups of channels and over vectors: InstanceNormalization (also what
the TorchScript exporter makes of ``nn.GroupNorm``), GroupNormalization (opset 21: scale and
bias per channel; the deprecated per-group form of opsets 18-20 is refused) and LpNormalization
(p = 1 or 2).

None of these ops returns its statistics: the backward pass takes them again from X, at X's
precision (GroupNormalization's stash_type only sets the forward's working precision).
"""
from __future__ import annotations

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
