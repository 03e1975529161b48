"""Compute segments on onnxruntime: one session per segment, run through IOBinding.

A segment's session is made at its first run (the input types and shapes are known then);
its outputs are bound to the placement's device, so a value stays where it lives, or to memory
chosen for them: a dead buffer the in-place planner assigned (runtime/inplace_planner.py), or
the memory a comm kernel asked its input to be written into (``memory_for``).
"""
from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import onnx
import onnxruntime as ort
from onnx import helper

from ngdist.errors import ExecutionError, NgdistError
from ngdist.ir.model import IR_VERSION
from ngdist.runtime.inplace_planner import ORT_TYPES, InPlacePlanner
from ngdist.runtime.partition import Segment
from ngdist.runtime.plan import StepPlan
from ngdist.runtime.cuda import run_options
from ngdist.runtime.sessions import Placement, make_session, out_of_memory

Env = MutableMapping[str, ort.OrtValue]


def ends(seg: Segment) -> str:
    """``first .. last`` node of the segment: its name in errors and the timeline."""
    return f"{seg.nodes[0].name or seg.nodes[0].op_type} .. " \
        f"{seg.nodes[-1].name or seg.nodes[-1].op_type}"


def describe(seg: Segment) -> str:
    return f"{len(seg.nodes)} nodes, {ends(seg)}"


class SegmentRunner:
    """Runs the segments of one plan on ``placement``."""

    def __init__(self, plan: StepPlan, placement: Placement, intra_op_threads: int | None,
                 planner: InPlacePlanner | None,
                 memory_for: Callable[[str], ort.OrtValue | None]) -> None:
        self.plan = plan
        self.placement = placement
        self.intra_op_threads = intra_op_threads
        self.planner = planner  # None: nothing is written in place
        self.memory_for = memory_for
        self.sessions: dict[int, ort.InferenceSession] = {}
        self.bindings: dict[int, Any] = {}
        self._bound_inputs: dict[int, dict[str, ort.OrtValue]] = {}
        self.run_options = run_options(placement.device, placement.cuda)
        # values made within the step (by a segment or a comm node): a binding that kept one
        # bound until the segment's next run would keep its memory past its last use
        made = plan.made_by_segment | {o for n in plan.comm_nodes.values() for o in n.outputs}
        self._transient = {s.index for s in plan.segments if made.intersection(s.inputs)}
        # a sharded step (cut at every gather and scatter) shares one arena (sessions.py)
        self.shared_arena = any(n.op_type in ("AllGather", "ReduceScatter")
                                for n in plan.comm_nodes.values())

    def session(self, seg: Segment, env: Env) -> ort.InferenceSession:
        sess = self.sessions.get(seg.index)
        if sess is not None:
            return sess
        inputs, inits = [], []
        for name in seg.inputs:
            if name in env:
                elem = ORT_TYPES[env[name].data_type()]
                inputs.append(helper.make_tensor_value_info(name, elem, None))
            elif name in self.plan.constants:
                inits.append(self.plan.constants[name])
            else:
                raise NgdistError(f"segment {seg.index} needs value '{name}', which nothing "
                                  "produced; the step graph is inconsistent")
        extra = self.planner.first(seg, env) if self.planner is not None else []
        outputs = [onnx.ValueInfoProto(name=o) for o in (*seg.outputs, *extra)]
        graph = helper.make_graph(seg.nodes, f"ngdist_segment_{seg.index}", inputs, outputs,
                                  initializer=inits)
        proto = helper.make_model(graph, opset_imports=self.plan.opsets, ir_version=IR_VERSION)
        try:
            sess = make_session(proto, self.placement, self.intra_op_threads,
                                shapes={n: env[n].shape() for n in seg.inputs if n in env},
                                shared_arena=self.shared_arena)
        except Exception as exc:
            raise NgdistError(f"onnxruntime rejected segment {seg.index} "
                              f"({describe(seg)}): {exc}") from None
        self.sessions[seg.index] = sess
        self.bindings[seg.index] = sess.io_binding()
        return sess

    def run(self, seg: Segment, env: Env) -> list[ort.OrtValue]:
        """The segment's outputs, in ``seg.outputs`` order."""
        self.session(seg, env)
        binding = self.bindings[seg.index]
        binding.clear_binding_outputs()  # (an output still bound would be written over)
        bound_in = self._bound_inputs.setdefault(seg.index, {})
        for name in seg.inputs:  # an input bound to the same value as last time stays bound
            value = env.get(name)
            if value is not None and bound_in.get(name) is not value:
                binding.bind_ortvalue_input(name, value)
                bound_in[name] = value
        bound = self._bind_outputs(seg, env, binding)
        try:
            self.sessions[seg.index].run_with_iobinding(binding, self.run_options)
        except Exception as exc:
            oom = out_of_memory(f"segment {seg.index} ({describe(seg)})", exc)
            if oom is not None:
                raise oom from None
            raise ExecutionError(f"while executing segment {seg.index} "
                                 f"({describe(seg)}): {exc}") from None
        outs = binding.get_outputs()[:len(seg.outputs)]
        self._release(seg.index, binding)
        if bound:  # the buffer's own OrtValue: it keeps the memory alive (a numpy array's)
            outs = [bound.get(n, v) for n, v in zip(seg.outputs, outs)]
        return outs

    def _release(self, index: int, binding: Any) -> None:
        """The binding lets go of this run's outputs (the caller holds them now) and, where
        the segment read values made within the step, of its inputs: a value dies at its last
        use, not at the segment's next run (inputs fed from outside stay bound)."""
        binding.clear_binding_outputs()
        if index in self._transient:
            binding.clear_binding_inputs()
            self._bound_inputs[index].clear()

    def _bind_outputs(self, seg: Segment, env: Env, binding: Any) -> dict[str, ort.OrtValue]:
        """Binds every output: to its in-place buffer, to a kernel's memory, else to the
        placement's device; the values bound to memory of their own, by name."""
        planner = self.planner
        inplace = planner.for_run(seg, env) if planner is not None else {}
        extra = planner.extra.get(seg.index, ()) if planner is not None else ()
        placement = self.placement
        bound = {}
        for name in (*seg.outputs, *extra):
            where = inplace.get(name)
            if where is None:
                target = self.memory_for(name)
                if target is None:
                    binding.bind_output(name, placement.ort_device, placement.device_id)
                else:  # where the comm node that reads it asked for it (symmetric memory)
                    binding.bind_ortvalue_output(name, target)
                    bound[name] = target
                continue
            value = env[where[0]]
            if tuple(value.shape()) != where[1]:  # a view of the memory in the result's shape
                value = placement.value(value.numpy().reshape(where[1]))
            binding.bind_ortvalue_output(name, value)
            bound[name] = value
        return bound
