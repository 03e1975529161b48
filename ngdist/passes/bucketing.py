"""Fuses single-gradient AllReduce nodes into buckets of at most ``bucket_bytes``."""
from __future__ import annotations

import logging

import onnx_ir as ir

from ngdist.ir.domain import DOMAIN
from ngdist.passes.analysis import nbytes
from ngdist.passes.autodiff.registry import attr

logger = logging.getLogger(__name__)


class BucketingPass(ir.passes.InPlacePass):
    """Groups ``ngdist.AllReduce`` nodes of one input each into fused nodes (buckets).

    Gradients are taken in the order the backward pass produces them (last layer first, as in
    PyTorch DDP), a bucket closes when the next gradient would take it past ``bucket_bytes``
    or has another element type or reduction. Each fused node sits right after the producer of
    its last gradient, so its communication can overlap with the rest of the backward pass.
    ``bucket_bytes <= 0`` leaves one AllReduce per gradient (numbered buckets still).
    """

    def __init__(self, bucket_bytes: int = 25 << 20) -> None:
        super().__init__()
        self.bucket_bytes = bucket_bytes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        order = {id(n): i for i, n in enumerate(graph)}
        singles = [n for n in graph if n.domain == DOMAIN and n.op_type == "AllReduce"
                   and len(n.inputs) == 1 and "bucket" not in n.attributes]
        if not singles:
            return ir.passes.PassResult(model, False)

        def ready(n: ir.Node) -> int:
            p = n.inputs[0].producer()
            return order[id(p)] if p is not None else -1

        singles.sort(key=ready)
        buckets: list[list[ir.Node]] = []
        size = 0
        for n in singles:
            g = n.inputs[0]
            b = nbytes(g)
            if b is None:
                logger.warning("size of gradient %s unknown; counted as 0 bytes", g.name)
                b = 0
            cur = buckets[-1] if buckets else None
            fits = cur is not None and self.bucket_bytes > 0 and size + b <= self.bucket_bytes \
                and cur[0].inputs[0].dtype == g.dtype \
                and attr(cur[0], "reduction") == attr(n, "reduction")
            if fits:
                cur.append(n)
                size += b
            else:
                buckets.append([n])
                size = b
        for idx, bucket in enumerate(buckets):
            inputs = [n.inputs[0] for n in bucket]
            attrs = {k: v.value for k, v in bucket[0].attributes.items()}
            attrs["bucket"] = idx
            fused = ir.Node(DOMAIN, "AllReduce", inputs, ir.convenience.convert_attributes(attrs),
                            num_outputs=len(bucket), name=f"ngdist/allreduce/bucket{idx}")
            graph.insert_after(bucket[-1], fused)
            for old, new in zip((n.outputs[0] for n in bucket), fused.outputs):
                name = old.name
                new.shape, new.type = old.shape, old.type
                old.replace_all_uses_with(new, replace_graph_outputs=True)
                old.name = f"{name}.unfused"
                new.name = name
            graph.remove(bucket, safe=True)
        logger.info("bucketing: %d gradients in %d bucket(s) of at most %d bytes",
                    len(singles), len(buckets), self.bucket_bytes)
        return ir.passes.PassResult(model, True)
