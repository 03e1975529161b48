"""Convolutions: Conv and ConvTranspose (N-D, groups, strides, dilations, pads, auto_pad, bias).

Conv's data gradient is a ConvTranspose with the same weight and window (``output_padding``
restores the rows a strided forward pass dropped when its output size floored), or, stride 1
on a small map (group 1 or depthwise), a Conv of the spatially flipped output gradient with
the channel-swapped weight, flipped back (faster in onnxruntime there); its weight
gradient (group 1, at least 8 input channels) is one matrix product per kernel tap between
the output gradient and a strided slice of the channels-last input, a depthwise one a
product and sum per tap of the same slices with the channels-last output gradient;
otherwise a Conv of the
input with the output gradient, batch and channels swapped, the forward stride becoming the
dilation.
ConvTranspose is the adjoint: its data gradient is a Conv, its weight gradient the same
computation with the roles of input and output gradient swapped.
Static spatial sizes are constants (attributes); symbolic ones are read at run time: the data
gradient's window is fitted to Shape(x) (``_common.fit_spatial``) instead of output_padding,
and the weight gradient takes the single-Conv form.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext, attr, register
from ngdist.passes.autodiff.rules._common import (dims, extents, fit_spatial, shape_text,
                                                  window)


def _swap01(ctx: GradContext, v: ir.Value, rank: int) -> ir.Value:
    return ctx.op("Transpose", v, perm=[1, 0, *range(2, rank)])


MAX_TAPS = 64  # kernels with more taps keep the single-Conv weight gradient (fewer nodes)
# Below 8 input channels a tap's product has too few columns to pay for its Slice (forward +
# weight gradient, 1 thread: 4 channels 0.89x, 6 channels 0.97x, 8 channels 1.09-1.21x, 16-256
# channels 1.5-2.8x the single Conv; a 7x7 stem on 3 channels 0.57x).
MIN_TAP_CHANNELS = 8
# depthwise weight gradients tap by tap up to this many taps (5x5). Tap by tap / grouped Conv,
# one thread, batch 8: 3x3 0.27-0.39 and 5x5 0.20-0.49 over 2x2 to 32x32 maps; 7x7 0.68-0.83
# on 2x2 to 16x16 maps of 40-320 channels but 1.26-1.58 on [8, 768, 2, 2] and [8, 160, 4, 4]
DEPTHWISE_MAX_TAPS = 25
# the one-product (im2col) weight gradient when output positions * this <= output channels:
# its columns (N*out*C*taps values) are then smaller than the weight at batch sizes up to this
COLUMNS_ROWS_PER_POSITION = 16


def by_tap(group: int, kernel: list[int], channels: int | None,
           spatial: list[int | None] | None = None) -> bool:
    """Whether the weight gradient is taken tap by tap (see ``_weight_grad_taps``): it slices
    with static bounds, so it needs static channels and spatial sizes."""
    return group == 1 and math.prod(kernel) <= MAX_TAPS and channels is not None and \
        channels >= MIN_TAP_CHANNELS and None not in (spatial or [])


def channel_rows(ctx: GradContext, gy: ir.Value, rank: int) -> ir.Value:
    """gy [N, M, *out] as the matrix [M, N*prod(out)]."""
    return ctx.op("Reshape", _swap01(ctx, gy, rank), ctx.ints([0, -1]))


def weight_grad(ctx: GradContext, x: ir.Value, gy: ir.Value, *, group: int,
                channels: int | None, kernel: list[int], spatial: list[int | None],
                strides: list[int], dilations: list[int], begin: list[int], end: list[int],
                gy_rows: ir.Value | None = None, out_channels: int | None = None) -> ir.Value:
    """dW [M, C/group, *kernel] of ``y = Conv(x, W)``, x [N, C, *spatial], gy [N, M, *out];
    ``gy_rows``: ``channel_rows`` of gy when the caller has it already. ``channels`` and
    entries of ``spatial`` are None where not static: those sizes are read at run time;
    ``out_channels`` (M) when known picks the one-product form on small maps."""
    window_args: dict[str, list[int]] = dict(kernel=kernel, spatial=spatial, strides=strides,
                                             dilations=dilations, begin=begin, end=end)
    if by_tap(group, kernel, channels, spatial):
        assert channels is not None
        rows = gy_rows if gy_rows is not None else channel_rows(ctx, gy, len(kernel) + 2)
        return _weight_grad_taps(ctx, x, rows, channels=channels, out_channels=out_channels,
                                 **window_args)
    if group > 1 and channels == group and out_channels == group and \
            math.prod(kernel) <= DEPTHWISE_MAX_TAPS and None not in spatial:
        return _weight_grad_depthwise(ctx, x, gy, **window_args)
    return _weight_grad_conv(ctx, x, gy, group=group, channels=channels, **window_args)


def _weight_grad_taps(ctx: GradContext, x: ir.Value, m: ir.Value, *, channels: int,
                      kernel: list[int], spatial: list[int], strides: list[int],
                      dilations: list[int], begin: list[int], end: list[int],
                      out_channels: int | None = None) -> ir.Value:
    """group == 1: one matrix product per kernel tap, gy [M, N*out] @ x_tap [N*out, C].

    x goes channels-last (and padded) once; each tap is a strided Slice of it. This is the
    weight gradient as cuDNN/oneDNN compute it (a reduction over batch and positions in one
    GEMM per tap), and 2x faster on onnxruntime's CPU than a Conv whose kernel is gy (that
    Conv's im2col GEMMs have only prod(kernel) columns): 8.2 -> 3.9 ms for x [128, 32, 8, 8],
    W [64, 32, 3, 3] at one thread.
    Small maps with many output channels (output positions * ``COLUMNS_ROWS_PER_POSITION``
    <= ``out_channels``, when known): the taps' slices are stacked as columns
    [N*out, C, taps] (im2col, N*out*C*taps values) and multiplied once into [M, C*taps],
    W's own layout; the per-tap products would need a [M, taps, C] -> [M, C, taps]
    transpose of the whole weight gradient.
    """
    window_args: dict[str, list[int]] = dict(kernel=kernel, spatial=spatial, strides=strides,
                                             dilations=dilations, begin=begin, end=end)
    out = output_extents(**window_args)
    if out_channels is not None and math.prod(out) * COLUMNS_ROWS_PER_POSITION <= out_channels:
        gw = ctx.op("MatMul", m, im2col(ctx, x, channels, **window_args))  # W's layout
        return ctx.op("Reshape", gw, ctx.ints([0, channels, *kernel]))
    flat = ctx.ints([-1, channels])
    parts = [ctx.op("MatMul", m, ctx.op("Reshape", xt, flat))  # [M, C] per tap
             for xt in _tap_slices(ctx, x, **window_args)[1]]
    gw = parts[0] if len(parts) == 1 else ctx.op("Concat", *parts, axis=1)  # [M, taps*C]
    gw = ctx.op("Reshape", gw, ctx.ints([0, len(parts), channels]))
    gw = ctx.op("Transpose", gw, perm=[0, 2, 1])  # [M, C, taps]
    return ctx.op("Reshape", gw, ctx.ints([0, channels, *kernel]))


def output_extents(kernel: list[int], spatial: list[int], strides: list[int],
                   dilations: list[int], begin: list[int], end: list[int]) -> list[int]:
    """The output's spatial extents of a window over static ``spatial`` sizes."""
    return [(n + b + e - ((k - 1) * d + 1)) // s + 1
            for n, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begin, end)]


