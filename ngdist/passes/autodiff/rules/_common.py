"""Helpers shared by rule families: ranks and sizes (static or read at run time), window
geometry, extra forward outputs."""
from __future__ import annotations

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext, attr


RANK_HINT = ("give the model's inputs shapes of known rank, and compute reshape targets from "
             "constants and Shape(x)[0] (a target built at run time from several sizes can "
             "hide the rank from shape inference)")


def known_rank(value: ir.Value, what: str) -> int:
    """The rank of ``value``, which the rule needs (an axis, a permutation, a window)."""
    if value.shape is None:
        raise ValueError(f"{what} '{value.name}' has unknown rank, which this gradient needs; "
                         f"{RANK_HINT}")
    return value.shape.rank()


def shape_text(value: ir.Value) -> str:
    """``value``'s shape as a user reads it: ``[batch, 3, 8]``."""
    if value.shape is None:
        return "unknown"
    return "[" + ", ".join(str(d) if isinstance(d, int) else str(d.value or "?")
                           for d in value.shape.dims) + "]"


def dims(value: ir.Value, what: str, start: int = 0) -> list[int | None]:
    """The dimensions ``start:`` of ``value`` (of known rank): ints where static, None where
    symbolic; a rule reads a None size at run time (``extents``)."""
    known_rank(value, what)
    return [int(d) if isinstance(d, int) else None for d in list(value.shape.dims)[start:]]


def extents(ctx: GradContext, value: ir.Value, start: int, sizes: list[int | None]
            ) -> ir.Value:
    """Dimensions ``start:`` of ``value`` as a 1-D int64 tensor: a constant when ``sizes``
    (its static dims) are all known, else ``Shape(value)[start:]`` read at run time."""
    if None not in sizes:
        return ctx.ints(sizes)
    return ctx.op("Shape", value, start=start)


def fit_spatial(ctx: GradContext, v: ir.Value, like: ir.Value, n_spatial: int) -> ir.Value:
    """``v`` [N, C, *s'] padded (zeros) or cropped at the end of each spatial axis to the
    spatial extents of ``like``, the amounts read at run time (for windows over sizes that are
    not static, where a transposed window's output stops short of or beyond the input)."""
    target = ctx.op("Shape", like, start=2)
    short = ctx.op("Max", ctx.op("Sub", target, ctx.op("Shape", v, start=2)), ctx.ints([0]))
    # pads: every begin (n + 2 axes), then the ends of N and C, then the spatial ends; the
    # crop is a Slice (negative pads are not in every runtime: ONNX's reference evaluator)
    padded = ctx.op("Pad", v, ctx.op("Concat", ctx.ints([0] * (n_spatial + 4)), short, axis=0))
    return ctx.op("Slice", padded, ctx.ints([0] * n_spatial), target,
                  ctx.ints(list(range(2, n_spatial + 2))))


def window(node: ir.Node, spatial: list[int | None], kernel: list[int]
           ) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads_begin, pads_end) of a Conv/Pool node, auto_pad resolved
    (auto_pad=SAME_* needs static spatial sizes: its pads depend on them). A window that does
    not fit a static spatial size (an empty output), a kernel, stride or dilation below 1 or a
    negative pad is a ValueError naming the node."""
    strides, dilations, begin, end = _window(node, spatial, kernel)
    if any(v < 1 for v in (*kernel, *strides, *dilations)) or any(p < 0 for p in begin + end):
        raise ValueError(f"{node.op_type} '{node.name}' has kernel {kernel}, strides {strides}, "
                         f"dilations {dilations}, pads {begin + end}: kernel sizes, strides and "
                         "dilations must be at least 1 and pads at least 0")
    ceil = bool(attr(node, "ceil_mode", 0))  # a last window may then reach past the end pad
    for axis, (size, k, s, d, b, e) in enumerate(zip(spatial, kernel, strides, dilations, begin,
                                                     end)):
        if size is not None and size < 1:
            raise ValueError(f"{node.op_type} '{node.name}': its input '{node.inputs[0].name}' "
                             f"has extent {size} on spatial axis {axis}; a node before it "
                             "leaves no positions there (a window larger than its input?)")
        if size is not None and size + b + e + (s - 1 if ceil else 0) < (k - 1) * d + 1:
            raise ValueError(f"{node.op_type} '{node.name}': its window of {(k - 1) * d + 1} "
                             f"(kernel {k}, dilation {d}) does not fit spatial axis {axis} of "
                             f"size {size} with pads {b} + {e}; its output would be empty")
    return strides, dilations, begin, end


def window_attributes(node: ir.Node, n: int) -> tuple[list[int], list[int], str]:
    """(strides, dilations, auto_pad) of a Conv/Pool node with ``n`` spatial axes, as given
    (defaults filled in), before any check."""
    strides = list(attr(node, "strides", None) or [1] * n)
    dilations = list(attr(node, "dilations", None) or [1] * n)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    return strides, dilations, auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad


def _window(node: ir.Node, spatial: list[int | None], kernel: list[int]
            ) -> tuple[list[int], list[int], list[int], list[int]]:
    n = len(kernel)
    strides, dilations, auto_pad = window_attributes(node, n)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if None in spatial:
            raise ValueError(f"{node.op_type} with auto_pad={auto_pad} needs static spatial "
                             f"sizes to differentiate (its pads depend on them), got input "
                             f"shape {shape_text(node.inputs[0])}; export the model with "
                             "explicit pads")
        begin, end = [], []
        for size, k, s, d in zip(spatial, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else big)
            end.append(big if auto_pad == "SAME_UPPER" else small)
        return strides, dilations, begin, end
    if auto_pad == "VALID":
        return strides, dilations, [0] * n, [0] * n
    pads = list(attr(node, "pads", None) or [0] * (2 * n))
    return strides, dilations, pads[:n], pads[n:]


def ensure_output(node: ir.Node, index: int, suffix: str, dtype: ir.DataType | None = None,
                  shape: ir.Shape | None = None) -> ir.Value:
    """Output ``index`` of a forward node, added (and named) if the node lacks it.

    Used to keep what the forward pass already computes (MaxPool indices, LayerNorm's mean and
    inverse standard deviation, the Dropout mask) instead of recomputing it.
    """
    if len(node.outputs) <= index:
        node.resize_outputs(index + 1)
    out = node.outputs[index]
    if not out.name:
        base = node.outputs[0].name or node.name or node.op_type
        out.name = f"{base}.{suffix}"
    if out.dtype is None and dtype is not None:
        out.dtype = dtype
    if out.shape is None and shape is not None:
        out.shape = shape
    return out
