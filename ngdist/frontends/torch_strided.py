"""``aten::as_strided`` for the TorchScript exporter, lent by torch_symbolics.py: torch's
symbolic Gathers from its input flattened in logical order, which is the memory's order only
for a contiguous input. A view whose memory is a permuted dense block (Longformer's and LED's
overlapping attention chunks, cut from a transposed tensor) is Transposed to memory order
first; a view with gaps is refused by name."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ngdist.errors import GraphError
from ngdist.frontends.torch_math import helper


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
