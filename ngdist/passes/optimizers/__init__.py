"""Lowering of ``ai.onnx.preview.training`` optimizer nodes to ordinary ONNX ops.

A node without ``ngdist_formula`` follows ONNX's operator specification (onnx_ops.py). With
it, the node follows one of PyTorch's formulas (``common.FORMULAS``): on an ``Adam`` node
``torch_adam``, ``torch_adamw``, ``adamax``, ``nadam``, ``radam`` (adam_family.py), on an
``Adagrad`` node ``rmsprop``, ``adadelta`` (rms_family.py); Keras' own ``keras_rmsprop``,
``keras_adagrad`` (Adagrad node), ``keras_adamax`` and ``keras_adamw`` (Adam node) where
Keras' formula is not torch's; ``ngdist_keras_weight_decay`` (any node) is Keras' decoupled
weight decay, applied to the parameters before the formula. ``ngdist_amsgrad=1`` (torch Adam
formulas) adds a third state after m and v, the running maximum of v, which then replaces v in
the denominator. ``ngdist_maximize=1`` (any node) ascends. A node's states are
``common.state_kinds`` of its op and attributes, in order.
"""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.passes.autodiff.registry import GradContext, attr
from ngdist.passes.optimizers import adam_family, onnx_ops, rms_family
from ngdist.passes.optimizers.common import (ADADELTA, ADAMAX, AMSGRAD_ATTR, DECOUPLED_ATTR,
                                             EXACT_ATTR, KERAS_DECAY_ATTR, MU_PRODUCT,
                                             SCHEDULED_FORMULAS, Scalars, exact_attr,
                                             keras_decayed,
                                             KERAS_ADAGRAD, KERAS_ADAMAX, KERAS_ADAMW,
                                             KERAS_RMSPROP,
                                             check_formula,
                                             FORMULA_ATTR, FORMULAS, MAXIMIZE_ATTR, NADAM,
                                             OPTIMIZER_OPS, RADAM, RMSPROP, SCHEDULED_ATTR,
                                             TORCH_ADAM, TORCH_ADAMW, node_attrs,
                                             node_state_kinds, num_states, onnx_default,
                                             scheduled_inputs, split_optimizer_inputs,
                                             state_kinds)

__all__ = ["ADADELTA", "ADAMAX", "AMSGRAD_ATTR", "DECOUPLED_ATTR", "EXACT_ATTR", "FORMULA_ATTR",
           "FORMULAS", "KERAS_DECAY_ATTR", "MU_PRODUCT", "exact_attr",
           "KERAS_ADAGRAD", "KERAS_ADAMAX", "KERAS_ADAMW", "KERAS_RMSPROP",
           "MAXIMIZE_ATTR", "NADAM", "OPTIMIZER_OPS", "RADAM", "RMSPROP", "SCHEDULED_ATTR",
           "TORCH_ADAM",
           "TORCH_ADAMW", "OptimizerLoweringPass", "node_state_kinds", "num_states",
           "onnx_default", "split_optimizer_inputs", "state_kinds"]

logger = logging.getLogger(__name__)


def _lower_one(ctx: GradContext, node: ir.Node) -> list[ir.Value]:
    a = node_attrs(node)
    formula = attr(node, FORMULA_ATTR, None)
    check_formula(node.op_type, formula, f"optimizer node {node.name!r}")
    if attr(node, AMSGRAD_ATTR, 0) and formula not in (TORCH_ADAM, TORCH_ADAMW):
        raise GraphError(f"optimizer node {node.name!r}: {AMSGRAD_ATTR} needs "
                         f"{FORMULA_ATTR} {TORCH_ADAM!r} or {TORCH_ADAMW!r} (AMSGrad is "
                         "implemented with PyTorch's Adam formula)")
    scheduled = scheduled_inputs(node)
    allowed = SCHEDULED_FORMULAS.get((node.op_type, formula), ())
    if scheduled and tuple(scheduled) != allowed:
        raise GraphError(f"optimizer node {node.name!r} ({node.op_type}, {FORMULA_ATTR}="
                         f"{formula!r}): {SCHEDULED_ATTR} is {list(scheduled)}; this formula "
                         f"reads {list(allowed) or 'none'} from inputs")
    a.update(scheduled)  # the graph value of this step's momentum (beta1)
    r, t, groups = split_optimizer_inputs(node)
    k = Scalars(ctx)
    xs = [keras_decayed(ctx, k, a, r, x) for x in groups[0]]  # Keras' decay comes first
    gs, states = groups[1], groups[2:]
    if formula is None:
        new_x, new_s = onnx_ops.lower(ctx, node.op_type, a, r, t, xs, gs, states)
    elif node.op_type == "Adam":
        new_x, new_s = adam_family.lower(ctx, formula, a, r, t, xs, gs, states)
    else:
        new_x, new_s = rms_family.lower(ctx, formula, a, r, t, xs, gs, states)
    return new_x + [v for s in new_s for v in s]


class OptimizerLoweringPass(ir.passes.InPlacePass):
    """Rewrites ``Momentum``, ``Adagrad`` and ``Adam`` (ai.onnx.preview.training) as ordinary ops.

    The numerics are those of the ONNX operator specification (and ``onnx.reference``), or
    PyTorch's for a node marked with ``ngdist_formula`` (see the module docstring). Output
    names are kept, so ``update_binding`` still points at the new parameters and states.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 18)
        nodes = [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
        for node in nodes:
            ctx = GradContext(graph, node, opset)
            ctx.current = node
            outs = _lower_one(ctx, node)
            for old, new in zip(node.outputs, outs):
                name = old.name
                if new.is_graph_input() or new.is_initializer():
                    new = ctx.op("Identity", new)
                new.shape, new.type = old.shape, old.type
                old.replace_all_uses_with(new, replace_graph_outputs=True)
                old.name = f"{name}.replaced"
                new.name = name
            graph.remove(node, safe=True)
        if nodes and not any(n.domain == PREVIEW_TRAINING for n in graph):
            model.opset_imports.pop(PREVIEW_TRAINING, None)
            graph.opset_imports.pop(PREVIEW_TRAINING, None)
        return ir.passes.PassResult(model, bool(nodes))
