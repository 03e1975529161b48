"""Several model replicas in one process (Ray SGD's ``devices_per_worker``).

The step graph is cut in two. The *tower* is every node the gradients (``<param>.grad``, as
ngdist's autodiff names them; else the data-dependent inputs of the comm nodes) and the loss
depend on: the forward pass, the loss and the backward pass. The *rest* is communication and
the update, whatever the strategy (the optimizer must see the averaged gradient: averaging
updates instead would be wrong for Adam). Each of the ``D`` replicas runs the tower in its own
onnxruntime session, on its own thread (``InferenceSession.run`` releases the GIL), on its
contiguous slice of this rank's batch. The towers' results that depend on the data (gradients,
loss) are averaged, weighted by slice size, which is exactly the mean over the whole rank's
batch; values that do not depend on the data are identical in every replica and taken from
the first. The rest then runs once, with an ordinary ``Executor``, so the cross-process step
sees one locally averaged gradient per rank: D replicas on each of N ranks train like one
process with the concatenated batch.

The replica count is a placement decision of the runtime, not part of the program: the saved
training model is the same for any ``devices_per_worker``.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Collection
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ngdist.errors import InputError, NgdistError
from ngdist.ir.domain import DOMAIN, is_comm_node
from ngdist.ir.model import IR_VERSION
from ngdist.comm.group import ProcessGroup
from ngdist.runtime.executor import Executor, StepTimes
from ngdist.runtime.sessions import CPU, Placement, make_session

logger = logging.getLogger(__name__)


def _ancestors(nodes: list[onnx.NodeProto], producer: dict[str, int], values: set[str]
               ) -> set[int]:
    found: set[int] = set()
    todo = [producer[v] for v in values if v in producer]
    while todo:
        i = todo.pop()
        if i not in found:
            found.add(i)
            todo.extend(producer[v] for v in nodes[i].input if v in producer)
    return found


def split_tower(graph: onnx.GraphProto, data_inputs: list[str], loss: str,
                params: list[str]) -> tuple[list[int], list[int], set[str]]:
    """(indices of the tower's nodes, of the rest's live nodes, names of data-dependent
    values)."""
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    dependent = set(data_inputs)
    for n in nodes:
        if any(i in dependent for i in n.input):
            dependent.update(o for o in n.output if o)
    frontier = {f"{p}.grad" for p in params if f"{p}.grad" in producer}
    if not frontier:  # a hand-written backward pass: stop where the data meets communication
        frontier = {i for n in nodes if is_comm_node(n.domain, n.op_type) for i in n.input
                    if i in dependent}
    frontier.add(loss)
    tower = _ancestors(nodes, producer, frontier)
    live = _ancestors(nodes, producer, {o.name for o in graph.output})
    bad = [nodes[i].name for i in tower if is_comm_node(nodes[i].domain, nodes[i].op_type)]
    if bad:
        raise NgdistError(f"devices_per_worker > 1 needs gradients that do not depend on "
                          f"communication, but they depend on comm node(s) {bad}")
    return sorted(tower), sorted(live - tower), dependent


class ReplicatedExecutor:
    """``devices`` tower sessions in threads, their results averaged, then the rest."""

    def __init__(self, model: onnx.ModelProto, comm: ProcessGroup, devices: int, *,
                 data_inputs: list[str], loss: str, params: list[str],
                 placement: Placement = CPU, intra_op_threads: int | None = None,
                 overlap: bool = True, rest_threads: int | None = None,
                 stacked: Collection[str] = ()) -> None:
        """``rest_threads``: onnxruntime threads of the rest (default ``intra_op_threads``);
        ``stacked``: crossing values the rest gets as stacks of micro-batch values."""
        graph = model.graph
        tower_idx, rest_idx, self.dependent = split_tower(graph, data_inputs, loss, params)
        nodes = list(graph.node)
        tower_nodes = [nodes[i] for i in tower_idx]
        rest_nodes = [nodes[i] for i in rest_idx]
        produced = {o for n in tower_nodes for o in n.output if o}
        consumed_later = {i for n in rest_nodes for i in n.input} | {o.name for o in graph.output}
        self.crossing = sorted(produced & consumed_later)
        inputs = {i.name: i for i in graph.input}
        inits = {t.name: t for t in graph.initializer}
        needed = list(dict.fromkeys(i for n in tower_nodes for i in n.input
                                    if i and i not in produced))
        self.tower_inputs = [n for n in needed if n in inputs]
        self.data_inputs = data_inputs
        tower_graph = helper.make_graph(
            tower_nodes, "ngdist_tower", [inputs[n] for n in self.tower_inputs],
            [onnx.ValueInfoProto(name=o) for o in self.crossing],
            initializer=[inits[n] for n in needed if n in inits and n not in inputs])
        opsets = [o for o in model.opset_import if o.domain != DOMAIN]
        tower_model = helper.make_model(tower_graph, opset_imports=opsets, ir_version=IR_VERSION)
        threads = max(1, (intra_op_threads or 1) // devices)
        blob = tower_model.SerializeToString()
        try:
            self.towers = [make_session(blob, placement, threads) for _ in range(devices)]
        except Exception as exc:
            raise NgdistError(f"onnxruntime rejected the replica tower graph: {exc}") from None
        rest_graph = helper.make_graph(
            rest_nodes, graph.name, list(graph.input) +
            [onnx.ValueInfoProto(name=n) for n in self.crossing], list(graph.output),
            initializer=list(graph.initializer))
        rest_model = helper.make_model(rest_graph, opset_imports=list(model.opset_import),
                                       ir_version=model.ir_version)
        self.rest = Executor(rest_model, comm, placement=placement, overlap=overlap,
                             intra_op_threads=rest_threads or intra_op_threads,
                             stacked=stacked)
        self.comm_nodes = self.rest.comm_nodes
        self.devices = devices
        self.placement = placement  # where the towers' slices and results are placed
        self.pool = ThreadPoolExecutor(devices, thread_name_prefix="ngdist-replica")
        self.timeline: Any = None  # runtime/timeline.py, when the job records one
        logger.info("%d replicas: tower of %d nodes -> %d values; rest of %d nodes", devices,
                    len(tower_nodes), len(self.crossing), len(rest_nodes))

    @property
    def segment_count(self) -> int:
        return self.rest.segment_count

    def set_timeline(self, timeline: Any) -> None:
        self.timeline = timeline
        self.rest.set_timeline(timeline)

    def batch_arrays(self, feeds: dict[str, ort.OrtValue], how: str
                     ) -> tuple[dict[str, np.ndarray], int]:
        """The data inputs as arrays, and their common batch size (``how`` they are cut)."""
        arrays = {n: feeds[n].numpy() for n in self.data_inputs}
        sizes = {a.shape[0] if a.ndim else 1 for a in arrays.values()}
        if len(sizes) != 1:
            raise InputError(f"the data inputs have different batch sizes {sorted(sizes)}; "
                             f"{how} along axis 0 together")
        return arrays, sizes.pop()

    def run_towers(self, feeds: dict[str, ort.OrtValue], arrays: dict[str, np.ndarray],
                   bounds: list[tuple[int, int]], times: StepTimes, what: str
                   ) -> list[list[np.ndarray]]:
        """The tower on each slice ``bounds[i]`` of the data, slice i on session i mod D, D at
        a time on the pool's threads; the crossing values of each slice."""
        shared = {n: feeds[n] for n in self.tower_inputs if n not in arrays}

        def replica(d: int) -> list[np.ndarray]:
            lo, hi = bounds[d]
            feed = dict(shared)
            feed.update((n, self.placement.value(np.ascontiguousarray(a[lo:hi])))
                        for n, a in arrays.items() if n in self.tower_inputs)
            outs = self.towers[d % len(self.towers)].run_with_ort_values(self.crossing, feed)
            return [o.numpy() for o in outs]

        t0 = time.perf_counter()
        try:
            results = list(self.pool.map(replica, range(len(bounds))))
        except NgdistError:
            raise
        except Exception as exc:
            raise NgdistError(f"while executing {what}: {exc}") from None
        t1 = time.perf_counter()
        times.compute += t1 - t0
        timeline = self.timeline
        if timeline is not None:
            timeline.record("compute", what, t0, t1, {"sessions": len(bounds)})
        return results

    def run(self, feeds: dict[str, ort.OrtValue], times: StepTimes | None = None
            ) -> dict[str, ort.OrtValue]:
        times = times or StepTimes()
        arrays, batch = self.batch_arrays(feeds, "devices_per_worker splits them")
        bounds = [(batch * d // self.devices, batch * (d + 1) // self.devices)
                  for d in range(self.devices)]
        if any(hi == lo for lo, hi in bounds):
            raise InputError(f"a batch of {batch} sample(s) cannot feed {self.devices} "
                             "replicas (devices_per_worker); give each at least one sample")
        results = self.run_towers(feeds, arrays, bounds, times, "a replica tower")
        equal = len({hi - lo for lo, hi in bounds}) == 1
        weights = [(hi - lo) / batch for lo, hi in bounds]
        rest_feeds = dict(feeds)
        for j, name in enumerate(self.crossing):
            vals = [r[j] for r in results]
            first = vals[0]
            if name in self.dependent and first.dtype.kind == "f":
                acc = first.astype(first.dtype, copy=True)
                if equal:
                    for v in vals[1:]:
                        acc += v
                    acc /= first.dtype.type(self.devices)
                else:
                    acc *= first.dtype.type(weights[0])
                    for v, w in zip(vals[1:], weights[1:]):
                        acc += v * first.dtype.type(w)
                first = acc
            rest_feeds[name] = self.placement.value(np.asarray(first, order="C"))
        return self.rest.run(rest_feeds, times)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.rest.close()

    def drain(self) -> dict[str, np.ndarray]:
        return self.rest.drain()
