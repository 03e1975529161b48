"""Reverse-mode autodiff: lowers ``ai.onnx.preview.training.Gradient`` to ordinary ONNX ops."""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ngdist.errors import GradientError
from ngdist.ir.domain import PREVIEW_TRAINING
import ngdist.passes.autodiff.rules  # noqa: F401  (registers every rule family)
from ngdist.passes.autodiff.lowering import lower_short_convs, lower_sigmoids
from ngdist.passes.autodiff.registry import (NON_DIFFERENTIABLE, GradContext, attr, get_rule,
                                             subgraph_reads, taken_names)

logger = logging.getLogger(__name__)

FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
# metadata_props key of an axis-0 Gather (an embedding lookup): the row of its data input whose
# gradient from this lookup is zero (torch's nn.Embedding(padding_idx=p)), a decimal integer
PADDING_IDX = "ngdist.padding_idx"
# metadata_props key of an Identity that passes no gradient (torch's detach, or a value computed
# under torch.no_grad): frontends/torch_stop_gradient.py
STOP_GRADIENT = "ngdist.stop_gradient"


def _no_gradient(node: ir.Node) -> bool:
    """Whether no gradient flows through ``node`` (an op without one, or a marked Identity)."""
    return node.domain == "" and (node.op_type in NON_DIFFERENTIABLE or
                                  (node.op_type == "Identity" and
                                   STOP_GRADIENT in node.metadata_props))


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    table: dict[str, ir.Value] = {v.name: v for v in graph.inputs}
    table.update(graph.initializers)
    for node in graph:
        for out in node.outputs:
            if out.name:
                table[out.name] = out
    return table


def _is_float(value: ir.Value) -> bool:
    return value.dtype is None or value.dtype in FLOAT_TYPES