def im2col(ctx: GradContext, x: ir.Value, channels: int, *, kernel: list[int],
           spatial: list[int], strides: list[int], dilations: list[int], begin: list[int],
           end: list[int]) -> ir.Value:
    """The columns [N*prod(out), C*taps] of x [N, C, *spatial] under a window, each row one
    output position's receptive field in W's (C, *kernel) order: the taps' strided slices
    stacked along a last axis."""
    _, slices = _tap_slices(ctx, x, kernel, spatial, strides, dilations, begin, end)
    last = ctx.ints([-1])
    parts = [ctx.op("Unsqueeze", xt, last) for xt in slices]  # [N, *out, C, 1]
    cols = parts[0] if len(parts) == 1 else ctx.op("Concat", *parts, axis=-1)
    return ctx.op("Reshape", cols, ctx.ints([-1, channels * len(parts)]))


def _tap_slices(ctx: GradContext, x: ir.Value, kernel: list[int], spatial: list[int],
                strides: list[int], dilations: list[int], begin: list[int], end: list[int]
                ) -> tuple[list[int], Iterator[ir.Value]]:
    """The output extents of a window over x [N, C, *spatial] and, per kernel tap, what the
    tap reads: a strided Slice [N, *out, C] of x gone channels-last (and padded) once, or
    that input itself where the tap reads exactly the unpadded input (the centre of a 'same'
    window). The slices are made as the caller takes them, so each can die after its use."""
    rank = len(kernel) + 2
    xh = ctx.op("Transpose", x, perm=[0, *range(2, rank), 1])  # [N, *spatial, C]
    xp = ctx.op("Pad", xh, ctx.ints([0, *begin, 0, 0, *end, 0])) if any(begin + end) else xh
    out = output_extents(kernel, spatial, strides, dilations, begin, end)
    strided = any(s != 1 for s in strides)
    steps = [ctx.ints(strides)] if strided else []
    axes = ctx.ints(list(range(1, rank - 1)))

    def slices() -> Iterator[ir.Value]:
        for tap in itertools.product(*(range(k) for k in kernel)):
            starts = [t * d for t, d in zip(tap, dilations)]
            if not strided and starts == begin and out == spatial:
                yield xh
            else:
                ends = [b + s * (o - 1) + 1 for b, s, o in zip(starts, strides, out)]
                yield ctx.op("Slice", xp, ctx.ints(starts), ctx.ints(ends), axes, *steps)
    return out, slices()


