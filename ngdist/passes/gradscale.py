"""Scales the loss by ``ngdist.grad_scale`` before differentiation (averaging by summing)."""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ngdist.ir.domain import GRAD_SCALE, PREVIEW_TRAINING
from ngdist.ir.model import get_meta, set_meta

logger = logging.getLogger(__name__)


def has_grad_scale(model: ir.Model) -> bool:
    """Whether the step's gradients come out scaled by ``ngdist.grad_scale``."""
    return any(v.name == GRAD_SCALE and v.uses() for v in model.graph.inputs)


class GradientPrescalePass(ir.passes.InPlacePass):
    """Every ``ai.onnx.preview.training.Gradient`` node differentiates ``y * ngdist.grad_scale``
    instead of ``y``, where ``ngdist.grad_scale`` is a new scalar hyper-parameter (1 in the
    file; the runtime sets it to 1 / the number of ranks that train).

    Runs before autodiff. The gradients then leave the backward pass already divided by the
    number of ranks, so the AllReduce that follows sums them (``reduction="sum"``) and the
    mean costs one scalar multiply instead of a pass over every gradient buffer, as DDP's
    division would. The loss the step reports is the unscaled ``y``. Graphs without a Gradient
    node (an explicit backward pass) are left alone, and their AllReduce keeps the mean.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        gradients = [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type == "Gradient"]
        if not gradients or any(v.name == GRAD_SCALE for v in graph.inputs):
            return ir.passes.PassResult(model, False)
        values = {v.name: v for n in graph for v in n.outputs}
        values.update((v.name, v) for v in graph.inputs)
        scale = None
        for node in gradients:
            y = values.get(node.attributes["y"].as_string())
            if y is None or y.dtype is None or not y.dtype.is_floating_point():
                logger.info("gradient prescale: loss of '%s' unknown or not float; left alone",
                            node.name)
                continue
            if scale is None:
                scale = ir.Value(name=GRAD_SCALE, shape=ir.Shape([]), type=ir.TensorType(y.dtype),
                                 const_value=ir.tensor(np.array(1, dtype=y.dtype.numpy())))
                graph.inputs.append(scale)
                graph.register_initializer(scale)
            mul = ir.Node("", "Mul", [y, scale], name=f"ngdist/gradscale/{y.name}")
            out = mul.outputs[0]
            out.name, out.shape, out.type = f"{y.name}.scaled", y.shape, y.type
            graph.insert_before(node, mul)
            node.attributes["y"] = ir.AttrString("y", out.name)
        if scale is None:
            return ir.passes.PassResult(model, False)
        meta = get_meta(model)
        meta.roles[GRAD_SCALE] = "hyper"
        set_meta(model, meta)
        return ir.passes.PassResult(model, True)
