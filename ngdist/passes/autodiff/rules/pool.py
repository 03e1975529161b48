"""Pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool, MaxUnpool, Col2Im.

MaxPool routes each output gradient to the element its ``Indices`` output names (the output is
added to the forward node when absent, so the argmax is never recomputed; ties go to the first
maximum in row-major order, as onnxruntime's kernel picks): MaxUnpool when the windows are
disjoint (stride >= window extent), else a ScatterElements that adds where windows overlap.
AveragePool divides the gradient by each window's divisor and spreads it over the window: a
nearest Resize when the windows tile the input, an Expand when one window covers the whole
input, else a ConvTranspose of a ones kernel (count_include_pad either way, ceil_mode, pads,
strides, dilations); over symbolic spatial sizes the divisors come from a Conv of ones at run
time (ceil_mode's last windows, which reach past the input and its end pad, counted on an
indicator padded with zeros) and the spread is fitted to Shape(x).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import (dims, ensure_output, fit_spatial, known_rank,
                                                  window, window_attributes)


# element types of onnxruntime's CPU MaxUnpool and Resize kernels (no float64)
UNPOOL_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16}


@register("MaxPool")
def max_pool(ctx, node, gys):
    x = node.inputs[0]
    if attr(node, "storage_order", 0) != 0:
        raise ValueError("MaxPool with storage_order=1 (column-major indices) is not "
                         "differentiated")
    indices = ensure_output(node, 1, "indices", ir.DataType.INT64, node.outputs[0].shape)
    g = gys[0]
    kernel = list(attr(node, "kernel_shape"))
    spatial = dims(x, "MaxPool input", 2) if x.shape is not None else [None] * len(kernel)
    strides, dilations, auto_pad = window_attributes(node, len(kernel))
    if not (auto_pad.startswith("SAME") and None in spatial):  # pads known only at run time
        window(node, spatial, kernel)  # refuses a window that cannot run; no pads needed here
    disjoint = all(s >= (k - 1) * d + 1 for k, s, d in zip(kernel, strides, dilations))
    if disjoint and x.dtype in UNPOOL_TYPES and _fits(x, node.outputs[0]):
        # no window shares an element, so each index occurs once: MaxUnpool's write is the
        # scatter-add below, 4x faster ([128, 64, 8, 8], 2x2: 0.19 vs 0.79 ms). Its window
        # attributes only bound the output shape from below; given 1s, that bound is the
        # pooled size, which _fits checked.
        ones = [1] * len(kernel)
        return [ctx.op("MaxUnpool", g, indices, ctx.op("Shape", x), kernel_shape=ones,
                       strides=ones)]
    zeros = ctx.op("CastLike", ctx.op("ConstantOfShape", ctx.op("Reshape", ctx.op("Size", x),
                                                                ctx.ints([1])),
                                      value=ir.tensor(np.zeros(1, np.float32))), g)
    flat = ctx.op("ScatterElements", zeros, ctx.op("Reshape", indices, ctx.ints([-1])),
                  ctx.op("Reshape", g, ctx.ints([-1])), axis=0, reduction="add")
    return [ctx.op("Reshape", flat, ctx.op("Shape", x))]


def _fits(x: ir.Value, y: ir.Value) -> bool:
    """Whether the pooled spatial sizes of ``y`` are known and at most those of ``x``."""
    if x.shape is None or y.shape is None:
        return False
    dims = list(zip(list(x.shape.dims)[2:], list(y.shape.dims)[2:]))
    return bool(dims) and all(isinstance(a, int) and isinstance(b, int) and b <= a
                              for a, b in dims)


def _pool_sizes(node, spatial, kernel, strides, dilations, begin, end) -> list[int]:
    out_shape = node.outputs[0].shape
    if out_shape is not None and all(isinstance(d, int) for d in list(out_shape.dims)[2:]):
        return [int(d) for d in list(out_shape.dims)[2:]]
    sizes = []
    for n, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begin, end):
        span = n + b + e - ((k - 1) * d + 1)
        o = (-(-span // s) if attr(node, "ceil_mode", 0) else span // s) + 1
        if attr(node, "ceil_mode", 0) and (o - 1) * s >= n + b:
            o -= 1  # the last window must start inside the input or the leading pad
        sizes.append(o)
    return sizes


def _divisors(include_pad: bool, n: int, k: int, s: int, d: int, b: int, e: int,
              o: int) -> np.ndarray:
    """How many taps each of the ``o`` windows of one axis averages over."""
    counts = []
    for i in range(o):
        taps = [i * s - b + j * d for j in range(k)]
        counts.append(sum(1 for t in taps if (t < n + e if include_pad else 0 <= t < n)))
    return np.asarray(counts, np.float64)


@register("AveragePool")
def average_pool(ctx, node, gys):
    x, g = node.inputs[0], gys[0]
    spatial = dims(x, "AveragePool input", 2)
    kernel = list(attr(node, "kernel_shape"))
    strides, dilations, begin, end = window(node, spatial, kernel)
    if None in spatial:
        return [_average_pool_dynamic(ctx, node, x, g, kernel, strides, dilations, begin, end)]
    sizes = _pool_sizes(node, spatial, kernel, strides, dilations, begin, end)
    include_pad = bool(attr(node, "count_include_pad", 0))
    divisor = np.ones(sizes)
    crop_end, extra = [], []
    for axis, (n, k, s, d, b, e, o) in enumerate(
            zip(spatial, kernel, strides, dilations, begin, end, sizes)):
        shape = [1] * len(sizes)
        shape[axis] = o
        divisor = divisor * _divisors(include_pad, n, k, s, d, b, e, o).reshape(shape)
        reach = s * (o - 1) + (k - 1) * d + 1 - b  # where the transposed windows end
        crop_end.append(max(0, reach - n))
        extra.append(max(0, n - reach))
    scaled = ctx.op("Mul", g, ctx.const((1.0 / divisor).astype(np.float32), like=g))
    if all(o == 1 and b == 0 and (k - 1) * d + 1 >= n and (d == 1 or n == 1)
           for n, k, d, b, o in zip(spatial, kernel, dilations, begin, sizes)):
        # one window covers the whole input (a global pool written as AveragePool, as Hugging
        # Face's EfficientNet pooler with its kernel of hidden_dim and ceil_mode): every element
        # gets the one scaled value; a transposed window as large as the kernel is never built
        return [ctx.op("Expand", scaled, ctx.op("Shape", x))]
    tiles = all(s == k and d == 1 and b == e == 0 and n == o * k for n, k, s, d, b, e, o
                in zip(spatial, kernel, strides, dilations, begin, end, sizes))
    if tiles and x.dtype in UNPOOL_TYPES:
        # the windows tile the input: each element gets its window's value, a nearest
        # upsampling ([128, 64, 8, 8], 2x2: 1.8 -> 0.56 ms forward + backward)
        scales = ctx.const(np.array([1.0, 1.0, *kernel], np.float32))
        return [ctx.op("Resize", scaled, None, scales, mode="nearest",
                       coordinate_transformation_mode="asymmetric", nearest_mode="floor")]
    flat = ctx.op("Reshape", scaled, ctx.ints([-1, 1, *sizes]))
    ones = ctx.const(np.ones([1, 1, *kernel], np.float32), like=g)
    spread = ctx.op("ConvTranspose", flat, ones, strides=strides, dilations=dilations,
                    pads=[*begin, *crop_end], output_padding=extra)
    return [ctx.op("Reshape", spread, ctx.op("Shape", x))]


def _average_pool_dynamic(ctx, node, x, g, kernel, strides, dilations, begin, end):
    """AveragePool's gradient over spatial sizes known only at run time: the output gradient
    divided by each window's divisor (``_run_time_counts``), spread by a transposed window of
    ones and padded or cropped to the input's extents."""
    n = len(kernel)
    window_attrs = dict(strides=strides, dilations=dilations)
    ones_k = ctx.const(np.ones([1, 1, *kernel], np.float32), like=g)
    counts = _run_time_counts(ctx, node, x, g, ones_k, begin, end, window_attrs)
    scaled = ctx.op("Mul", g, ctx.scalar(1.0 / float(np.prod(kernel)), g)) if counts is None \
        else ctx.op("Div", g, counts)
    flat = ctx.op("Reshape", scaled, ctx.op("Concat", ctx.ints([-1, 1]),
                                            ctx.op("Shape", g, start=2), axis=0))
    spread = ctx.op("ConvTranspose", flat, ones_k, pads=[*begin, *[0] * n], **window_attrs)
    return ctx.op("Reshape", fit_spatial(ctx, spread, x, n), ctx.op("Shape", x))