def _weight_grad_depthwise(ctx: GradContext, x: ir.Value, gy: ir.Value, *, kernel: list[int],
                           spatial: list[int], strides: list[int], dilations: list[int],
                           begin: list[int], end: list[int]) -> ir.Value:
    """Depthwise (group == C == M): per kernel tap, the channels-last input's strided slice
    times the channels-last output gradient, summed over batch and positions into [C].
    2-7x faster on onnxruntime's CPU than the grouped Conv whose kernel is gy (x [8, 144, 16,
    16], 3x3: 1.4 vs 4.8 ms; [8, 960, 2, 2]: 0.19 vs 0.68 ms), whose im2col GEMMs have one
    row and prod(kernel) columns per group."""
    rank = len(kernel) + 2
    _, slices = _tap_slices(ctx, x, kernel, spatial, strides, dilations, begin, end)
    gh = ctx.op("Transpose", gy, perm=[0, *range(2, rank), 1])  # [N, *out, C]
    outer = ctx.ints(list(range(rank - 1)))
    column = ctx.ints([1])
    parts = []
    for xt in slices:
        total = ctx.op("ReduceSum", ctx.op("Mul", xt, gh), outer, keepdims=0)  # [C]
        parts.append(ctx.op("Unsqueeze", total, column))
    gw = parts[0] if len(parts) == 1 else ctx.op("Concat", *parts, axis=1)  # [C, taps]
    return ctx.op("Reshape", gw, ctx.ints([0, 1, *kernel]))


