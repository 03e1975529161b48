"""Loss ops: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (mean, sum, none; optional
class weights, ignore_index). Both gradients are a per-sample scale times (softmax - onehot) or
(-onehot); the scale is shared."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import attr, register


def _onehot_and_scale(ctx, node, scores, g):
    """(onehot of the labels like ``scores``, the per-sample scale shaped to broadcast against
    it): class weight of the label, 0 where the label is ignore_index, divided by the count
    (or the summed weights) for reduction mean."""
    labels = node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    reduction = attr(node, "reduction", "mean")
    ignore_index = attr(node, "ignore_index")
    depth = ctx.op("Gather", ctx.op("Shape", scores), ctx.ints([1]), axis=0)
    labels64 = ctx.op("Cast", labels, to=ir.DataType.INT64)
    w = None
    if ignore_index is not None:
        ignored = ctx.op("Equal", labels64, ctx.ints([ignore_index]))
        labels64 = ctx.op("Where", ignored, ctx.ints([0]), labels64)
        w = ctx.op("CastLike", ctx.op("Not", ignored), scores)
    if weights is not None:
        picked = ctx.op("Gather", weights, labels64, axis=0)
        w = picked if w is None else ctx.op("Mul", picked, w)
    # float32 values, then the scores' type: onnxruntime has no float64 OneHot kernel
    onehot = ctx.op("CastLike", ctx.op("OneHot", labels64, depth,
                                       ctx.const(np.array([0.0, 1.0], np.float32)), axis=1),
                    scores)
    if reduction in ("none", "sum"):
        scale = g
    elif reduction == "mean":
        count = ctx.op("CastLike", ctx.op("Size", labels), scores) if w is None else \
            ctx.op("ReduceSum", w, keepdims=0)
        scale = ctx.op("Div", g, count)
    else:
        raise ValueError(f"unknown reduction {reduction!r}")
    if w is not None:
        scale = ctx.op("Mul", w, scale)
    if reduction == "none" or w is not None:
        scale = ctx.op("Unsqueeze", scale, ctx.ints([1]))
    return onehot, scale


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy(ctx, node, gys):
    scores, g = node.inputs[0], gys[0]
    if len(gys) > 1 and gys[1] is not None:
        raise ValueError("gradient through the log_prob output is not supported; use "
                         "LogSoftmax explicitly")
    if g is None:
        return [None, None, None]
    onehot, scale = _onehot_and_scale(ctx, node, scores, g)
    diff = ctx.op("Sub", ctx.op("Softmax", scores, axis=1), onehot)
    return [ctx.op("Mul", diff, scale), None, None]


@register("NegativeLogLikelihoodLoss")
def negative_log_likelihood(ctx, node, gys):
    """loss_i = -w_{t_i} input[i, t_i]: the input gets -onehot times the scale; labels and
    class weights get none."""
    scores = node.inputs[0]
    onehot, scale = _onehot_and_scale(ctx, node, scores, gys[0])
    return [ctx.op("Neg", ctx.op("Mul", onehot, scale)), None, None]
