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
"""
from __future__ import annotations

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext


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