def _weight_grad_conv(ctx: GradContext, x: ir.Value, gy: ir.Value, *, group: int,
                      channels: int | None, kernel: list[int], spatial: list[int | None],
                      strides: list[int], dilations: list[int], begin: list[int],
                      end: list[int]) -> ir.Value:
    """Any group: a Conv of x with gy, batch and channels swapped, the forward stride becoming
    the dilation."""
    rank = len(kernel) + 2
    if group == 1:
        xt = _swap01(ctx, x, rank)  # [C, N, *spatial]: channels become the batch
    else:  # channel order (group, sample) so that conv group g sees group g's channels
        per_group = ctx.ints([channels // group]) if channels is not None else \
            ctx.op("Div", ctx.op("Shape", x, start=1, end=2), ctx.ints([group]))
        sizes = extents(ctx, x, 2, spatial)
        xr = ctx.op("Reshape", x, ctx.op("Concat", ctx.ints([0, group]), per_group, sizes,
                                         axis=0))
        xt = ctx.op("Transpose", xr, perm=[2, 1, 0, *range(3, rank + 1)])
        xt = ctx.op("Reshape", xt, ctx.op("Concat", per_group, ctx.ints([-1]), sizes, axis=0))
    gt = _swap01(ctx, gy, rank)  # [M, N, *out]: the output gradient is the kernel
    gw = ctx.op("Conv", xt, gt, strides=dilations, dilations=strides, pads=[*begin, *end],
                group=group)  # [C/group, M, *kernel'] with kernel' >= kernel
    extra = []
    for size, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begin, end):
        rem = (size + b + e - ((k - 1) * d + 1)) % s if size is not None else s
        extra.append(rem // d)  # unknown size: slice whenever taps can be left over
    if any(extra):  # the floor of a strided forward pass left taps that touch no output
        axes = list(range(2, rank))
        gw = ctx.op("Slice", gw, ctx.ints([0] * len(kernel)), ctx.ints(kernel), ctx.ints(axes))
    return _swap01(ctx, gw, rank)


# stride-1 data gradients over at most this many positions go through a Conv of the flipped
# output gradient (see _data_grad_flipped); larger maps keep the ConvTranspose
FLIP_MAX_POSITIONS = 16


def _use_flipped_data_grad(w: ir.Value, group: int, spatial: list[int | None],
                           kernel: list[int], strides: list[int], dilations: list[int],
                           begin: list[int], end: list[int]) -> bool:
    """Whether the data gradient takes the flipped-Conv form: stride 1, a small static map,
    group 1 or depthwise (one input and one output channel a group), end pads that fit."""
    if any(s != 1 for s in strides) or None in spatial or \
            math.prod(spatial) > FLIP_MAX_POSITIONS:  # type: ignore[arg-type]
        return False
    if any(p > (k - 1) * d for k, d, p in zip(kernel, dilations, begin + end)):
        return False
    if group == 1:
        return True
    shape = w.shape
    return shape is not None and shape.dims[1] == 1 and shape.dims[0] == group


def _data_grad_flipped(ctx: GradContext, g: ir.Value, w: ir.Value, group: int, n: int,
                       kernel: list[int], dilations: list[int], begin: list[int],
                       end: list[int]) -> ir.Value:
    """dx of a stride-1 Conv as Flip(Conv(Flip(gy), W^T)), flips along the spatial axes,
    W^T = W with input and output channels swapped (depthwise: W itself), pads
    (k - 1) d - end before and (k - 1) d - begin after. onnxruntime's ConvTranspose is ~1.4x
    slower than its Conv on small maps with many channels (gy [8, 512, 2, 2], W [512, 512,
    3, 3], one thread: 5.6 ms, against 4.1 ms for this form with its transpose and flips);
    flipping gy instead of the kernel keeps the copies map-sized."""
    axes = ctx.ints(list(range(2, n + 2)))
    back = ctx.ints([-1] * n)
    stop = ctx.ints([-(2 ** 62)] * n)

    def flip(v: ir.Value) -> ir.Value:
        return ctx.op("Slice", v, back, stop, axes, back)

    wt = w if group > 1 else _swap01(ctx, w, n + 2)
    pads = [(k - 1) * d - e for k, d, e in zip(kernel, dilations, end)] + \
        [(k - 1) * d - b for k, d, b in zip(kernel, dilations, begin)]
    return flip(ctx.op("Conv", flip(g), wt, dilations=dilations, pads=pads, group=group))


def _bias_grad(ctx, g, rank: int):
    return ctx.op("ReduceSum", g, ctx.ints([0, *range(2, rank)]), keepdims=0)


def _operands(node, what: str):
    """x, W, B, spatial dims of x (None where symbolic), kernel, group, and the resolved
    window of a conv node."""
    x, w = node.inputs[0], node.inputs[1]
    b = node.inputs[2] if len(node.inputs) > 2 else None
    spatial = dims(x, f"{what} input", 2)
    shape = attr(node, "kernel_shape")
    kernel = list(shape) if shape is not None else dims(w, f"{what} weight", 2)
    if None in kernel:
        raise ValueError(f"{what} weight '{w.name}' of shape {shape_text(w)} has a kernel of "
                         "unknown size and the node has no kernel_shape attribute; give the "
                         "weight a static shape")
    return x, w, b, spatial, kernel, attr(node, "group", 1), window(node, spatial, kernel)


def _channels(w: ir.Value, what: str, group: int) -> int | None:
    """Input channels of a Conv (output channels of a ConvTranspose) from W's dim 1."""
    c = dims(w, what, 1)[0]
    return None if c is None else c * group


@register("Conv")
def conv(ctx, node, gys):
    (g,) = gys
    x, w, b, spatial, kernel, group, (strides, dilations, begin, end) = _operands(node, "Conv")
    out = [None, None, None]
    if ctx.needs(x):
        if None in spatial:  # no end pads: cropped, or padded where the windows dropped
            # rows, to the input's extents at run time
            out[0] = fit_spatial(ctx, ctx.op("ConvTranspose", g, w, strides=strides,
                                             dilations=dilations,
                                             pads=[*begin, *[0] * len(kernel)], group=group),
                                 x, len(kernel))
        elif _use_flipped_data_grad(w, group, spatial, kernel, strides, dilations, begin, end):
            out[0] = _data_grad_flipped(ctx, g, w, group, len(kernel), kernel, dilations,
                                        begin, end)
        else:
            rem = [(size + bb + e - ((k - 1) * d + 1)) % s for size, k, s, d, bb, e
                   in zip(spatial, kernel, strides, dilations, begin, end)]
            out[0] = ctx.op("ConvTranspose", g, w, strides=strides, dilations=dilations,
                            pads=[*begin, *end], output_padding=rem, group=group)
    rows = None
    if ctx.needs(w):
        channels = _channels(w, "Conv weight", group)
        if by_tap(group, kernel, channels, spatial):
            rows = channel_rows(ctx, g, len(kernel) + 2)
        out[1] = weight_grad(ctx, x, g, group=group, channels=channels, kernel=kernel,
                             spatial=spatial, strides=strides, dilations=dilations,
                             begin=begin, end=end, gy_rows=rows,
                             out_channels=dims(w, "Conv weight")[0])
    if ctx.needs(b):  # a sum along rows is cheaper than over axes 0, 2, 3 of NCHW
        out[2] = _bias_grad(ctx, g, len(kernel) + 2) if rows is None else \
            ctx.op("ReduceSum", rows, ctx.ints([1]), keepdims=0)
    return out


@register("ConvTranspose")
def conv_transpose(ctx, node, gys):
    (g,) = gys
    if attr(node, "output_shape") is not None or \
            str(attr(node, "auto_pad", "NOTSET")) in ("SAME_UPPER", "SAME_LOWER"):
        raise ValueError("ConvTranspose with output_shape or auto_pad=SAME_* is not "
                         "differentiated; give explicit pads and output_padding")
    x, w, b, spatial, kernel, group, (strides, dilations, begin, end) = \
        _operands(node, "ConvTranspose")
    extra = list(attr(node, "output_padding", None) or [0] * len(kernel))
    out = [None, None, None]
    if ctx.needs(x):
        out[0] = ctx.op("Conv", g, w, strides=strides, dilations=dilations,
                        pads=[*begin, *end], group=group)
    if ctx.needs(w):
        y_spatial = [None if n is None else s * (n - 1) + p + (k - 1) * d + 1 - bb - e
                     for n, k, s, d, bb, e, p
                     in zip(spatial, kernel, strides, dilations, begin, end, extra)]
        channels = _channels(w, "ConvTranspose weight", group)
        # ConvTranspose(x, W) = y  <=>  x is the output gradient of Conv(y, W): swap the roles
        out[1] = weight_grad(ctx, g, x, group=group, channels=channels, kernel=kernel,
                             spatial=y_spatial, strides=strides, dilations=dilations,
                             begin=begin, end=end)
    if ctx.needs(b):
        out[2] = _bias_grad(ctx, g, len(kernel) + 2)
    return out
