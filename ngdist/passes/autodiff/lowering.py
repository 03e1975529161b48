"""Forward ops of a training graph rewritten into forms accurate enough to differentiate.

onnxruntime's float32 ``Sigmoid`` (MLAS's rational approximation of the logistic) is accurate
only absolutely: below x ~ -8 its relative error grows without bound, and a sigmoid's
gradient, ``y (1 - y)``, inherits the relative error of ``y``. A gate that sits in that region
(a decay rate, a forget gate) then gets a gradient that is wrong in every digit. torch
computes ``1 / (1 + exp(-x))``: a few ulps over the whole float32 range, 0 below x ~ -88.7
(where the logistic is subnormal) and 1 above x ~ 16.6, never NaN or inf (measurements in
docs/benchmarks.md). Every Sigmoid of a training graph becomes that chain after autodiff,
the backward's own Sigmoids included (Softplus', Swish's and Mish's gradients), and so does
the sigmoid inside a Swish (whose onnxruntime kernel uses the same approximation); the
gradient rules still read the nodes' outputs, now accurate.

onnxruntime's CPU ``Conv`` multiplies W by each sample's im2col columns, a GEMM whose N is the
sample's output positions; MLAS widens the K block it accumulates in sequence when N is below
128 (to 1024 for 16 positions), so a Conv with few output positions and many input channels
times taps (a speech feature encoder's strided Conv1d down to 4-39 steps) is 2.5-3.9x torch's
float32 error. Such a forward Conv (group 1, static shapes) becomes one MatMul of all
samples' columns by W, whose N is the output channels (``lower_short_convs``).
"""
from __future__ import annotations

import math

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext
from ngdist.passes.autodiff.rules._common import dims, window
from ngdist.passes.autodiff.rules.conv import im2col

# MLAS's GEMM sums K in sequence in blocks of 128 when its N is at least this
GEMM_BLOCK = 128


def _logistic(ctx: GradContext, x: ir.Value) -> ir.Value:
    """1 + exp(-x), the denominator of the logistic of ``x``."""
    return ctx.op("Add", ctx.scalar(1.0, x), ctx.op("Exp", ctx.op("Neg", x)))


def lower_sigmoids(graph: ir.Graph, opset: int, taken: set[str]) -> int:
    """Rewrites every ``Sigmoid`` and ``Swish`` node of ``graph`` (not of its subgraphs) in
    place: a Sigmoid becomes ``Reciprocal(1 + Exp(Neg(x)))``, a Swish ``Mul(x, that of
    alpha x)``; the node keeps its name and output value (shape, readers). Returns how many
    nodes were rewritten."""
    count = 0
    for node in [n for n in graph if n.op_type in ("Sigmoid", "Swish")
                 and n.domain in ("", "ai.onnx")]:
        x = node.inputs[0]
        ctx = GradContext(graph, node, opset, taken)
        ctx.current = node
        if node.op_type == "Sigmoid":
            node.op_type = "Reciprocal"
            node.replace_input_with(0, _logistic(ctx, x))
        else:
            alpha = node.attributes.pop("alpha", None)
            scaled = x if alpha is None or alpha.value == 1.0 else \
                ctx.op("Mul", x, ctx.scalar(alpha.value, x))
            sigmoid = ctx.op("Reciprocal", _logistic(ctx, scaled))
            node.op_type = "Mul"
            node.resize_inputs(2)
            node.replace_input_with(1, sigmoid)
        count += 1
    return count


def _short_conv(node: ir.Node) -> tuple[list[int], list[int], int] | None:
    """(x's dims, W's dims, output positions) of a group-1 Conv, static but for the batch, whose
    onnxruntime GEMM would sum more than ``GEMM_BLOCK`` products in sequence per output
    (fewer output positions than that, more input channels times taps, and more output
    channels than positions, so the MatMul's N is the wider), else None."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or \
            len(node.inputs) < 2 or node.outputs[0].shape is None:
        return None
    group = node.attributes.get("group")
    x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
    if (group is not None and group.value != 1) or x.shape is None or w.shape is None:
        return None
    xd, wd, yd = dims(x, "Conv input"), dims(w, "Conv weight"), dims(y, "Conv output")
    if None in xd[1:] + wd + yd[1:]:  # the batch may be symbolic
        return None
    positions = math.prod(yd[2:])
    if positions >= GEMM_BLOCK or math.prod(wd[1:]) <= GEMM_BLOCK or wd[0] <= positions:
        return None
    return xd, wd, positions  # type: ignore[return-value]


def lower_short_convs(graph: ir.Graph, opset: int, taken: set[str]) -> int:
    """Rewrites each forward Conv of ``graph`` that ``_short_conv`` picks in place as
    ``Transpose(Reshape(MatMul(im2col(x), W^T) + B))``; the node keeps its name and output
    value. Returns how many nodes were rewritten."""
    count = 0
    picked = [(n, found) for n in graph if (found := _short_conv(n)) is not None]
    for node, (xd, wd, _) in picked:
        kernel, rank = wd[2:], len(xd)
        strides, dilations, begin, end = window(node, xd[2:], kernel)
        ctx = GradContext(graph, node, opset, taken)
        ctx.current = node
        cols = im2col(ctx, node.inputs[0], wd[1], kernel=kernel, spatial=xd[2:],
                      strides=strides, dilations=dilations, begin=begin, end=end)
        wt = ctx.op("Transpose", ctx.op("Reshape", node.inputs[1], ctx.ints([wd[0], -1])),
                    perm=[1, 0])
        y = ctx.op("MatMul", cols, wt)  # [N*out, M]
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            y = ctx.op("Add", y, node.inputs[2])
        out = dims(node.outputs[0], "Conv output", 2)
        y = ctx.op("Reshape", y, ctx.ints([-1, *out, wd[0]]))
        node.op_type = "Transpose"
        node.attributes.clear()
        node.attributes["perm"] = ir.AttrInt64s("perm", [0, rank - 1, *range(1, rank - 1)])
        node.resize_inputs(1)
        node.replace_input_with(0, y)
        count += 1
    return count
