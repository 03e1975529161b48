"""Loss ops: SoftmaxCrossEntropyLoss (mean, sum, none; optional class weights, ignore_index)."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr, register


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy(ctx, node, gys):
    scores, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    reduction = attr(node, "reduction", "mean")
    ignore_index = attr(node, "ignore_index")
    g = gys[0]
    if len(gys) > 1 and gys[1] is not None:
        raise ValueError("gradient through the log_prob output is not supported; use "
                         "LogSoftmax explicitly")
    if g is None:
        return [None, None, None]
    depth = ctx.op("Gather", ctx.op("Shape", scores), ctx.ints([1]), axis=0)
    labels64 = ctx.op("Cast", labels, to=ir.DataType.INT64)
    # per-element weight w_i: class weight of the label, zero where label == ignore_index
    w = None
    if weights is not None:
        safe = labels64
        if ignore_index is not None:
            safe = ctx.op("Where", ctx.op("Equal", labels64, ctx.ints([ignore_index])),
                          ctx.ints([0]), labels64)
        w = ctx.op("Gather", weights, safe, axis=0)
    if ignore_index is not None:
        ignored = ctx.op("Equal", labels64, ctx.ints([ignore_index]))
        keep = ctx.op("CastLike", ctx.op("Not", ignored), scores)
        w = keep if w is None else ctx.op("Mul", w, keep)
        labels64 = ctx.op("Where", ctx.op("Equal", labels64, ctx.ints([ignore_index])),
                          ctx.ints([0]), labels64)
    # float32 values, then the scores' type: onnxruntime has no float64 OneHot kernel
    onehot = ctx.op("CastLike", ctx.op("OneHot", labels64, depth,
                                       ctx.const(np.array([0.0, 1.0], np.float32)), axis=1),
                    scores)
    diff = ctx.op("Sub", ctx.op("Softmax", scores, axis=1), onehot)
    if reduction == "none":
        scale = g
    elif reduction == "sum":
        scale = g
    elif reduction == "mean":
        if w is None:
            count = ctx.op("CastLike", ctx.op("Size", labels), scores)
        else:
            count = ctx.op("ReduceSum", w, keepdims=0)
        scale = ctx.op("Div", g, count)
    else:
        raise ValueError(f"unknown reduction {reduction!r}")
    if w is not None:
        scale = ctx.op("Mul", scale, w) if reduction == "none" else \
            ctx.op("Mul", w, scale)
    if reduction == "none" or w is not None:
        scale = ctx.op("Unsqueeze", scale, ctx.ints([1]))
    return [ctx.op("Mul", diff, scale), None, None]
