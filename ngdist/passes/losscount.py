"""A loss that is a mean over counted tokens, normalised by the count of the whole global batch.

A ``SoftmaxCrossEntropyLoss`` (or ``NegativeLogLikelihoodLoss``) with ``reduction="mean"`` and
an ``ignore_index`` or class weights divides the sum of its terms by the number (the sum of the
weights) of the tokens it counts; so does a masked loss written as
``ReduceSum(l * mask) / ReduceSum(mask)``. On N ranks, averaging the ranks' means weighs a token
of a rank with few counted tokens more than one of a rank with many, and training differs from
one process on the combined batch. Here every rank divides its sum by the mean over the ranks
of the counts (an ``ngdist.AllReduce`` of one scalar, in the graph), so that the gradients
summed (or averaged) over the ranks are those of ``sum over all tokens / global count``, as one
process computes them. The step's loss is then this rank's term of that loss times N: the mean
of the ranks' losses is the combined batch's.

Two passes: :class:`CountedLossPass` before autodiff rewrites a counted mean into
``sum / count`` and marks the division; :class:`GlobalCountPass`, after every other comm pass
(so that bucketing and compression never see the count), reduces the marked count and makes
every reader of it (the forward division and its gradient) read the global one.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING
from ngdist.ir.model import ensure_opset, get_meta
from ngdist.passes.allreduce import insert_after_producer, reroute
from ngdist.passes.emit import Emitter

logger = logging.getLogger(__name__)

MARK = "ngdist.global_count"  # on the Div whose divisor GlobalCountPass reduces


def _attr(node: ir.Node, name: str, default: object = None) -> object:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _ancestors(value: ir.Value) -> tuple[set[str], list[ir.Node]]:
    """Names of the graph inputs and initializers ``value`` is computed from, and the nodes."""
    seen: set[int] = set()
    leaves: set[str] = set()
    nodes: dict[int, ir.Node] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        producer = v.producer()
        if producer is None:
            leaves.add(v.name or "")
            continue
        nodes[id(producer)] = producer
        stack.extend(i for i in producer.inputs if i is not None)
        for attr in producer.attributes.values():  # subgraphs read outer values too
            if isinstance(attr, ir.Attr) and attr.type in (ir.AttributeType.GRAPH,
                                                            ir.AttributeType.GRAPHS):
                leaves.add("<subgraph>")
    return leaves, list(nodes.values())


LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def _counted_mean(node: ir.Node) -> bool:
    """A SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss mean over the labels it counts
    (an ignore_index or class weights)."""
    if node.op_type not in LOSSES or node.domain not in ("", "ai.onnx"):
        return False
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    return _attr(node, "reduction", "mean") == "mean" and \
        (weights is not None or _attr(node, "ignore_index") is not None)


def _split_mean(graph: ir.Graph, node: ir.Node) -> ir.Node:
    """Loss(mean) -> Loss(sum) / count (Loss: one of LOSSES), where count is
    the sum of the weights of the counted labels (class weight of the label, 0 where it is
    ignore_index; 1 without class weights): ONNX's (and torch's) mean. The Div, marked."""
    y = node.outputs[0]
    scores, labels = node.inputs[0], node.inputs[1]
    weights = node.inputs[2] if len(node.inputs) > 2 else None
    ignore = _attr(node, "ignore_index")
    emit = Emitter(graph, node, f"ngdist/loss_count/{y.name}")
    attrs = {"reduction": "sum"} if ignore is None else {"reduction": "sum", "ignore_index": ignore}
    inputs = [scores, labels, *([weights] if weights is not None else [])]
    total = ir.Node("", node.op_type, inputs,
                    ir.convenience.convert_attributes(attrs), name=f"{emit.prefix}/sum")
    total.outputs[0].name = f"{y.name}.sum"
    total.outputs[0].type, total.outputs[0].shape = y.type, ir.Shape([])
    graph.insert_before(node, total)
    lab = emit("Cast", labels, to=ir.DataType.INT64)
    w = None
    if ignore is not None:
        ignored = emit("Equal", lab, emit.ints([ignore]))
        keep = emit("Not", ignored)  # a Cast, not CastLike(scores): off the gradient's path
        w = emit("Cast", keep, to=y.dtype) if y.dtype is not None else \
            emit("CastLike", keep, scores)
        lab = emit("Where", ignored, emit.ints([0]), lab)
    if weights is not None:
        cw = emit("Gather", weights, lab, axis=0)
        w = cw if w is None else emit("Mul", cw, w)
    count = emit("ReduceSum", w, keepdims=0)
    count.type, count.shape = y.type, ir.Shape([])
    div = ir.Node("", "Div", [total.outputs[0], count], name=f"ngdist/loss_count/{y.name}/div")
    graph.insert_before(node, div)
    out = div.outputs[0]
    out.type, out.shape = y.type, ir.Shape([])
    y.replace_all_uses_with(out, replace_graph_outputs=True)
    name = y.name
    y.name = f"{name}.local_mean"
    out.name = name
    if not any(o.uses() or o.is_graph_output() for o in node.outputs):
        graph.remove(node, safe=True)
    return div


def _normalised_by_data(div: ir.Node, data: set[str], params: set[str]) -> bool:
    """``num / den`` with a float scalar ``den`` computed from the batch (a data input) and from
    no trained value: a masked loss ``sum(l * mask) / sum(mask)``."""
    if div.op_type != "Div" or div.domain not in ("", "ai.onnx"):
        return False
    den = div.inputs[1]
    if den is None or den.dtype is None or not den.dtype.is_floating_point():
        return False
    if den.shape is None or not den.shape.is_static() or \
            int(np.prod([int(d) for d in den.shape.dims])) != 1:
        return False
    leaves, _ = _ancestors(den)
    return bool(leaves & data) and not leaves & params and "<subgraph>" not in leaves


def _loss_node(y: ir.Value | None) -> ir.Node | None:
    """The node whose first output ``y`` is, through Identity and Cast nodes."""
    node = y.producer() if y is not None else None
    while node is not None and node.op_type in ("Identity", "Cast") and \
            node.inputs[0] is not None:
        y = node.inputs[0]
        node = y.producer()
    return node if node is not None and y is node.outputs[0] else None


def _log_inner_means(y: ir.Value | None, top: ir.Node | None) -> None:
    """A counted mean that the loss combines with other terms (``ce + 0.1 * aux``) keeps each
    rank's own count, as DDP does: said once per loss, in the log."""
    if y is None:
        return
    inner = [n for n in _ancestors(y)[1] if n is not top and _counted_mean(n)]
    if inner:
        logger.warning("the loss '%s' uses a mean over counted tokens inside other ops (%s): "
                       "each rank divides by its own count, so N ranks can differ from one "
                       "process on the combined batch; make that mean the loss itself (or a "
                       "Div by a count of the batch) to divide by the global count", y.name,
                       ", ".join(f"{n.op_type} '{n.name}'" for n in inner[:3]))


