"""Reproducible mode's runtime: the forward and backward pass once per micro-batch.

A step graph rewritten with ``reproducible_micro_batch=M`` (passes/reproducible.py) has
``ngdist.AllReduce`` nodes with ``algorithm="exact"`` and ``micro_batch=M`` on the gradients,
the buffer averages and the loss. ``MicroBatchExecutor`` cuts the step graph as
``ReplicatedExecutor`` does (runtime/replicas.py): the *tower* (everything the gradients and
the local loss depend on) and the *rest* (communication and the update). Each rank cuts its
batch into micro-batches of ``M`` samples and runs the tower on each of them, ``sessions``
at a time on threads, every session with ONE intra-op thread: a micro-batch's results then
come from the same onnxruntime computation (same shapes, same kernels, same thread count)
whichever rank computes it, hence the same bits. The results feeding the exact AllReduce nodes
are stacked along a new leading axis, one row per micro-batch, and the kernel
(kernels/exact.py) sums the rows of all ranks exactly. The rest (the update) also runs with one
intra-op thread, so identical inputs give identical parameters on every rank count.

Every data-dependent value leaving the tower must go through an exact AllReduce (else a
rank's share of the batch would leak into the result): the constructor checks it.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort

from ngdist.errors import GraphError, InputError
from ngdist.ir.domain import DOMAIN, comm_attributes, is_comm_node
from ngdist.comm.group import ProcessGroup
from ngdist.runtime.executor import StepTimes
from ngdist.runtime.replicas import ReplicatedExecutor, split_tower
from ngdist.runtime.sessions import CPU, Placement

logger = logging.getLogger(__name__)


def _exact_index(graph: onnx.GraphProto) -> list[int]:
    return [i for i, n in enumerate(graph.node) if n.domain == DOMAIN
            and n.op_type == "AllReduce" and comm_attributes(n)["algorithm"] == "exact"]


def micro_batch_size(model: onnx.ModelProto) -> int:
    """The ``micro_batch`` of the step graph's exact AllReduce nodes (0: not reproducible)."""
    sizes = {int(comm_attributes(model.graph.node[i])["micro_batch"]) for i in _exact_index(model.graph)}
    if len(sizes) > 1:
        raise GraphError(f"the exact AllReduce nodes disagree on micro_batch: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


class MicroBatchExecutor(ReplicatedExecutor):
    """The tower once per micro-batch of ``micro_batch`` samples, then the rest once."""

    def __init__(self, model: onnx.ModelProto, comm: ProcessGroup, micro_batch: int, *,
                 sessions: int, data_inputs: list[str], loss: str, params: list[str],
                 placement: Placement = CPU, overlap: bool = True) -> None:
        graph = model.graph
        nodes = list(graph.node)
        exact_idx = set(_exact_index(graph))
        exact = [nodes[i] for i in sorted(exact_idx)]
        local_loss = next((n.input[j] for n in exact for j, o in enumerate(n.output)
                           if o == loss), loss)
        if any(loss in n.output and is_comm_node(n.domain, n.op_type) for n in nodes) \
                and local_loss == loss:
            raise GraphError(f"reproducible mode: the loss '{loss}' is averaged by a comm node "
                             "other than an exact AllReduce")
        sessions = max(1, sessions)
        # the exact AllReduce nodes' inputs arrive stacked, one row per micro-batch: a fact of
        # the rest's plan
        self.stacked = frozenset(i for n in exact for i in n.input)
        # one intra-op thread per tower session (sessions // sessions), see the module doc
        super().__init__(model, comm, sessions, data_inputs=data_inputs, loss=local_loss,
                         params=params, placement=placement, intra_op_threads=sessions,
                         overlap=overlap, rest_threads=1, stacked=self.stacked)
        self.micro_batch = micro_batch
        crossing = set(self.crossing)
        outside = sorted({i for n in exact for i in n.input if i not in crossing})
        if outside:
            raise GraphError(f"reproducible mode: exact AllReduce inputs {outside[:8]} are not "
                             "computed per micro-batch (outside the forward/backward pass)")
        _, rest_idx, _ = split_tower(graph, data_inputs, local_loss, params)
        private = self.stacked | set(data_inputs) | (crossing & self.dependent)
        leaks = sorted({i for k in rest_idx if k not in exact_idx
                        for i in nodes[k].input if i in private}
                       | {o.name for o in graph.output if o.name in private})
        if leaks:
            raise GraphError(f"reproducible mode: data-dependent value(s) {leaks[:8]} leave the "
                             "forward/backward pass without an exact AllReduce")
        others = [n.name for k, n in enumerate(nodes) if is_comm_node(n.domain, n.op_type)
                  and k not in exact_idx]
        logger.info("reproducible mode: micro-batches of %d, %d tower session(s), %d exact "
                    "AllReduce node(s), other comm nodes %s", micro_batch, sessions,
                    len(exact), others)

    def run(self, feeds: dict[str, ort.OrtValue], times: StepTimes | None = None
            ) -> dict[str, ort.OrtValue]:
        times = times or StepTimes()
        arrays, batch = self.batch_arrays(feeds, "reproducible mode cuts them into micro-batches")
        m = self.micro_batch
        if batch == 0 or batch % m:
            raise InputError(f"reproducible mode cuts every rank's batch into micro-batches "
                             f"of {m} samples, but this rank's batch has {batch}; give each "
                             f"rank a positive multiple of {m} samples")
        bounds = [(k * m, (k + 1) * m) for k in range(batch // m)]
        results = self.run_towers(feeds, arrays, bounds, times, "the micro-batch tower")
        rest_feeds = dict(feeds)
        for j, name in enumerate(self.crossing):
            value = np.stack([r[j] for r in results]) if name in self.stacked else results[0][j]
            rest_feeds[name] = self.placement.value(np.ascontiguousarray(value))
        return self.rest.run(rest_feeds, times)
