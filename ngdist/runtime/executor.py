"""Runs a step plan: onnxruntime sessions for compute segments, kernels for comm nodes.

The plan (runtime/plan.py) is built once from the step graph; :meth:`Executor.run` is a short
loop over its items. Values live in an environment of ``OrtValue``s on the trainer's placement
(name -> value), as in torch.fx's Interpreter; each value is dropped after its last use, and
every error says which segment or comm node it came from. Segments (runtime/segments.py) run
through IOBinding with their outputs bound to the placement's device, so a value stays where
it lives and is handed on as it is: from a segment to a kernel (as an array view of the same
memory, never through a copy), from a kernel to the next segment (runtime/comm_runner.py).
Comm nodes run on one background thread, in program order (the same order on every rank), so
communication overlaps with the compute segments that do not need its result.

With ``donate`` (the values the caller replaces after the step, each with the step output that
replaces it) the optimizer update gets a segment of its own after every other reader of the
parameters, and its elementwise results are written into the memory of the values that are
dead by then: the old parameters and state, and the gradients (runtime/inplace_planner.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ngdist.comm.group import ProcessGroup
from ngdist.errors import NgdistError
from ngdist.kernels import CommNode, KernelSpec
from ngdist.runtime.comm_runner import CommRunner, device_module
from ngdist.runtime.inplace_planner import InPlacePlanner
from ngdist.runtime.partition import CommCall, Item, Segment
from ngdist.runtime.plan import StepPlan, build_plan
from ngdist.runtime.segments import SegmentRunner, ends
from ngdist.runtime.sessions import CPU, Placement
from ngdist.runtime.timing import StepTimes, span

__all__ = ["Executor", "StepTimes"]


class _Pending:
    """Comm results still in flight in one run: output name -> the future that makes it."""

    def __init__(self, env: MutableMapping[str, ort.OrtValue], times: StepTimes,
                 timeline: Any) -> None:
        self.env, self.times, self.timeline = env, times, timeline
        self.futures: dict[str, Future] = {}

    def add(self, names: list[str], future: Future) -> None:
        for name in names:
            self.futures[name] = future

    def resolve(self, names: list[str]) -> None:
        """Waits for the comm calls that make any of ``names``; their outputs into the env."""
        for name in names:
            fut = self.futures.get(name)
            if fut is None:
                continue
            took: list[float] = []
            with span(self.timeline, "wait", "wait for comm", took, {"value": name}):
                outs, dt, out_names = fut.result()
            self.times.wait += took[0]
            self.times.comm += dt
            for o, value in zip(out_names, outs):
                self.env[o] = value
                self.futures.pop(o, None)


class Executor:
    """Executes one step graph (an onnx ModelProto) again and again."""

    def __init__(self, model: onnx.ModelProto, group: ProcessGroup, *,
                 placement: Placement = CPU, intra_op_threads: int | None = None,
                 overlap: bool = True, inline_alone: bool = True,
                 donate: Mapping[str, str] | None = None, stacked: Iterable[str] = ()) -> None:
        """``inline_alone``: on a group of one rank, comm ops that are the identity there run
        as Identity nodes inside a segment (one segment instead of a step cut at every comm
        node). ``donate``: {input: the step output that replaces it}, values whose memory the
        step may reuse once they are dead (the caller never reads them again). ``stacked``:
        inputs fed as stacks of micro-batch values (runtime/microbatch.py)."""
        self.group = group
        self.placement = placement
        self.plan: StepPlan = build_plan(
            model, group.size, overlap=overlap, inline_alone=inline_alone, donate=donate,
            host_memory=placement.device == "cpu",
            memory="host" if device_module(placement) is None else "device", stacked=stacked)
        self.comm = CommRunner(self.plan, group, placement)
        planner = InPlacePlanner(self.plan, any_shape=placement.device == "cpu") \
            if self.plan.donated else None
        self.segments = SegmentRunner(self.plan, placement, intra_op_threads, planner,
                                      self.comm.memory_for)
        self.planner = planner
        self._timeline: Any = None
        # constants a comm node reads directly, placed once
        self.comm_constants: dict[str, ort.OrtValue] = {
            name: placement.value(numpy_helper.to_array(self.plan.constants[name]).copy())
            for node in self.plan.comm_nodes.values() for name in node.inputs
            if name in self.plan.constants}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ngdist-comm") if overlap else None
        # the plan's facts the loop reads at every item, as plain containers
        self._items = self.plan.items
        self._in_batch = self.plan.in_batch
        self._free_after = dict(self.plan.free_after)
        self._labels = {s.index: (ends(s), {"segment": s.index, "nodes": len(s.nodes)})
                        for s in self.plan.segments}

    # ------------------------------------------------------------------ what the plan says
    @property
    def items(self) -> tuple[Item, ...]:
        return self.plan.items

    @property
    def comm_nodes(self) -> Mapping[int, CommNode]:
        return self.plan.comm_nodes

    @property
    def kernels(self) -> dict[int, KernelSpec]:
        return self.comm.kernels

    @property
    def donated(self) -> frozenset[str]:
        return self.plan.donated

    @property
    def sessions(self) -> dict[int, ort.InferenceSession]:
        return self.segments.sessions

    @property
    def segment_count(self) -> int:
        return len(self.plan.segments)

    @property
    def timeline(self) -> Any:
        """Where spans of compute, comm and waits go when the job records a timeline
        (runtime/timeline.py: any object with record(cat, name, t0, t1, args)), else None."""
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: Any) -> None:
        self._timeline = self.comm.timeline = timeline

    def set_timeline(self, timeline: Any) -> None:
        self.timeline = timeline

    # ------------------------------------------------------------------ run
    def run_segment(self, seg: Segment, env: dict[str, ort.OrtValue]) -> list[ort.OrtValue]:
        return self.segments.run(seg, env)

    def run_comm(self, indices: list[int], values: list[ort.OrtValue]
                 ) -> tuple[list[ort.OrtValue], float]:
        return self.comm.run(indices, values)

    def run(self, feeds: dict[str, ort.OrtValue], times: StepTimes | None = None
            ) -> dict[str, ort.OrtValue]:
        times = times or StepTimes()
        env = {**self.comm_constants, **feeds}
        pending = _Pending(env, times, self.timeline)
        free_after, in_batch = self._free_after, self._in_batch
        for item in self._items:
            if isinstance(item, Segment):
                pending.resolve(item.inputs)
                self._segment(item, env, times)
            elif item.index not in in_batch:  # (else its batch has run it)
                self._comm(item, env, pending, times)
            for name in free_after.get(item.index, ()):
                if name not in pending.futures:
                    env.pop(name, None)
        pending.resolve(list(pending.futures))
        missing = [o for o in self.plan.outputs if o not in env]
        if missing:
            raise NgdistError(f"step outputs {missing} were not produced")
        return {o: env[o] for o in self.plan.outputs}

    def _segment(self, seg: Segment, env: dict[str, ort.OrtValue], times: StepTimes) -> None:
        label, args = self._labels[seg.index]
        took: list[float] = []
        with span(self.timeline, "compute", label, took, args):
            outs = self.run_segment(seg, env)
        times.compute += took[0]
        env.update(zip(seg.outputs, outs))

    def _comm(self, item: CommCall, env: dict[str, ort.OrtValue], pending: _Pending,
              times: StepTimes) -> None:
        """Comm item ``item`` (and the batch it starts): now, or on the comm thread."""
        indices = list(self.plan.batches.get(item.index) or [item.index])
        nodes = [self.plan.comm_nodes[i] for i in indices]
        names = [x for n in nodes for x in n.inputs]
        pending.resolve(names)
        values = [env[n] for n in names]
        out_names = [x for n in nodes for x in n.outputs]
        if self.pool is None:
            outs, dt = self.run_comm(indices, values)
            times.comm += dt
            env.update(zip(out_names, outs))
        else:
            pending.add(out_names, self.pool.submit(
                lambda: (*self.run_comm(indices, values), out_names)))

    def drain(self) -> dict[str, np.ndarray]:
        """Complete communication that kernels keep in flight across steps (PushSum with
        overlap): what it brings, by comm-node output name, to be added to the values."""
        return self.comm.drain()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.comm.close()