class CountedLossPass(ir.passes.InPlacePass):
    """Marks the loss of every ``Gradient`` node that is a mean over counted tokens (see the
    module docstring), after rewriting a counted ``SoftmaxCrossEntropyLoss`` (or NLL) mean into
    ``sum / count``. Runs before autodiff and before the gradient prescale. ``refuse``: the
    reason a strategy cannot normalise by the global count; such a loss is then refused."""

    def __init__(self, refuse: str | None = None) -> None:
        super().__init__()
        self.refuse = refuse

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        meta = get_meta(model)
        data = set(meta.names("data"))
        marked = 0
        for grad in [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type == "Gradient"]:
            values = {o.name: o for n in graph for o in n.outputs}
            y = values.get(str(_attr(grad, "y")))
            node = _loss_node(y)
            params = {str(x) for x in _attr(grad, "xs", [])} | set(meta.names("param"))
            if y is None or node is None or \
                    not (_counted_mean(node) or _normalised_by_data(node, data, params)):
                _log_inner_means(y, None)
                continue
            _log_inner_means(y, node)
            weights = node.inputs[2] if node.op_type != "Div" and len(node.inputs) > 2 else None
            if weights is not None and weights.name in params:
                raise GraphError(f"the class weights '{weights.name}' of the loss '{y.name}' "
                                 "are trained with the parameters: pass frozen=['"
                                 f"{weights.name}'] (or params=) so that they stay fixed")
            if self.refuse is not None:
                what = f"{node.op_type} node '{node.name or '(unnamed)'}'"
                raise GraphError(f"the loss '{y.name}' is a mean over the tokens it counts "
                                 f"({what}); {self.refuse}")
            if node.op_type != "Div":
                node = _split_mean(graph, node)
            node.metadata_props[MARK] = "1"
            marked += 1
        if marked:
            logger.info("%d loss(es) normalised by the global count of their tokens", marked)
        return ir.passes.PassResult(model, marked > 0)


def _hoist(graph: ir.Graph, value: ir.Value) -> None:
    """Moves the nodes that compute ``value`` (from the batch and constants only) to the start
    of the graph, in their order: its AllReduce then runs first in the step, right after the
    ranks met at the last step's gradients, instead of stopping the forward pass midway."""
    hoisted = {id(n): n for n in _ancestors(value)[1]}
    anchor = next((n for n in graph if id(n) not in hoisted), None)
    if anchor is None:
        return
    for node in [n for n in graph if id(n) in hoisted]:
        graph.remove(node)
        graph.insert_before(anchor, node)


class GlobalCountPass(ir.passes.InPlacePass):
    """Every count marked by :class:`CountedLossPass` is reduced over the ranks
    (``ngdist.AllReduce``, mean), and every reader of the local count reads the reduced one."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        divs = [n for n in graph if n.metadata_props.get(MARK)]
        for div in divs:
            count = div.inputs[1]
            node = ir.Node(DOMAIN, "AllReduce", [count], ir.convenience.convert_attributes(
                {"reduction": "mean", "algorithm": "mpi"}), num_outputs=1,
                name=f"ngdist/loss_count/{div.outputs[0].name}/allreduce")
            out = node.outputs[0]
            out.name, out.shape, out.type = f"{count.name}.global", count.shape, count.type
            _hoist(graph, count)
            insert_after_producer(graph, count, node)
            reroute(count, out, node)
            del div.metadata_props[MARK]
        if divs:
            ensure_opset(model, DOMAIN)
        return ir.passes.PassResult(model, bool(divs))
