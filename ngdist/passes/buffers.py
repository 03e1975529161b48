"""Averages the new values of buffers (BatchNorm running statistics) over the ranks."""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.ir.domain import DOMAIN, GRAD_SCALE
from ngdist.ir.model import ensure_opset, get_meta
from ngdist.passes.allreduce import insert_after_producer
from ngdist.passes.bucketing import reduced_by
from ngdist.passes.gradscale import has_grad_scale

logger = logging.getLogger(__name__)


class BufferAverageInsertionPass(ir.passes.InPlacePass):
    """Every step output bound to a ``buffer`` (e.g. a BatchNorm running mean/variance) is
    replaced by ``ngdist.AllReduce(mean)`` of it, keeping its name.

    Each rank's forward pass updates the statistics from its own shard; averaging them keeps
    every rank's buffers identical (bit for bit) and makes them statistics of the global batch
    (the running mean exactly, the running variance up to the spread between shard means).
    PyTorch DDP instead broadcasts rank 0's buffers. Run it before ``BucketingPass``: the
    averages then ride in the first gradient bucket instead of a message of their own, and
    the output is the bucket's ``Reshape`` of its piece of the flat result, still under the
    bound name. A buffer output that is already such a result (or a comm node's) is left as
    it is. When the gradients are prescaled by ``ngdist.grad_scale`` (passes/gradscale.py),
    the buffers are multiplied by it in the graph too and summed, so that they share the
    gradients' bucket (one reduction kind per bucket).
    """

    def __init__(self, algorithm: str = "mpi") -> None:
        super().__init__()
        self.algorithm = algorithm

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        meta = get_meta(model)
        graph = model.graph
        outputs = {v.name: i for i, v in enumerate(graph.outputs)}
        scale = next((v for v in graph.inputs if v.name == GRAD_SCALE), None) \
            if has_grad_scale(model) and self.algorithm != "exact" else None
        modified = False
        for name in meta.names("buffer"):
            target = meta.binding.get(name)
            if target not in outputs:
                continue
            value = graph.outputs[outputs[target]]
            if reduced_by(value) is not None:
                continue  # already averaged (a rewritten model rewritten again)
            source, reduction, scaling = value, "mean", []
            if scale is not None:
                cast = ir.Node("", "CastLike", [scale, value],
                               name=f"ngdist/buffer_average/{name}/scale")
                mul = ir.Node("", "Mul", [value, cast.outputs[0]],
                              name=f"ngdist/buffer_average/{name}/prescale")
                cast.outputs[0].name = f"{target}.grad_scale"
                source, reduction, scaling = mul.outputs[0], "sum", [cast, mul]
                source.name, source.shape, source.type = f"{target}.scaled", value.shape, \
                    value.type
            node = ir.Node(DOMAIN, "AllReduce", [source], ir.convenience.convert_attributes(
                {"reduction": reduction, "algorithm": self.algorithm}),
                num_outputs=1, name=f"ngdist/buffer_average/{name}")
            out = node.outputs[0]
            out.shape, out.type = value.shape, value.type
            insert_after_producer(graph, value, node)
            for extra in scaling:
                graph.insert_before(node, extra)
            graph.outputs[outputs[target]] = out  # in-step readers keep the local value
            value.name = f"{target}.local"
            out.name = target
            modified = True
        if modified:
            ensure_opset(model, DOMAIN)
        return ir.passes.PassResult(model, modified)
