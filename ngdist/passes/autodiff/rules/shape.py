"""Shape ops: Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand, Concat, Split, Pad (the
data inputs only; shape, axes, pads and split-size inputs get no gradient)."""
from __future__ import annotations

import numpy as np

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import known_rank


@register("Reshape", "Flatten")
def reshape(ctx, node, gys):
    return [ctx.op("Reshape", gys[0], ctx.op("Shape", node.inputs[0])), None]


@register("Transpose")
def transpose(ctx, node, gys):
    perm = attr(node, "perm")
    if perm is None:
        rank = known_rank(node.inputs[0], "Transpose (without perm) input")
        perm = list(range(rank))[::-1]
    inverse = np.argsort(np.asarray(perm)).tolist()
    return [ctx.op("Transpose", gys[0], perm=inverse)]


@register("Squeeze", "Unsqueeze")
def squeeze(ctx, node, gys):
    return [ctx.op("Reshape", gys[0], ctx.op("Shape", node.inputs[0])), None]


@register("Expand")
def expand(ctx, node, gys):
    return [ctx.unbroadcast(gys[0], node.inputs[0]), None]


def _extent(ctx, value, axis: int):
    """The size of one axis, as a 1-element int64 tensor (static when known)."""
    if value.shape is not None and isinstance(value.shape.dims[axis], int):
        return ctx.ints([value.shape.dims[axis]])
    return ctx.op("Gather", ctx.op("Shape", value), ctx.ints([axis]))


@register("Concat")
def concat(ctx, node, gys):
    rank = ctx.rank(node.outputs[0]) or known_rank(node.inputs[0], "Concat input")
    axis = attr(node, "axis") % rank
    if len(node.inputs) == 1:
        return [gys[0]]
    sizes = ctx.op("Concat", *[_extent(ctx, x, axis) for x in node.inputs], axis=0)
    return list(ctx.op_multi("Split", gys[0], sizes, axis=axis, num_outputs=len(node.inputs)))


@register("Split")
def split(ctx, node, gys):
    rank = known_rank(node.inputs[0], "Split input")
    parts = [g if g is not None else ctx.zeros_like(y) for g, y in zip(gys, node.outputs)]
    return [ctx.op("Concat", *parts, axis=attr(node, "axis", 0) % rank), None]


@register("Pad")
def pad(ctx, node, gys):
    """Constant padding: the gradient is the output gradient padded by the negated pads (a
    positive pad is cut off, a negative one, which cropped, becomes zeros). The pads may be
    computed at run time. Reflect, edge and wrap padding fold several outputs onto one input
    element and have no rule here."""
    mode = attr(node, "mode", "constant")
    if mode != "constant":
        raise ValueError(f"Pad mode {mode!r} has no gradient rule (only 'constant'); pad "
                         "with zeros in the model, or mark the inputs that feed it as frozen")
    if ctx.opset < 11:
        pads = ctx.ints([-p for p in attr(node, "pads")])
        return [ctx.op("Pad", gys[0], pads)]
    neg = ctx.op("Neg", node.inputs[1])
    axes = [node.inputs[3]] if len(node.inputs) > 3 and node.inputs[3] is not None else []
    inputs = [gys[0], neg, None, *axes] if axes else [gys[0], neg]
    return [ctx.op("Pad", *inputs), None, None, None]
