"""Helpers shared by rule families: static shapes, window geometry, extra forward outputs."""
from __future__ import annotations

import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr


def static_dims(value: ir.Value, what: str, start: int = 0) -> list[int]:
    """The dimensions ``start:`` of ``value``, which must be known integers."""
    if value.shape is None:
        raise ValueError(f"{what} '{value.name}' has no known shape; give the model's inputs "
                         "static shapes (a symbolic batch dimension is fine)")
    dims = list(value.shape.dims)[start:]
    if not all(isinstance(d, int) for d in dims):
        raise ValueError(f"{what} '{value.name}' needs static dimensions {start}: to "
                         f"differentiate, got {list(value.shape.dims)}")
    return [int(d) for d in dims]


def window(node: ir.Node, spatial: list[int], kernel: list[int]
           ) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, pads_begin, pads_end) of a Conv/Pool node, auto_pad resolved."""
    n = len(kernel)
    strides = list(attr(node, "strides", None) or [1] * n)
    dilations = list(attr(node, "dilations", None) or [1] * n)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
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


def keep_axes(rank: int, axes: list[int]) -> list[int]:
    """Every axis of a rank-``rank`` tensor not in ``axes`` (which may be negative)."""
    drop = {a % rank for a in axes}
    return [a for a in range(rank) if a not in drop]