def _run_time_counts(ctx, node, x, g, ones_k, begin, end, window_attrs):
    """Each window's divisor [1, 1, *out] as a Conv of ones over an indicator of the counted
    positions (the input; with count_include_pad=1 its pads too), or None where every window
    counts prod(kernel) (count_include_pad=1 without ceil_mode: no window leaves the pads).
    ceil_mode's last window may reach past the end pad (torch and onnxruntime count only the
    taps before it): the indicator gets zeros there, enough for any input size (a window's
    extent plus a stride), and the Conv's output is cut to the pooled sizes, Shape(g)."""
    include_pad, ceil = attr(node, "count_include_pad", 0), attr(node, "ceil_mode", 0)
    if include_pad and not ceil:
        return None
    n = len(begin)
    plane = ctx.op("Concat", ctx.ints([1, 1]), ctx.op("Shape", x, start=2), axis=0)
    ones = ctx.op("CastLike", ctx.op("ConstantOfShape", plane,
                                     value=ir.tensor(np.ones(1, np.float32))), g)
    if not ceil:
        return ctx.op("Conv", ones, ones_k, pads=[*begin, *end], **window_attrs)
    over = [(k - 1) * d + s - 1 for k, d, s in zip(list(attr(node, "kernel_shape")),
                                                   window_attrs["dilations"],
                                                   window_attrs["strides"])]
    if include_pad:  # the pads count: ones there, zeros past them
        ones = ctx.op("Pad", ones, ctx.ints([0, 0, *begin, 0, 0, *end]),
                      ctx.const(np.float32(1.0), like=g))
        begin, end = [0] * n, [0] * n
    padded = ctx.op("Pad", ones, ctx.ints([0, 0, *begin, 0, 0,
                                           *[e + o for e, o in zip(end, over)]]))
    counts = ctx.op("Conv", padded, ones_k, **window_attrs)
    return ctx.op("Slice", counts, ctx.ints([0] * n), ctx.op("Shape", g, start=2),
                  ctx.ints(list(range(2, n + 2))))


