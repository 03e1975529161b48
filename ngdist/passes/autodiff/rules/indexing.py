"""Indexing: Gather (embedding lookup), GatherElements, GatherND, Slice, Compress,
ScatterElements (every reduction) and ScatterND (reduction none or add). Indices, starts, ends,
axes and steps get no gradient.

Gather and GatherElements scatter-add the gradient back (repeated indices accumulate; negative
indices count from the end). Slice scatters the gradient into zeros at the positions that a
Slice, with the forward node's own starts/ends/axes/steps, picks from an index ramp, so every
Slice form (negative steps, clamped bounds, run-time bounds) has the forward op's semantics.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import known_rank


def _zeros(ctx, shape, like):
    zero = ctx.op("ConstantOfShape", shape, value=ir.tensor(np.zeros(1, np.float32)))
    return ctx.op("CastLike", zero, like)


def _wrap(ctx, indices, shape, axis: int):
    """int64 indices with negative ones counted from the end of ``axis`` of ``shape``."""
    idx = ctx.op("Cast", indices, to=ir.DataType.INT64)
    extent = ctx.op("Gather", shape, ctx.const(np.array(axis, np.int64)))  # a scalar
    zero = ctx.const(np.array(0, np.int64))
    return ctx.op("Where", ctx.op("Less", idx, zero), ctx.op("Add", idx, extent), idx)


@register("Gather")
def gather(ctx, node, gys):
    data, indices = node.inputs
    g = gys[0]
    axis = attr(node, "axis", 0)
    if axis != 0:  # the permutations below need both ranks; axis 0 needs neither
        axis %= known_rank(data, "Gather data")
    shape = ctx.op("Shape", data)
    idx = _wrap(ctx, indices, shape, axis)
    idx = ctx.op("Unsqueeze", idx, ctx.ints([-1]))
    if axis == 0:
        return [ctx.op("ScatterND", _zeros(ctx, shape, g), idx, g, reduction="add"), None]
    # move the gathered axis to the front: ScatterND indexes leading axes only
    rank, irank = known_rank(data, "Gather data"), known_rank(indices, "Gather indices")
    perm = [axis, *range(axis), *range(axis + 1, rank)]
    g_perm = [*range(axis, axis + irank), *range(axis), *range(axis + irank, rank + irank - 1)]
    front = _zeros(ctx, ctx.op("Gather", shape, ctx.ints(perm)), g)
    scattered = ctx.op("ScatterND", front, idx, ctx.op("Transpose", g, perm=g_perm),
                       reduction="add")
    return [ctx.op("Transpose", scattered, perm=np.argsort(perm).tolist()), None]


@register("GatherElements")
def gather_elements(ctx, node, gys):
    data, indices = node.inputs
    axis = attr(node, "axis", 0)
    if axis < 0:
        axis %= known_rank(data, "GatherElements data")
    shape = ctx.op("Shape", data)
    idx = _wrap(ctx, indices, shape, axis)
    return [ctx.op("ScatterElements", _zeros(ctx, shape, gys[0]), idx, gys[0], axis=axis,
                   reduction="add"), None]


@register("Slice")
def slice_(ctx, node, gys):
    x = node.inputs[0]
    shape = ctx.op("Shape", x)
    size = ctx.op("Size", x)
    ramp = ctx.op("Reshape", ctx.op("Range", ctx.const(np.array(0, np.int64)), size,
                                    ctx.const(np.array(1, np.int64))), shape)
    picked = ctx.op("Slice", ramp, *node.inputs[1:])
    flat = ctx.op("ScatterElements", _zeros(ctx, ctx.op("Reshape", size, ctx.ints([1])), gys[0]),
                  ctx.op("Reshape", picked, ctx.ints([-1])),
                  ctx.op("Reshape", gys[0], ctx.ints([-1])), axis=0)
    return [ctx.op("Reshape", flat, shape), None, None, None, None]


@register("GatherND")
def gather_nd(ctx, node, gys):
    """Scatter-add the gradient back to the gathered slices (batch_dims 0)."""
    data, indices = node.inputs
    if attr(node, "batch_dims", 0):
        raise ValueError(f"GatherND with batch_dims={attr(node, 'batch_dims')} is not "
                         "differentiated (only 0); index with batch_dims=0 (prepend the batch "
                         "positions to the indices)")
    shape = ctx.op("Shape", data)
    return [ctx.op("ScatterND", _zeros(ctx, shape, gys[0]), indices, gys[0], reduction="add"),
            None]


def _scatter_reduction(node, allowed=("none", "add")) -> str:
    reduction = attr(node, "reduction", "none")
    if reduction not in allowed:
        raise ValueError(f"{node.op_type} with reduction={reduction!r} is not differentiated "
                         f"(only {' and '.join(repr(r) for r in allowed)})")
    return reduction


@register("ScatterElements")
def scatter_elements(ctx, node, gys):
    """data: g, zeroed where an update overwrote it (reduction none); updates: g gathered at
    their positions. Repeated indices under reduction none: each update gets the gradient of
    its position, as torch's scatter backward gives (torch documents such indices as
    unsupported: which write lands is unspecified). Reductions mul, max and min as torch's
    ``scatter_reduce`` (include_self) backward: :func:`_scatter_extreme`,
    :func:`_scatter_product`."""
    data, indices, updates = node.inputs
    g = gys[0]
    axis = attr(node, "axis", 0)
    if axis < 0:
        axis %= known_rank(data, "ScatterElements data")
    idx = _wrap(ctx, indices, ctx.op("Shape", data), axis)
    reduction = _scatter_reduction(node, ("none", "add", "mul", "max", "min"))
    if reduction in ("max", "min"):
        return _scatter_extreme(ctx, node, g, idx, axis)
    if reduction == "mul":
        return _scatter_product(ctx, node, g, idx, axis)
    out = [None, None, None]
    if ctx.needs(data):
        out[0] = g if reduction == "add" else ctx.op(
            "ScatterElements", g, idx, _zeros(ctx, ctx.op("Shape", updates), g), axis=axis)
    if ctx.needs(updates):
        out[2] = ctx.op("GatherElements", g, idx, axis=axis)
    return out


def _scatter_extreme(ctx, node, g, idx, axis: int):
    """max/min: the gradient shared equally among the values equal to the result, data and
    updates alike (torch's amax/amin)."""
    data, _, updates = node.inputs
    (y,) = node.outputs
    at = ctx.op("GatherElements", y, idx, axis=axis)
    data_ties = ctx.op("CastLike", ctx.op("Equal", data, y), g)
    update_ties = ctx.op("CastLike", ctx.op("Equal", updates, at), g)
    count = ctx.op("ScatterElements", data_ties, idx, update_ties, axis=axis, reduction="add")
    shared = ctx.op("Div", g, count)
    return [ctx.op("Mul", data_ties, shared) if ctx.needs(data) else None, None,
            ctx.op("Mul", update_ties, ctx.op("GatherElements", shared, idx, axis=axis))
            if ctx.needs(updates) else None]


def _scatter_product(ctx, node, g, idx, axis: int):
    """mul: each factor's gradient is the product of the others, as torch computes it: the
    result divided by the factor, except for data that is zero (the updates' product) and an
    update that is its position's only zero update (the product with it taken as 1)."""
    data, _, updates = node.inputs
    (y,) = node.outputs
    zero, one = ctx.const(0.0, like=data), ctx.const(1.0, like=data)
    out = [None, None, None]
    if ctx.needs(data):
        masked = ctx.op("Where", ctx.op("Equal", data, zero), one, data)
        others = ctx.op("ScatterElements", masked, idx, updates, axis=axis, reduction="mul")
        out[0] = ctx.op("Div", ctx.op("Mul", g, others), masked)
    if ctx.needs(updates):
        zeros = ctx.op("Equal", updates, zero)
        counts = ctx.op("ScatterElements", _zeros(ctx, ctx.op("Shape", data), g), idx,
                        ctx.op("CastLike", zeros, g), axis=axis, reduction="add")
        alone = ctx.op("And", zeros, ctx.op("Equal", ctx.op(
            "GatherElements", counts, idx, axis=axis), one))
        without = ctx.op("ScatterElements", data, idx, ctx.op("Where", alone, one, updates),
                         axis=axis, reduction="mul")
        gy = ctx.op("Div", ctx.op("GatherElements", ctx.op("Mul", g, y), idx, axis=axis),
                    ctx.op("Where", zeros, one, updates))
        out[2] = ctx.op("Where", alone, ctx.op("GatherElements", ctx.op("Mul", g, without),
                                               idx, axis=axis), gy)
    return out


@register("ScatterND")
def scatter_nd(ctx, node, gys):
    """As ScatterElements, over index tuples of the leading axes."""
    data, indices, updates = node.inputs
    g = gys[0]
    out = [None, None, None]
    if ctx.needs(data):
        out[0] = g if _scatter_reduction(node) == "add" else ctx.op(
            "ScatterND", g, indices, _zeros(ctx, ctx.op("Shape", updates), g))
    if ctx.needs(updates):
        _scatter_reduction(node)
        out[2] = ctx.op("GatherND", g, indices)
    return out


@register("Compress")
def compress(ctx, node, gys):
    """The kept slices' gradient written back at the positions where the condition holds
    (along ``axis``, or of the flattened input without one); the condition gets none."""
    x, condition = node.inputs
    g = gys[0]
    idx = ctx.op("Reshape", ctx.op("NonZero", condition), ctx.ints([-1, 1]))
    shape = ctx.op("Shape", x)
    axis = attr(node, "axis")
    if axis is None:
        size = ctx.op("Reshape", ctx.op("Size", x), ctx.ints([1]))
        flat = ctx.op("ScatterND", _zeros(ctx, size, g), idx, g)
        return [ctx.op("Reshape", flat, shape), None]
    rank = known_rank(x, "Compress input")
    axis %= rank
    perm = [axis, *range(axis), *range(axis + 1, rank)]
    front = _zeros(ctx, ctx.op("Gather", shape, ctx.ints(perm)), g)
    scattered = ctx.op("ScatterND", front, idx, ctx.op("Transpose", g, perm=perm))
    return [ctx.op("Transpose", scattered, perm=np.argsort(perm).tolist()), None]