def _reads(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` reads: its inputs and, for an If, Loop or Scan, the values around
    it its subgraphs read (a branch may read a weight that is none of the node's inputs)."""
    return [i for i in node.inputs if i is not None] + subgraph_reads(node)


def _active_nodes(graph: ir.Graph, anchor: ir.Node, xs: list[ir.Value], y: ir.Value
                  ) -> tuple[set[int], list[ir.Node]]:
    """The ids of the values reachable from ``xs`` (through differentiable nodes), and the
    nodes on a path from ``xs`` to ``y``, last first."""
    nodes = [n for n in graph if n is not anchor and n.domain != PREVIEW_TRAINING]
    from_x: set[int] = {id(x) for x in xs}
    for node in nodes:
        if _no_gradient(node):
            continue
        if any(id(i) in from_x for i in _reads(node)):
            from_x.update(id(o) for o in node.outputs)
    to_y: set[int] = {id(y)}
    active: list[ir.Node] = []
    for node in reversed(nodes):
        reads = _reads(node)
        if any(id(o) in to_y for o in node.outputs) and any(id(i) in from_x for i in reads):
            active.append(node)
            to_y.update(id(i) for i in reads)
    return from_x, active


def _check_rules(active: list[ir.Node]) -> None:
    """Refuses, naming every node and op, a path to the loss through ops without a rule."""
    missing = [n for n in active
               if get_rule(n) is None and not _no_gradient(n)]
    if missing:
        listing = ", ".join(f"{n.op_type} (node '{n.name}')" for n in missing)
        ops = sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in missing})
        raise GradientError(
            f"no gradient rule for {len(missing)} node(s) on the path to the loss: {listing}. "
            f"Ops without a rule: {', '.join(ops)}. Mark the inputs that feed them as frozen, "
            "or register a rule with ngdist.passes.autodiff.register")


def differentiate(graph: ir.Graph, anchor: ir.Node, xs: list[ir.Value], y: ir.Value,
                  opset: int, taken: set[str] | None = None) -> list[ir.Value | None]:
    """Emit nodes (before ``anchor``) computing dy/dx for every x; None where y ignores x.

    ``taken``: the graph's node and value names, shared with other contexts that emit into
    the same graph (see ``taken_names``); every emitted name is new and is added to it.
    """
    from_x, active = _active_nodes(graph, anchor, xs, y)
    if id(y) not in from_x:
        return [None] * len(xs)
    _check_rules(active)

    ctx = GradContext(graph, anchor, opset, taken)
    ctx.needed = from_x
    grads: dict[int, list[ir.Value]] = {}

    def total(value: ir.Value) -> ir.Value | None:
        parts = grads.get(id(value))
        if not parts:
            return None
        if len(parts) > 1:
            summed = ctx.op("Sum", *parts)
            grads[id(value)] = [summed]
        g = grads[id(value)][0]
        if g.shape is None and value.shape is not None:
            g.shape = value.shape.copy() if hasattr(value.shape, "copy") else value.shape
        if g.type is None and value.type is not None:
            g.type = value.type
        return g

    ctx.current = None
    grads[id(y)] = [ctx.op("CastLike", ctx.op("ConstantOfShape", ctx.op("Shape", y),
                                               value=ir.tensor(np.ones(1, np.float32))), y)]
    for node in active:
        if _no_gradient(node):
            continue
        gys = [total(o) for o in node.outputs]
        if all(g is None for g in gys):
            continue
        ctx.current = node
        rule = get_rule(node)
        assert rule is not None
        try:
            gxs = list(rule(ctx, node, gys))
        except GradientError:
            raise
        except Exception as exc:
            raise GradientError(f"gradient rule of {node.op_type} failed on node '{node.name}': "
                                f"{exc}") from exc
        targets = [*node.inputs, *subgraph_reads(node)]
        gxs += [None] * (len(targets) - len(gxs))
        if PADDING_IDX in node.metadata_props and gxs[0] is not None:
            gxs[0] = _without_padding_row(ctx, node, gxs[0])
        for inp, gx in zip(targets, gxs):
            if inp is None or gx is None or id(inp) not in from_x or not _is_float(inp):
                continue
            grads.setdefault(id(inp), []).append(gx)
    ctx.current = None
    return [total(x) for x in xs]


def _without_padding_row(ctx: GradContext, node: ir.Node, grad: ir.Value) -> ir.Value:
    """``grad`` (the lookup's gradient of its table) with the padding row set to zero."""
    table = node.inputs[0]
    dims = list(table.shape.dims) if table.shape is not None else []
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or \
            attr(node, "axis", 0) != 0 or len(dims) < 1 or \
            not all(isinstance(d, int) for d in dims[1:]):
        raise GradientError(f"node '{node.name}' ({node.op_type}) carries {PADDING_IDX}, which "
                            "applies to an axis-0 Gather of a table with static row shape")
    text = node.metadata_props[PADDING_IDX]
    row = int(text) if text.strip().isdigit() else -1
    if row < 0 or (isinstance(dims[0], int) and row >= dims[0]):
        raise GradientError(f"node '{node.name}': {PADDING_IDX}={text} is not a row of its "
                            f"{dims[0]}-row table")
    zeros = ctx.const(np.zeros([1, *dims[1:]], np.float32), like=grad)
    return ctx.op("ScatterND", grad, ctx.const(np.array([[row]], np.int64)), zeros)


class AutodiffPass(ir.passes.InPlacePass):
    """Replaces every ``ai.onnx.preview.training.Gradient`` node by ordinary ONNX ops.

    For each Gradient node (attributes ``xs``, ``y``) the backward graph is emitted just before
    it, reusing forward activations; its outputs keep their names (e.g. ``W.grad``), so later
    passes and ``update_binding`` see the same names. A parameter the loss does not depend on
    gets a zero gradient (with a warning). An op on the path without a rule raises
    GradientError listing every such node at once. An axis-0 Gather carrying
    ``metadata_props[PADDING_IDX] = p`` (nn.Embedding's padding_idx) adds nothing to row p
    of its table's gradient; an Identity carrying ``STOP_GRADIENT`` passes none. Every Sigmoid
    (and Swish's sigmoid) of the graph is then computed as 1 / (1 + exp(-x))
    (``lowering.lower_sigmoids``: onnxruntime's is accurate only absolutely), and a forward Conv with few output positions one MatMul (``lowering.lower_short_convs``).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 18)
        modified = False
        taken = taken_names(graph)  # one name authority for every context below
        for node in [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type == "Gradient"]:
            table = _values_by_name(graph)
            xs_names = list(attr(node, "xs", []))
            y_name = attr(node, "y")
            unknown = [n for n in [*xs_names, y_name] if n not in table]
            if unknown:
                raise GradientError(f"Gradient node '{node.name}' names values {unknown} that "
                                    "the graph does not define")
            xs = [table[n] for n in xs_names]
            dxs = differentiate(graph, node, xs, table[y_name], opset, taken)
            ctx = GradContext(graph, node, opset, taken)
            for x, dx, out in zip(xs, dxs, node.outputs):
                if dx is None:
                    logger.warning("loss '%s' does not depend on '%s': its gradient is zero",
                                   y_name, x.name)
                    dx = ctx.zeros_like(x)
                if dx.producer() is None or dx.is_graph_input() or dx.is_graph_output() or \
                        dx.is_initializer() or any(dx is o for o in graph.outputs):
                    dx = ctx.op("Identity", dx)
                out_name = out.name
                dx.shape, dx.type = x.shape, x.type
                out.replace_all_uses_with(dx, replace_graph_outputs=True)
                out.name = f"{out_name}.replaced"
                dx.name = out_name
                taken.add(out_name)
            graph.remove(node, safe=True)
            modified = True
        if modified:
            lowered = lower_sigmoids(graph, opset, taken)
            if lowered:
                logger.debug("%d Sigmoid/Swish node(s) computed with 1 / (1 + exp(-x))", lowered)
            lowered = lower_short_convs(graph, opset, taken)
            if lowered:
                logger.debug("%d Conv node(s) with few output positions as one MatMul", lowered)
        return ir.passes.PassResult(model, modified)
