"""Pad's reflect, edge and wrap modes (timm's anti-aliased downsampling, ``F.pad(mode=
"reflect" | "replicate" | "circular")``): each output element copies one input element, so
the gradient folds the output gradient back axis by axis: the middle slice is the input's
own, and each border slice is added where it was copied from (reflect: the border reversed,
one element in from the edge; edge: the border summed onto the edge element; wrap: the
border onto the input's other end). Needs the pads as constants, non-negative, and the padded
axes' extents static; the mode ``Pad`` ``constant`` is ``shape.pad``.
"""
from __future__ import annotations

import numpy as np

from ngdist.passes.autodiff.registry import attr
from ngdist.passes.autodiff.rules._common import dims

_BIG = np.iinfo(np.int64).max


def _static_pads(ctx, node, rank: int) -> list[int]:
    """[begin_0, ..., begin_{r-1}, end_0, ..., end_{r-1}] over every axis of the input."""
    if ctx.opset < 11:
        return [int(p) for p in attr(node, "pads")]
    raw = ctx.constant_value(node.inputs[1])
    if raw is None:
        raise ValueError("the pads of a reflect/edge/wrap Pad are computed at run time, which "
                         "its gradient cannot read; pad by constant amounts")
    raw = [int(p) for p in np.asarray(raw).reshape(-1)]
    axes_in = node.inputs[3] if len(node.inputs) > 3 else None
    if axes_in is None:
        return raw
    axes = ctx.constant_value(axes_in)
    if axes is None:
        raise ValueError("the axes of a reflect/edge/wrap Pad are computed at run time; give "
                         "them as constants")
    full = [0] * (2 * rank)
    for k, a in enumerate(int(a) % rank for a in np.asarray(axes).reshape(-1)):
        full[a], full[rank + a] = raw[k], raw[len(raw) // 2 + k]
    return full


def _slice(ctx, g, start: int, end: int, axis: int, step: int = 1):
    return ctx.op("Slice", g, ctx.ints([start]), ctx.ints([end]), ctx.ints([axis]),
                  ctx.ints([step]))


def _placed(ctx, part, before: int, after: int, axis: int, rank: int):
    """``part`` zero-padded along ``axis`` to sit at ``before`` in the input's extent."""
    if before == after == 0:
        return part
    pads = [0] * (2 * rank)
    pads[axis], pads[rank + axis] = before, after
    return ctx.op("Pad", part, ctx.ints(pads))


def _fold(ctx, g, mode: str, n: int, b: int, e: int, axis: int, rank: int):
    """The gradient along one axis of extent ``n`` padded by ``b`` before and ``e`` after."""
    parts = [_slice(ctx, g, b, b + n, axis)]
    if mode == "reflect":
        if b:  # out[i] = x[b - i] for i < b: x[1..b] gets g[b-1..0]
            parts.append(_placed(ctx, _slice(ctx, g, b - 1, -_BIG, axis, -1), 1, n - 1 - b,
                                 axis, rank))
        if e:  # out[b + n + j] = x[n - 2 - j]: x[n-1-e..n-2] gets g[b+n+e-1..b+n]
            parts.append(_placed(ctx, _slice(ctx, g, b + n + e - 1, b + n - 1, axis, -1),
                                 n - 1 - e, 1, axis, rank))
    elif mode == "edge":
        if b:
            parts.append(_placed(ctx, ctx.op("ReduceSum", _slice(ctx, g, 0, b, axis),
                                             ctx.ints([axis]), keepdims=1), 0, n - 1, axis, rank))
        if e:
            parts.append(_placed(ctx, ctx.op("ReduceSum", _slice(ctx, g, b + n, _BIG, axis),
                                             ctx.ints([axis]), keepdims=1), n - 1, 0, axis, rank))
    else:  # wrap: out[i] = x[n - b + i] for i < b, out[b + n + j] = x[j]
        if b:
            parts.append(_placed(ctx, _slice(ctx, g, 0, b, axis), n - b, 0, axis, rank))
        if e:
            parts.append(_placed(ctx, _slice(ctx, g, b + n, _BIG, axis), 0, n - e, axis, rank))
    return parts[0] if len(parts) == 1 else ctx.op("Sum", *parts)


def folded_pad(ctx, node, gys, mode: str):
    """The input gradient of a reflect, edge or wrap ``Pad``."""
    x = node.inputs[0]
    sizes = dims(x, "Pad input")
    rank = len(sizes)
    pads = _static_pads(ctx, node, rank)
    if mode not in ("reflect", "edge", "wrap"):
        raise ValueError(f"Pad mode {mode!r} is not an ONNX mode (constant, reflect, edge, "
                         "wrap)")
    g = gys[0]
    for axis in range(rank):
        b, e = pads[axis], pads[rank + axis]
        if not (b or e):
            continue
        n = sizes[axis]
        most = {"reflect": "the extent - 1", "wrap": "the extent", "edge": None}[mode]
        if n is None or min(b, e) < 0 or \
                (most and max(b, e) > n - (mode == "reflect")):
            raise ValueError(f"Pad mode {mode!r} along axis {axis} (extent {n}, pads {b}, {e}) "
                             "has no gradient rule: it needs a static extent and pads from 0"
                             f"{' to ' + most if most else ' up'}; pad a static extent")
        g = _fold(ctx, g, mode, n, b, e, axis, rank)
    return [g, None, None, None]
