"""Splits into sequences: SplitToSequence and SequenceAt (what the dynamo exporter makes of
torch.chunk / torch.split when it does not optimize the graph).

A sequence's gradient is carried as one tensor shaped like the tensor that was split (each
part's gradient at its place, zeros elsewhere), so the gradients of several SequenceAt of
one sequence add up like any other, and SplitToSequence passes it on unchanged. A
SequenceAt needs its sequence straight from a SplitToSequence and a constant, non-negative
position; other sequence ops have no rule (the missing-rule error names them).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext, attr, register
from ngdist.passes.autodiff.rules._common import known_rank


def _bounds(ctx: GradContext, split: ir.Value | None, x: ir.Value, axis: int,
            position: int) -> tuple[ir.Value, ir.Value]:
    """(start, end) of part ``position`` along ``axis``, as 1-element int64 tensors."""
    extent = ctx.op("Shape", x, start=axis, end=axis + 1)
    pos = ctx.ints([position])
    if split is None:  # parts of size 1
        return pos, ctx.ints([position + 1])
    sizes = ctx.op("Cast", split, to=ir.DataType.INT64)
    if split.shape is not None and split.shape.rank() == 0:  # equal parts, the last shorter
        size = ctx.op("Reshape", sizes, ctx.ints([1]))
        start = ctx.op("Mul", pos, size)
        return start, ctx.op("Min", ctx.op("Add", start, size), extent)
    starts = ctx.op("CumSum", sizes, ctx.const(np.array(0, np.int64)), exclusive=1)
    start = ctx.op("Gather", starts, pos)
    return start, ctx.op("Add", start, ctx.op("Gather", sizes, pos))


@register("SequenceAt")
def sequence_at(ctx, node, gys):
    seq, position = node.inputs
    producer = seq.producer()
    pos = ctx.constant_value(position)
    if producer is None or producer.op_type != "SplitToSequence" or pos is None or \
            int(np.asarray(pos).reshape(-1)[0]) < 0:
        raise ValueError(f"SequenceAt '{node.name}' is differentiated only at a constant, "
                         "non-negative position of a sequence made by SplitToSequence")
    x = producer.inputs[0]
    split = producer.inputs[1] if len(producer.inputs) > 1 else None
    rank = known_rank(x, "SplitToSequence input")
    axis = attr(producer, "axis", 0) % rank
    g = gys[0]
    if split is None and not attr(producer, "keepdims", 1):
        g = ctx.op("Unsqueeze", g, ctx.ints([axis]))
    start, end = _bounds(ctx, split, x, axis, int(np.asarray(pos).reshape(-1)[0]))
    after = ctx.op("Sub", ctx.op("Shape", x, start=axis, end=axis + 1), end)
    zeros = [0] * rank  # pads: every begin, then every end; only ``axis`` is padded
    pads = ctx.op("Concat", ctx.ints(zeros[:axis]), start,
                  ctx.ints(zeros[axis + 1:] + zeros[:axis]), after, ctx.ints(zeros[axis + 1:]),
                  axis=0)
    return [_as_tensor(ctx.op("Pad", g, pads), x), None]


def _as_tensor(grad: ir.Value, x: ir.Value) -> ir.Value:
    """``grad`` typed as the tensor ``x`` it is shaped like (the driver would otherwise give
    a sequence's gradient the sequence's type)."""
    if x.dtype is not None:
        grad.type = ir.TensorType(x.dtype)
    grad.shape = x.shape
    return grad


@register("SplitToSequence")
def split_to_sequence(ctx, node, gys):
    """The sequence's gradient is already shaped like the split tensor."""
    return [_as_tensor(gys[0], node.inputs[0]), None]
