"""Reproducible mode of the allreduce strategy: micro-batches and exact reductions."""
from __future__ import annotations

import logging
import numbers

import onnx_ir as ir

from ngdist.errors import NgdistError
from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import ensure_opset, get_meta
from ngdist.passes.allreduce import insert_after_producer

logger = logging.getLogger(__name__)


class ReproducibleMicroBatchPass(ir.passes.InPlacePass):
    """Makes an allreduce step graph train bit-for-bit alike on any number of ranks.

    Rewrites: every ``ngdist.AllReduce`` whose ``algorithm`` is ``exact`` gets
    ``micro_batch=M``, and the loss output is replaced by an exact ``AllReduce(mean)`` of the
    loss (the local value is renamed ``<loss>.local``; the output keeps its name). At run time
    (runtime/microbatch.py) each rank cuts its batch into micro-batches of ``M`` samples, runs
    the forward and backward pass once per micro-batch, and hands the stacked results to those
    AllReduce nodes, whose kernel (kernels/exact.py) sums them exactly over all micro-batches
    of all ranks. The gradients, buffer averages and the reported loss then depend only on the
    global batch and ``M``, never on how the micro-batches are spread over the ranks. Run it
    after the AllReduce and buffer-average insertions and before bucketing, so that the loss
    rides in a gradient bucket.
    """

    def __init__(self, micro_batch: int) -> None:
        super().__init__()
        if not isinstance(micro_batch, numbers.Integral) or isinstance(micro_batch, bool) \
                or micro_batch < 1:
            raise NgdistError(f"reproducible_micro_batch must be a positive number of samples, "
                              f"got {micro_batch!r}")
        self.micro_batch = int(micro_batch)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        loss = get_meta(model).loss
        outputs = {v.name: i for i, v in enumerate(graph.outputs)}
        if loss not in outputs:
            raise NgdistError(f"reproducible mode needs the loss '{loss}' as a step output")
        value = graph.outputs[outputs[loss]]
        producer = value.producer()
        if producer is None or producer.domain != DOMAIN:  # not yet averaged
            node = ir.Node(DOMAIN, "AllReduce", [value], ir.convenience.convert_attributes(
                {"reduction": "mean", "algorithm": "exact"}), num_outputs=1,
                name="ngdist/loss_average")
            out = node.outputs[0]
            out.shape, out.type = value.shape, value.type
            insert_after_producer(graph, value, node)
            graph.outputs[outputs[loss]] = out
            value.name = f"{loss}.local"
            out.name = loss
        exact = [n for n in graph if n.domain == DOMAIN and n.op_type == "AllReduce"
                 and n.attributes.get("algorithm") is not None
                 and n.attributes["algorithm"].value == "exact"]
        for n in exact:
            n.attributes["micro_batch"] = ir.AttrInt64("micro_batch", self.micro_batch)
        ensure_opset(model, DOMAIN)
        logger.info("reproducible mode: %d exact AllReduce node(s), micro-batches of %d",
                    len(exact), self.micro_batch)
        return ir.passes.PassResult(model, True)
