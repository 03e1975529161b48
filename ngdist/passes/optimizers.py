"""Lowering of ONNX's ``ai.onnx.preview.training`` optimizer ops to ordinary ops."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
from onnx import defs

from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.passes.autodiff.registry import GradContext, attr

logger = logging.getLogger(__name__)

OPTIMIZER_OPS = {"Momentum": 1, "Adagrad": 1, "Adam": 2}  # op -> number of state tensors per x


def _attrs(node: ir.Node) -> dict[str, object]:
    schema = defs.get_schema(node.op_type, 1, PREVIEW_TRAINING)
    out: dict[str, object] = {}
    for name, a in schema.attributes.items():
        default = onnx_default(a)
        out[name] = attr(node, name, default)
    return out


def onnx_default(a: defs.OpSchema.Attribute) -> object:
    d = a.default_value
    if d is None or not d.name:
        return None
    return onnx.helper.get_attribute_value(d)


def split_optimizer_inputs(node: ir.Node) -> tuple[ir.Value, ir.Value, list[list[ir.Value]]]:
    """(R, T, [xs, gs, state_1s, ...]) of an optimizer node."""
    r, t, rest = node.inputs[0], node.inputs[1], list(node.inputs[2:])
    groups = 2 + OPTIMIZER_OPS[node.op_type]
    n = len(rest) // groups
    return r, t, [rest[i * n:(i + 1) * n] for i in range(groups)]


def _lower_one(ctx: GradContext, node: ir.Node) -> list[ir.Value]:
    a = _attrs(node)
    r, t, groups = split_optimizer_inputs(node)
    xs, gs, states = groups[0], groups[1], groups[2:]
    tpos = ctx.op("Greater", t, ctx.const(0, dtype=np.int64))
    new_x, new_s = [], [[] for _ in states]
    for i, (x, g) in enumerate(zip(xs, gs)):
        lr = ctx.op("CastLike", r, x)
        nc = a.get("norm_coefficient") or 0.0
        greg = g if nc == 0 else ctx.op("Add", ctx.op("Mul", ctx.const(nc, like=x), x), g)
        if node.op_type == "Momentum":
            (v,) = (s[i] for s in states)
            scaled = greg
            if a["beta"] != 1.0:  # beta is 1 on the first step (T == 0), beta after
                beta = ctx.op("Where", tpos, ctx.const(a["beta"], like=x), ctx.const(1.0, like=x))
                scaled = ctx.op("Mul", beta, greg)
            v_new = scaled if a["alpha"] == 0.0 else \
                ctx.op("Add", ctx.op("Mul", ctx.const(a["alpha"], like=x), v), scaled)
            step = v_new if a["mode"] == "standard" else \
                ctx.op("Add", greg, ctx.op("Mul", ctx.const(a["alpha"], like=x), v_new))
            new_x.append(ctx.op("Sub", x, ctx.op("Mul", lr, step)))
            new_s[0].append(v_new)
        elif node.op_type == "Adagrad":
            (h,) = (s[i] for s in states)
            tf = ctx.op("CastLike", t, x)
            r_ = ctx.op("Div", lr, ctx.op("Add", ctx.const(1.0, like=x),
                                          ctx.op("Mul", tf, ctx.const(a["decay_factor"], like=x))))
            h_new = ctx.op("Add", h, ctx.op("Mul", greg, greg))
            h_sqrt = ctx.op("Add", ctx.op("Sqrt", h_new), ctx.const(a["epsilon"], like=x))
            new_x.append(ctx.op("Sub", x, ctx.op("Div", ctx.op("Mul", r_, greg), h_sqrt)))
            new_s[0].append(h_new)
        else:  # Adam
            v, h = (s[i] for s in states)
            al, be = a["alpha"], a["beta"]
            v_new = ctx.op("Add", ctx.op("Mul", ctx.const(al, like=x), v),
                           ctx.op("Mul", ctx.const(1 - al, like=x), greg))
            h_new = ctx.op("Add", ctx.op("Mul", ctx.const(be, like=x), h),
                           ctx.op("Mul", ctx.const(1 - be, like=x), ctx.op("Mul", greg, greg)))
            h_sqrt = ctx.op("Add", ctx.op("Sqrt", h_new), ctx.const(a["epsilon"], like=x))
            tf = ctx.op("CastLike", t, x)
            corr = ctx.op("Div",
                          ctx.op("Sqrt", ctx.op("Sub", ctx.const(1.0, like=x),
                                                ctx.op("Pow", ctx.const(be, like=x), tf))),
                          ctx.op("Sub", ctx.const(1.0, like=x),
                                 ctx.op("Pow", ctx.const(al, like=x), tf)))
            r_adj = ctx.op("Where", tpos, ctx.op("Mul", lr, corr), lr)
            x_new = ctx.op("Sub", x, ctx.op("Mul", r_adj, ctx.op("Div", v_new, h_sqrt)))
            post = a.get("norm_coefficient_post") or 0.0
            if post:
                x_new = ctx.op("Mul", ctx.const(1 - post, like=x), x_new)
            new_x.append(x_new)
            new_s[0].append(v_new)
            new_s[1].append(h_new)
    return new_x + [v for s in new_s for v in s]


class OptimizerLoweringPass(ir.passes.InPlacePass):
    """Rewrites ``Momentum``, ``Adagrad`` and ``Adam`` (ai.onnx.preview.training) as ordinary ops.

    The numerics are those of the ONNX operator specification (and ``onnx.reference``). Output
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
