"""Inserts one ``ngdist.AllReduce`` per gradient, between the gradient and the update."""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import ensure_opset
from ngdist.passes.analysis import find_grad_pairs
from ngdist.passes.gradscale import has_grad_scale
from ngdist.passes.manager import CommInsertionPass

logger = logging.getLogger(__name__)


def insert_after_producer(graph: ir.Graph, value: ir.Value, node: ir.Node) -> None:
    producer = value.producer()
    if producer is None:
        graph.insert_before(next(iter(graph)), node)
    else:
        graph.insert_after(producer, node)


def reroute(value: ir.Value, new: ir.Value, skip: ir.Node) -> None:
    """Make every consumer of ``value`` except ``skip`` read ``new`` instead."""
    for use in list(value.uses()):
        if use.node is not skip:
            use.node.replace_input_with(use.idx, new)


class AllReduceInsertionPass(CommInsertionPass):
    """Every gradient ``G`` of a parameter is replaced, for its consumers (the optimizer), by
    ``ngdist.AllReduce(G)`` with ``reduction`` (mean by default): data-parallel SGD as in
    nGraph's distributed pass and Horovod. When the gradients come out of the backward pass
    already scaled by 1/N (passes/gradscale.py) a mean is their sum, and the node says
    ``reduction="sum"``. Requires a graph without comm ops (passes/manager.py).
    """

    def __init__(self, reduction: str = "mean", algorithm: str = "mpi") -> None:
        super().__init__()
        self.reduction = reduction
        self.algorithm = algorithm

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        reduction = "sum" if self.reduction == "mean" and has_grad_scale(model) else \
            self.reduction
        for pair in find_grad_pairs(model):
            node = ir.Node(DOMAIN, "AllReduce", [pair.grad],
                           ir.convenience.convert_attributes(
                               {"reduction": reduction, "algorithm": self.algorithm}),
                           num_outputs=1, name=f"ngdist/allreduce/{pair.param}")
            out = node.outputs[0]
            out.name = f"{pair.grad.name}.reduced"
            out.shape, out.type = pair.grad.shape, pair.grad.type
            insert_after_producer(graph, pair.grad, node)
            reroute(pair.grad, out, node)
        ensure_opset(model, DOMAIN)
        return ir.passes.PassResult(model, True)
