"""Runs a partitioned step graph: onnxruntime sessions for compute, kernels for comm nodes.

Values live in an environment of ``OrtValue``s on the trainer's placement (name -> value), as
in torch.fx's Interpreter; each value is dropped after its last use, and every error says
which segment or comm node it came from. Segments run through IOBinding with their outputs
bound to the placement's device, so a value stays where it lives and is handed on as it is:
from a segment to a kernel (as an array view of the same memory, never through a copy), from
a kernel to the next segment. A value is staged (copied) only when the kernel reads another
memory than the placement's (a host kernel on a device placement). Comm nodes run on one
background thread, in program order (the same order on every rank), so communication
overlaps with the compute segments that do not need its result.

With ``donate`` (the values the caller replaces after the step, each with the step output that
replaces it) the optimizer update gets a segment of its own after every other reader of the
parameters, and its elementwise results are written into the memory of the values that are
dead by then: the old parameters and state, and the gradients (runtime/inplace.py).
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from ngdist.comm.group import ProcessGroup
from ngdist.errors import CommError, ExecutionError, NgdistError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING
from ngdist.ir.model import IR_VERSION
from ngdist.kernels import CommNode, KernelSpec, get_kernel
from ngdist.runtime.inplace import (MIN_ELEMENTS, Buffer, plan_segment, plannable,
                                     static_shapes)
from ngdist.runtime.partition import CommCall, Segment, plan
from ngdist.runtime.sessions import CPU, Placement, make_session

logger = logging.getLogger(__name__)

_ORT_TYPES = {
    "tensor(float)": onnx.TensorProto.FLOAT, "tensor(double)": onnx.TensorProto.DOUBLE,
    "tensor(float16)": onnx.TensorProto.FLOAT16, "tensor(bfloat16)": onnx.TensorProto.BFLOAT16,
    "tensor(int64)": onnx.TensorProto.INT64, "tensor(int32)": onnx.TensorProto.INT32,
    "tensor(int8)": onnx.TensorProto.INT8, "tensor(uint8)": onnx.TensorProto.UINT8,
    "tensor(bool)": onnx.TensorProto.BOOL, "tensor(int16)": onnx.TensorProto.INT16,
}
BFLOAT16 = "tensor(bfloat16)"
# inputs of at most this many elements go to in-place planning by value (shape inference
# then knows the targets of Reshape nodes whose shape another segment made)
SMALL_VALUE = 64


@dataclass
class StepTimes:
    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0
    per_item: dict[str, float] = field(default_factory=dict)


def _attr_dict(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _live_only(graph: onnx.GraphProto) -> onnx.GraphProto:
    """``graph`` without the nodes no step output depends on (a second head, a metric nobody
    returns): they would only cost time in a segment. Every rank holds the same graph, so every
    rank drops the same nodes, comm nodes included."""
    needed = {o.name for o in graph.output}
    live: list[onnx.NodeProto] = []
    for n in reversed(graph.node):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(i for i in n.input if i)
    if len(live) == len(graph.node):
        return graph
    logger.info("%d node(s) of the step graph feed no step output; left out",
                len(graph.node) - len(live))
    return _with_nodes(graph, reversed(live))


def _inline_identities(graph: onnx.GraphProto) -> onnx.GraphProto:
    """A copy of ``graph`` whose comm nodes that are the identity on one rank are onnxruntime
    ``Identity`` nodes (one per output), so that a one-rank step is not cut into segments."""
    nodes, changed = [], False
    for n in graph.node:
        if n.domain == DOMAIN and get_kernel(n.op_type).alone_identity(_attr_dict(n)):
            nodes += [helper.make_node("Identity", [i], [o], name=f"{n.name}/{k}")
                      for k, (i, o) in enumerate(zip(n.input, n.output))]
            changed = True
        else:
            nodes.append(n)
    return _with_nodes(graph, nodes) if changed else graph


def _with_nodes(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto]) -> onnx.GraphProto:
    """A copy of ``graph`` (inputs, outputs, initializers) with ``nodes`` as its nodes."""
    out = onnx.GraphProto()
    out.CopyFrom(graph)
    del out.node[:]
    out.node.extend(nodes)
    return out


def _worth_in_place(graph: onnx.GraphProto, donated: set[str]) -> bool:
    """Whether the update is worth a segment of its own, written in place: when the donated
    values large enough to be written in place (``inplace.MIN_ELEMENTS``) hold at least half
    of the donated elements. The cut costs a segment's inputs and outputs; models of many
    small tensors lose more there than in place gains (benchmarks/inplace_ops.py)."""
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in graph.initializer}
    for v in graph.input:
        dims = v.type.tensor_type.shape.dim
        if v.name not in sizes and all(d.HasField("dim_value") for d in dims):
            sizes[v.name] = int(np.prod([d.dim_value for d in dims], dtype=np.int64))
    known = [sizes[x] for x in donated if x in sizes]
    large = sum(n for n in known if n >= MIN_ELEMENTS)
    return large > 0 and 2 * large >= sum(known)


class Executor:
    """Executes one step graph (an onnx ModelProto) again and again."""

    def __init__(self, model: onnx.ModelProto, group: ProcessGroup, *,
                 placement: Placement = CPU, intra_op_threads: int | None = None,
                 overlap: bool = True, inline_alone: bool = True,
                 donate: Mapping[str, str] | None = None) -> None:
        """``inline_alone``: on a group of one rank, comm ops that are the identity there run
        as Identity nodes inside a segment (one segment instead of a step cut at every comm
        node: 1.5-2.3 ms of a 9-17 ms one-rank MLP/CNN step). ``donate``: {input: the step
        output that replaces it}, values whose memory the step may reuse once they are dead
        (the caller never reads them again)."""
        self.model = model
        self.group = group
        self.placement = placement
        self.intra_op_threads = intra_op_threads
        graph = model.graph
        if any(n.domain == PREVIEW_TRAINING for n in graph.node):
            raise NgdistError("the step graph still holds ai.onnx.preview.training ops; run the "
                              "pass pipeline (ngdist.passes.pipeline.run_passes) first")
        graph = _live_only(graph)
        if group.size == 1 and inline_alone:  # identities on one rank stay inside a segment
            graph = _inline_identities(graph)
        step_outputs = {o.name for o in graph.output}
        comm_touched = {x for n in graph.node if n.domain == DOMAIN
                        for x in (*n.input, *n.output)}
        in_flight = any(get_kernel(n.op_type).drain is not None
                        for n in graph.node if n.domain == DOMAIN)
        # a value a comm node reads or makes may be in its hands beyond the segment (in flight)
        self.donated = set() if in_flight else {
            x for x, out in (donate or {}).items()
            if x not in step_outputs and not comm_touched.intersection((x, out))}
        if not _worth_in_place(graph, self.donated):
            self.donated = set()
        self.items = plan(graph, defer_comm=not overlap,
                          updated=frozenset((donate or {})[x] for x in self.donated),
                          donated=frozenset(self.donated))
        self.constants = {t.name: t for t in graph.initializer
                          if t.name not in {i.name for i in graph.input}}
        self.outputs = [o.name for o in graph.output]
        self.opsets = [o for o in model.opset_import if o.domain not in (DOMAIN,)]
        self.sessions: dict[int, ort.InferenceSession] = {}
        self.bindings: dict[int, Any] = {}
        self._bound_inputs: dict[int, dict[str, ort.OrtValue]] = {}
        self.kernels: dict[int, KernelSpec] = {}
        self.comm_nodes: dict[int, CommNode] = {}
        uses: dict[str, int] = {}  # how many items read a value
        last: dict[str, int] = {}  # the last item that reads it
        produced_by_segment: set[str] = set()
        replacing = set((donate or {}).values())  # step outputs that replace an input
        for item in self.items:
            names = item.inputs if isinstance(item, Segment) else list(item.node.input)
            for name in names:
                uses[name] = uses.get(name, 0) + 1
                last[name] = item.index
            if isinstance(item, Segment):
                produced_by_segment.update(item.outputs)
        for item in self.items:
            if isinstance(item, CommCall):
                n = item.node
                node = CommNode(n.op_type, n.name, _attr_dict(n), list(n.input), list(n.output))
                # an input made in this step for this node alone may be reused in place
                node.donated = [name in produced_by_segment and uses.get(name) == 1
                                and name not in step_outputs for name in n.input]
                # outputs that die within the step: the kernel may keep their buffer
                node.state["reuse_buffer"] = not step_outputs.intersection(node.outputs)
                # outputs the step returns only as values the next step's results replace
                # (plain SGD's state is the reduced gradient): they live one step longer
                node.state["replaced_next_step"] = bool(replacing) and \
                    step_outputs.intersection(node.outputs) <= replacing
                self.comm_nodes[item.index] = node
                self.kernels[item.index] = get_kernel(n.op_type)
        # without overlap, comm nodes that run one after another with a kernel for several
        # (the plain AllReduce of each bucket of a stage): one call for all, from the first
        # one's item (with overlap, a segment that needs one of them would wait for all)
        self.batches = {} if overlap else self._batches()
        # the items run by a batch that starts before them
        self._in_batch = {i for run in self.batches.values() for i in run[1:]}
        # values made for one comm node alone, which its kernel may ask to have written
        # into memory of its own (on the CPU: host arrays)
        self._comm_input: dict[str, tuple[CommNode, int]] = {}
        if placement.device == "cpu":
            for node in self.comm_nodes.values():
                for i, name in enumerate(node.inputs):
                    if node.donated[i]:
                        self._comm_input[name] = (node, i)
        # value name -> {id of an array its kernel asked for: (the array, an OrtValue over it)}
        self._kernel_values: dict[str, dict[int, tuple[Any, ort.OrtValue]]] = {}
        # constants a comm node reads directly, placed once
        self.comm_constants: dict[str, ort.OrtValue] = {
            name: placement.value(numpy_helper.to_array(self.constants[name]).copy())
            for node in self.comm_nodes.values() for name in node.inputs
            if name in self.constants}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ngdist-comm") if overlap else None
        # spans of compute, comm and waits go here when the job records a timeline
        # (runtime/timeline.py: any object with record(cat, name, t0, t1, args))
        self.timeline: Any = None
        self.labels = {item.index: self._ends(item) for item in self.items
                       if isinstance(item, Segment)}
        self.label_args = {item.index: {"segment": item.index, "nodes": len(item.nodes)}
                           for item in self.items if isinstance(item, Segment)}
        self.free_after: dict[int, list[str]] = {}
        for name, idx in last.items():
            if name not in step_outputs and name not in self.donated:
                self.free_after.setdefault(idx, []).append(name)
        # in-place results: per segment, the memory it may write into (planned on first run)
        self._last_use = last
        self._made_by_segment = produced_by_segment
        self._comm_touched = comm_touched  # a comm node may still read these (in flight)
        # results of AllReduce on several ranks that die within the step: the reduced bucket
        # (its donated input, the node's reused buffer, or its symmetric memory, which no other
        # rank touches once the call is over) may take results in place like a gradient
        self._reduced = {
            x for node in self.comm_nodes.values()
            if node.op_type == "AllReduce" and group.size > 1
            and node.attributes.get("algorithm", "mpi") != "exact"
            and node.state.get("reuse_buffer") for x in node.outputs}
        self._claimed: set[str] = set()  # donated values an earlier segment writes into
        self._own: dict[int, set[str]] = {}  # the donated values each segment writes into
        self._extra: dict[int, list[str]] = {}  # results a segment returns to write in place
        self._inplace: dict[int, dict[tuple, dict[str, tuple[str, tuple[int, ...]]]]] = {}

    def _batches(self) -> dict[int, list[int]]:
        """{the first item: the items} of every run of two or more comm items, one after
        another, whose kernel has a batch form that takes them, none reading another's
        result."""
        def spec_for(item: Any) -> KernelSpec | None:
            node = self.comm_nodes.get(item.index) if isinstance(item, CommCall) else None
            spec = self.kernels.get(item.index) if node is not None else None
            fits = spec is not None and spec.batch is not None and \
                spec.batchable(node.attributes)
            return spec if fits else None

        batches: dict[int, list[int]] = {}
        run: list[int] = []
        for item in [*self.items, None]:
            spec = None if item is None else spec_for(item)
            if spec is not None and run and spec is self.kernels[run[0]] and not any(
                    set(self.comm_nodes[item.index].inputs).intersection(
                        self.comm_nodes[i].outputs) for i in run):
                run.append(item.index)
                continue
            if len(run) > 1:
                batches[run[0]] = run
            run = [item.index] if spec is not None else []
        return batches

    # ------------------------------------------------------------------ sessions
    def _session(self, seg: Segment, env: dict[str, ort.OrtValue]) -> ort.InferenceSession:
        sess = self.sessions.get(seg.index)
        if sess is not None:
            return sess
        inputs, inits = [], []
        for name in seg.inputs:
            if name in env:
                elem = _ORT_TYPES[env[name].data_type()]
                inputs.append(helper.make_tensor_value_info(name, elem, None))
            elif name in self.constants:
                inits.append(self.constants[name])
            else:
                raise NgdistError(f"segment {seg.index} needs value '{name}', which nothing "
                                  "produced; the step graph is inconsistent")
        if self.donated:
            self._extra[seg.index] = self._first_plan(seg, env)
        outputs = [onnx.ValueInfoProto(name=o)
                   for o in (*seg.outputs, *self._extra.get(seg.index, ()))]
        graph = helper.make_graph(seg.nodes, f"ngdist_segment_{seg.index}", inputs, outputs,
                                  initializer=inits)
        proto = helper.make_model(graph, opset_imports=self.opsets, ir_version=IR_VERSION)
        try:
            sess = make_session(proto, self.placement, self.intra_op_threads,
                                shapes={n: env[n].shape() for n in seg.inputs if n in env})
        except Exception as exc:
            raise NgdistError(f"onnxruntime rejected segment {seg.index} "
                              f"({self._describe(seg)}): {exc}") from None
        self.sessions[seg.index] = sess
        self.bindings[seg.index] = sess.io_binding()
        return sess

    # ------------------------------------------------------------------ in place
    def _buffers(self, seg: Segment, env: dict[str, ort.OrtValue],
                 donated: Collection[str] | None = None) -> list[Buffer]:
        """Memory segment ``seg`` may write into: donated values no later item reads (and no
        earlier segment writes into; ``donated`` narrows them), and values an earlier segment
        made that die here."""
        if donated is None:
            donated = [x for x in sorted(self.donated) if x not in self._claimed and
                       self._last_use.get(x, -1) <= seg.index]
        made = [x for x in seg.inputs if x in self._made_by_segment and x not in self.outputs
                and self._last_use.get(x) == seg.index and x not in self._comm_touched]
        reduced = [x for x in seg.inputs if x in self._reduced and
                   self._last_use.get(x) == seg.index]
        out = []
        for x in [*donated, *made, *reduced]:
            value = env.get(x)
            if value is not None and value.data_type() in _ORT_TYPES:
                # onnxruntime's own memory (a segment's result) may be viewed in other shapes
                out.append(Buffer(x, tuple(value.shape()), _ORT_TYPES[value.data_type()],
                                  any_shape=x in made and self.placement.device == "cpu"))
        return out

    def _shape_key(self, seg: Segment, env: dict[str, ort.OrtValue]) -> tuple:
        return tuple(tuple(env[x].shape()) if x in env else None for x in seg.inputs)

    def _make_plan(self, seg: Segment, env: dict[str, ort.OrtValue],
                   results: Collection[str] | None = None,
                   donated: Collection[str] | None = None
                   ) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{result: (buffer, the result's shape)} for segment ``seg`` at the shapes of ``env``."""
        if not plannable(seg.nodes):
            return {}
        buffers = self._buffers(seg, env, donated)
        if not buffers:
            return {}
        known = {x: (tuple(env[x].shape()), _ORT_TYPES[env[x].data_type()])
                 for x in seg.inputs if x in env and env[x].data_type() in _ORT_TYPES}
        consts = {x: self.constants[x] for x in seg.inputs if x not in env and x in self.constants}
        small = {x: numpy_helper.to_array(t) for x, t in consts.items()
                 if int(np.prod(t.dims, dtype=np.int64)) <= SMALL_VALUE}
        for x in seg.inputs:  # small values (scalars, shape targets) by value: for Reshape
            value = env.get(x)
            if value is not None and value.data_type() in _ORT_TYPES \
                    and int(np.prod(value.shape(), dtype=np.int64)) <= SMALL_VALUE and \
                    value.data_type() != BFLOAT16:
                small[x] = value.numpy()
                consts[x] = numpy_helper.from_array(small[x], x)
                known.pop(x, None)
        shapes = static_shapes(seg.nodes, known, consts, self.opsets, IR_VERSION)
        if results is not None:
            shapes = {k: v for k, v in shapes.items() if k in results}
        plan = plan_segment(seg.nodes, buffers, shapes, keep=set(seg.outputs), constants=small)
        return {r: (b, shapes[r][0]) for r, b in plan.items()}

    def _first_plan(self, seg: Segment, env: dict[str, ort.OrtValue]) -> list[str]:
        """Plans segment ``seg`` for the shapes of its first run; the results it writes in
        place become extra outputs of its session."""
        plan = self._make_plan(seg, env)
        self._own[seg.index] = {b for b, _ in plan.values() if b in self.donated}
        self._claimed.update(self._own[seg.index])
        if plan:  # (a segment with nothing to write in place is not planned again)
            self._inplace[seg.index] = {self._shape_key(seg, env): plan}
            logger.debug("segment %d writes %d results in place", seg.index, len(plan))
        return [x for x in plan if x not in seg.outputs]

    def _plan_for(self, seg: Segment, env: dict[str, ort.OrtValue]
                  ) -> dict[str, tuple[str, tuple[int, ...]]]:
        plans = self._inplace.get(seg.index)
        if not plans:
            return {}
        key = self._shape_key(seg, env)
        plan = plans.get(key)
        if plan is None:  # other shapes (a smaller last batch): plan again for them
            extra = self._extra.get(seg.index, [])
            plan = self._make_plan(seg, env, results={*extra, *seg.outputs},
                                   donated=sorted(self._own[seg.index]))
            plans[key] = plan
        return plan

    @staticmethod
    def _ends(seg: Segment) -> str:
        """``first .. last`` node of the segment: its name in errors and the timeline."""
        return f"{seg.nodes[0].name or seg.nodes[0].op_type} .. " \
            f"{seg.nodes[-1].name or seg.nodes[-1].op_type}"

    @classmethod
    def _describe(cls, seg: Segment) -> str:
        return f"{len(seg.nodes)} nodes, {cls._ends(seg)}"

    def _run_segment(self, seg: Segment, env: dict[str, ort.OrtValue]) -> list[ort.OrtValue]:
        self._session(seg, env)
        binding = self.bindings[seg.index]
        binding.clear_binding_outputs()  # (an output still bound would be written over)
        bound_in = self._bound_inputs.setdefault(seg.index, {})
        for name in seg.inputs:  # an input bound to the same value as last time stays bound
            value = env.get(name)
            if value is not None and bound_in.get(name) is not value:
                binding.bind_ortvalue_input(name, value)
                bound_in[name] = value
        device = self.placement.ort_device
        inplace = self._plan_for(seg, env) if self.donated else {}
        bound = {}
        for name in (*seg.outputs, *self._extra.get(seg.index, ())):
            where = inplace.get(name)
            if where is None:
                target = self._kernel_memory(name)
                if target is None:
                    binding.bind_output(name, device, self.placement.device_id)
                else:  # where the comm node that reads it asked for it (symmetric memory)
                    binding.bind_ortvalue_output(name, target)
                    bound[name] = target
                continue
            value = env[where[0]]
            if tuple(value.shape()) != where[1]:  # a view of the memory in the result's shape
                value = self.placement.value(value.numpy().reshape(where[1]))
            binding.bind_ortvalue_output(name, value)
            bound[name] = value
        try:
            self.sessions[seg.index].run_with_iobinding(binding)
        except Exception as exc:
            raise ExecutionError(f"while executing segment {seg.index} "
                                 f"({self._describe(seg)}): {exc}") from None
        outs = binding.get_outputs()[:len(seg.outputs)]
        if bound:  # the buffer's own OrtValue: it keeps the memory alive (a numpy array's)
            outs = [bound.get(n, v) for n, v in zip(seg.outputs, outs)]
        return outs

    def _kernel_memory(self, name: str) -> ort.OrtValue | None:
        """The memory a comm kernel asked value ``name`` to be written into for its next
        call (``node.state["write_to"]``: {input index: host array}), as an OrtValue made once
        per array (a kernel may hand out two in turn; a third array replaces them); None when
        it asked for nothing."""
        spot = self._comm_input.get(name)
        if spot is None:
            return None
        node, i = spot
        array = node.state.get("write_to", {}).get(i)
        if array is None:
            return None
        made_for = self._kernel_values.setdefault(name, {})
        made = made_for.get(id(array))
        if made is None or made[0] is not array:
            if len(made_for) >= 2:
                made_for.clear()
            made = made_for[id(array)] = (array, self.placement.value(array))
        return made[1]

    # ------------------------------------------------------------------ comm
    def _views(self, spec: KernelSpec, values: list[ort.OrtValue]) -> list[Any]:
        """The kernel's inputs: views of the values' memory, staged to the host only when the
        kernel reads host memory and the values live on a device. A bfloat16 value (no numpy
        type) is a ``uint16`` view of its bits."""
        if spec.memory == "host":  # on CPU the same memory; from a device, a host copy
            return [self._bits(v) if v.data_type() == BFLOAT16 else v.numpy() for v in values]
        raise NgdistError(f"ngdist.{spec.op_type} has a {spec.memory}-memory kernel, which "
                          f"the {self.placement.device} placement cannot feed")

    def _bits(self, value: ort.OrtValue) -> np.ndarray:
        """A writable ``uint16`` view of a bfloat16 value's memory on the CPU."""
        if self.placement.device != "cpu":
            raise NgdistError(f"bfloat16 values reach host kernels only on the CPU placement, "
                              f"not {self.placement.device!r}; use compression='fp16' there")
        shape = tuple(value.shape())
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.empty(shape, np.uint16)
        memory = (ctypes.c_uint16 * count).from_address(value.data_ptr())
        return np.ctypeslib.as_array(memory).reshape(shape)

    def _wrap(self, outs: list[Any], inputs: list[Any], values: list[ort.OrtValue]
              ) -> list[ort.OrtValue]:
        """Kernel results as OrtValues: an input handed back is its own value again; a new
        array is wrapped without a copy (on CPU), as bfloat16 where input i of the same
        position was (the kernel returns its bits as ``uint16``)."""
        wrapped = []
        on_cpu = self.placement.device == "cpu"
        for i, out in enumerate(outs):
            same = next((v for x, v in zip(inputs, values) if x is out), None) if on_cpu \
                else None
            if same is None:
                out = out if out.flags.c_contiguous else np.array(out, order="C")
                bf16 = out.dtype == np.uint16 and i < len(values) and \
                    values[i].data_type() == BFLOAT16
                same = self.placement.value(out, onnx.TensorProto.BFLOAT16 if bf16 else None)
            wrapped.append(same)
        return wrapped

    def _run_comm(self, indices: list[int], values: list[ort.OrtValue]
                  ) -> tuple[list[ort.OrtValue], float]:
        """Comm items ``indices`` (one, or a batch) on ``values``, the inputs of each in
        turn; their outputs in the same order, and the time taken."""
        nodes = [self.comm_nodes[i] for i in indices]
        spec = self.kernels[indices[0]]
        sent0 = self.group.bytes_sent
        t0 = time.perf_counter()
        inputs = self._views(spec, values)
        try:
            if len(nodes) == 1:
                outs = spec(self.group, nodes[0], inputs)
            else:
                split, at = [], 0
                for node in nodes:
                    split.append(inputs[at:at + len(node.inputs)])
                    at += len(node.inputs)
                outs = [o for each in spec.batch(self.group, nodes, split) for o in each]
        except NgdistError:
            raise
        except Exception as exc:
            names = ", ".join(f"'{node.name}'" for node in nodes)
            raise CommError(f"while executing ngdist.{spec.op_type} {names} on rank "
                            f"{self.group.rank}: {exc}") from exc
        wrapped = self._wrap(outs, inputs, values)
        t1 = time.perf_counter()
        timeline = self.timeline
        if timeline is not None:
            node = nodes[0]
            timeline.record("comm", " + ".join(n.name for n in nodes), t0, t1, {
                "op": node.op_type, "bytes": self.group.bytes_sent - sent0,
                "algorithm": node.attributes.get("algorithm"),
                "bucket": [n.attributes.get("bucket") for n in nodes] if len(nodes) > 1
                else node.attributes.get("bucket"),
                "values": [x for n in nodes for x in n.inputs],
                "group_size": self.group.size})
        return wrapped, t1 - t0

    # ------------------------------------------------------------------ run
    def run(self, feeds: dict[str, ort.OrtValue], times: StepTimes | None = None
            ) -> dict[str, ort.OrtValue]:
        times = times or StepTimes()
        env = {**self.comm_constants, **feeds}
        pending: dict[str, Future] = {}
        timeline = self.timeline

        def resolve(names: list[str]) -> None:
            for name in names:
                fut = pending.get(name)
                if fut is None:
                    continue
                t0 = time.perf_counter()
                outs, dt, out_names = fut.result()
                t1 = time.perf_counter()
                times.wait += t1 - t0
                if timeline is not None:
                    timeline.record("wait", "wait for comm", t0, t1, {"value": name})
                times.comm += dt
                for o, value in zip(out_names, outs):
                    env[o] = value
                    pending.pop(o, None)

        for item in self.items:
            if isinstance(item, Segment):
                resolve(item.inputs)
                t0 = time.perf_counter()
                outs = self._run_segment(item, env)
                t1 = time.perf_counter()
                times.compute += t1 - t0
                if timeline is not None:
                    timeline.record("compute", self.labels[item.index], t0, t1,
                                    self.label_args[item.index])
                env.update(zip(item.outputs, outs))
            elif item.index not in self._in_batch:  # (else its batch has run it)
                indices = self.batches.get(item.index) or [item.index]
                names = [x for i in indices for x in self.comm_nodes[i].inputs]
                resolve(names)
                values = [env[n] for n in names]
                out_names = [x for i in indices for x in self.comm_nodes[i].outputs]
                if self.pool is None:
                    outs, dt = self._run_comm(indices, values)
                    times.comm += dt
                    env.update(zip(out_names, outs))
                else:
                    fut = self.pool.submit(lambda i=indices, v=values, o=out_names:
                                           (*self._run_comm(i, v), o))
                    for o in out_names:
                        pending[o] = fut
            for name in self.free_after.get(item.index, ()):
                if name not in pending:
                    env.pop(name, None)
        resolve(list(pending))
        missing = [o for o in self.outputs if o not in env]
        if missing:
            raise NgdistError(f"step outputs {missing} were not produced")
        return {o: env[o] for o in self.outputs}

    def drain(self) -> dict[str, np.ndarray]:
        """Complete communication that kernels keep in flight across steps (PushSum with
        overlap): what it brings, by comm-node output name, to be added to the values."""
        extra: dict[str, np.ndarray] = {}
        for idx, node in self.comm_nodes.items():
            spec = self.kernels[idx]
            if spec.drain is not None:
                got = spec.drain(self.group, node)
                extra.update(zip(node.outputs, got or ()))
        return extra

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for idx, node in self.comm_nodes.items():
            spec = self.kernels[idx]
            if spec.close is not None:
                spec.close(node)
