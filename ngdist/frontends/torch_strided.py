"""Window views for the TorchScript exporter, lent by torch_symbolics.py.

* ``aten::as_strided``: torch's symbolic Gathers from its input flattened in logical order,
  which is the memory's order only for a contiguous input. A view whose memory is a permuted
  dense block (Longformer's and LED's overlapping attention chunks, cut from a transposed
  tensor) is Transposed to memory order first; a view with gaps is refused by name.
* ``aten::col2im`` (``F.fold``, VOLO's outlook attention): torch's symbolic reads the number
  of spatial axes from ``output_size``'s traced sizes and raises a TypeError where
  ``output_size`` is computed from a shape; it is the length of ``dilation`` (one entry per
  spatial axis), and ``output_size`` a list of traced sizes is concatenated to the int64
  tensor ONNX's Col2Im takes. Its gradient is Col2Im's rule (passes/autodiff/rules/pool.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ngdist.errors import GraphError
from ngdist.frontends.torch_math import const, helper


def as_strided(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``as_strided`` indexes its input's memory; torch's symbolic Gathers from the input
    flattened in logical order, which is the memory's order only for a contiguous input. A
    view whose memory is a dense block in another axis order (the traced strides say which)
    is Transposed to that order first; a view with gaps in its memory is refused (the ONNX
    graph has no memory outside the view to read)."""
    def symbolic(g: Any, x: Any, sizes: Any, strides: Any, offset: Any = None) -> Any:
        kind = x.type()
        steps = kind.strides() if hasattr(kind, "strides") else None
        shape = helper()._get_tensor_sizes(x)
        if not steps or None in steps or shape is None or len(shape) != len(steps):
            return builtin(g, x, sizes, strides, offset)
        order = memory_order(list(shape), list(steps))
        if order is None:
            raise GraphError(f"as_strided of a view with gaps in its memory (sizes {shape}, "
                             f"strides {steps}) has no ONNX form: call .contiguous() on its "
                             "input and compute the strides from that")
        if order != sorted(order):
            x = g.op("Transpose", x, perm_i=order)
        return builtin(g, x, sizes, strides, offset)

    return symbolic


def memory_order(sizes: list[int | None], strides: list[int]) -> list[int] | None:
    """The axes in the order that lays the tensor out as one dense block in memory (the
    logical order where it does: a contiguous tensor; else from the largest stride to the
    smallest), or None where no order does (gaps, overlaps). A size unknown at export (None)
    is taken to be what the strides around it imply."""
    def dense(order: list[int]) -> bool:
        axes = [a for a in order if sizes[a] != 1]  # a size-1 axis has any stride
        if axes and strides[axes[-1]] != 1:
            return False
        for outer, inner in zip(axes[:-1], axes[1:]):
            size = sizes[inner]
            if size is not None and strides[outer] != strides[inner] * size:
                return False
            if size is None and (strides[outer] < strides[inner] or  # (equal: a size 1)
                                 strides[outer] % strides[inner]):
                return False
        return True

    logical = list(range(len(sizes)))
    order = sorted(logical, key=lambda a: (-strides[a], a))
    return logical if dense(logical) else order if dense(order) else None


def col2im(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``col2im(input, output_size, kernel_size, dilation, padding, stride)`` as ONNX's
    Col2Im, with ``output_size`` computed at run time where it is traced (see the module's
    docstring); torch's symbolic where its sizes are constants."""
    def symbolic(g: Any, cols: Any, output_size: Any, kernel_size: Any, dilation: Any,
                 padding: Any, stride: Any) -> Any:
        h = helper()
        if h._get_tensor_sizes(output_size) is not None:
            return builtin(g, cols, output_size, kernel_size, dilation, padding, stride)
        dilation, padding, stride = (h._get_const(v, "is", name) for v, name in
                                     ((dilation, "dilation"), (padding, "padding"),
                                      (stride, "stride")))
        n = len(dilation)
        return g.op("Col2Im", cols, _int64_vector(g, output_size),
                    const(g, h._get_const(kernel_size, "is", "kernel_size")),
                    dilations_i=list(dilation) or [1] * n,
                    pads_i=[p for p in padding for _ in range(2)] or [0] * (2 * n),
                    strides_i=list(stride) or [1] * n)

    return symbolic


def _int64_vector(g: Any, sizes: Any) -> Any:
    """A list of traced ints (``prim::ListConstruct``) or a tensor as a 1-D int64 tensor."""
    h = helper()
    if h._is_packed_list(sizes):
        parts = [g.op("Unsqueeze", g.op("Cast", v, to_i=7), const(g, [0]))
                 for v in h._unpack_list(sizes)]
        return g.op("Concat", *parts, axis_i=0)
    return g.op("Cast", g.op("Reshape", sizes, const(g, [-1])), to_i=7)