@register("GlobalAveragePool")
def global_average_pool(ctx, node, gys):
    x, (y,) = node.inputs[0], node.outputs
    ratio = ctx.op("Div", ctx.op("CastLike", ctx.op("Size", y), x),
                   ctx.op("CastLike", ctx.op("Size", x), x))
    return [ctx.op("Expand", ctx.op("Mul", gys[0], ratio), ctx.op("Shape", x))]


@register("GlobalMaxPool")
def global_max_pool(ctx, node, gys):
    x, (y,) = node.inputs[0], node.outputs
    rank = known_rank(x, "GlobalMaxPool input")
    mask = ctx.op("CastLike", ctx.op("Equal", x, y), x)  # ties share the gradient equally
    count = ctx.op("ReduceSum", mask, ctx.ints(list(range(2, rank))), keepdims=1)
    return [ctx.op("Mul", mask, ctx.op("Div", gys[0], count))]


@register("MaxUnpool")
def max_unpool(ctx, node, gys):
    """y[I[k]] = x[k] (I indexes the flattened output, as MaxPool's Indices do): dx is the
    output gradient read back at I; the indices and output_shape get none."""
    x, indices = node.inputs[:2]
    flat = ctx.op("Gather", ctx.op("Reshape", gys[0], ctx.ints([-1])),
                  ctx.op("Reshape", indices, ctx.ints([-1])), axis=0)
    return [ctx.op("Reshape", flat, ctx.op("Shape", x)), None, None]


@register("Col2Im")
def col2im(ctx, node, gys):
    """Col2Im (F.fold) is the adjoint of im2col (F.unfold): the columns' gradient is the
    output gradient unfolded, a grouped Conv (one group per channel) whose kernels pick one
    block position each, with the node's strides, dilations and pads."""
    cols, _, block_shape = node.inputs
    block = ctx.constant_value(block_shape)
    channels = dims(cols, "Col2Im input")[1]
    if block is None or channels is None:
        raise ValueError("Col2Im needs a constant block_shape and a static column count to "
                         "differentiate")
    block = [int(b) for b in np.asarray(block).reshape(-1)]
    taps = int(np.prod(block))
    c = channels // taps
    picks = np.tile(np.eye(taps, dtype=np.float32).reshape([taps, 1, *block]), (c, 1) +
                    (1,) * len(block))
    n = len(block)
    unfolded = ctx.op("Conv", gys[0], ctx.const(picks, like=gys[0]), group=c,
                      strides=list(attr(node, "strides", None) or [1] * n),
                      dilations=list(attr(node, "dilations", None) or [1] * n),
                      pads=list(attr(node, "pads", None) or [0] * (2 * n)))
    return [ctx.op("Reshape", unfolded, ctx.ints([0, 0, -1])), None, None]
