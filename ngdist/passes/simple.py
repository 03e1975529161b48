"""The ``simple`` strategy: gradients averaged centrally at rank 0 and broadcast back."""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import ensure_opset
from ngdist.passes.allreduce import reroute
from ngdist.passes.analysis import find_grad_pairs
from ngdist.passes.manager import CommInsertionPass

logger = logging.getLogger(__name__)


class CentralReducePass(CommInsertionPass):
    """Replaces every gradient ``G`` of a parameter, for its consumers (the optimizer), by the
    matching output of one ``ngdist.CentralReduce(G_1, ..., G_n)`` per element type, with
    ``root`` 0 and ``reduction`` mean: Ray SGD's ``simple`` strategy, in which a central
    process gathers all gradients, averages them and sends the average back. The node sits
    right after the last of its gradients is produced. It is a reference for debugging the
    other strategies (its result equals ``allreduce``'s up to summation order), not a fast
    path: the root receives ``(size - 1)`` times the gradient bytes each step.
    Requires a graph without comm ops (passes/manager.py).
    """

    def __init__(self, root: int = 0) -> None:
        super().__init__()
        self.root = root

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        order = {id(n): i for i, n in enumerate(graph)}
        groups: dict[object, list[ir.Value]] = {}
        for pair in find_grad_pairs(model):
            groups.setdefault(pair.grad.dtype, []).append(pair.grad)
        for idx, grads in enumerate(groups.values()):
            node = ir.Node(DOMAIN, "CentralReduce", grads,
                           ir.convenience.convert_attributes(
                               {"root": self.root, "reduction": "mean"}),
                           num_outputs=len(grads), name=f"ngdist/central_reduce/{idx}")
            producers = [g.producer() for g in grads if g.producer() is not None]
            if producers:
                graph.insert_after(max(producers, key=lambda n: order[id(n)]), node)
            else:
                graph.insert_before(next(iter(graph)), node)
            for grad, out in zip(grads, node.outputs):
                out.name = f"{grad.name}.reduced"
                out.shape, out.type = grad.shape, grad.type
                reroute(grad, out, node)
        ensure_opset(model, DOMAIN)
        logger.info("simple: %d gradient(s) averaged at rank %d by %d CentralReduce node(s)",
                    sum(len(g) for g in groups.values()), self.root, len(groups))
        return ir.passes.PassResult(model, bool(groups))
