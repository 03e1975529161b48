"""Which results of each segment are written into dead memory, per shapes of its inputs.

The plan (runtime/plan.py) says which memory the step may write over; what fits where depends
on the shapes of a segment's values, which the first run shows. :class:`InPlacePlanner` plans
a segment at its first run (the results it writes in place that no later item reads become
extra outputs of its session) and again for other input shapes (a smaller last batch), with
runtime/inplace.py's ``plan_segment``.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ngdist.ir.model import IR_VERSION
from ngdist.runtime.inplace import Buffer, plan_segment, plannable, static_shapes
from ngdist.runtime.partition import Segment
from ngdist.runtime.plan import StepPlan

logger = logging.getLogger(__name__)

ORT_TYPES = {
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

Env = Mapping[str, ort.OrtValue]
Assignments = dict[str, tuple[str, tuple[int, ...]]]  # result -> (buffer, the result's shape)


class InPlacePlanner:
    """The in-place assignments of a plan's segments, made as their shapes become known."""

    def __init__(self, plan: StepPlan, any_shape: bool) -> None:
        """``any_shape``: a segment's result may view onnxruntime's memory in another shape
        (values on the CPU)."""
        self.plan = plan
        self.any_shape = any_shape
        self._claimed: set[str] = set()  # donated values an earlier segment writes into
        self._own: dict[int, set[str]] = {}  # the donated values each segment writes into
        self.extra: dict[int, list[str]] = {}  # results a segment returns to write in place
        self.assigned: dict[int, dict[tuple, Assignments]] = {}  # by segment, by shapes

    def first(self, seg: Segment, env: Env) -> list[str]:
        """Plans ``seg`` for the shapes of its first run; the results it writes in place that
        are not its outputs (they become extra outputs of its session)."""
        made = self._assign(seg, env)
        self._own[seg.index] = {b for b, _ in made.values() if b in self.plan.donated}
        self._claimed.update(self._own[seg.index])
        if made:  # (a segment with nothing to write in place is not planned again)
            self.assigned[seg.index] = {_shape_key(seg, env): made}
            logger.debug("segment %d writes %d results in place", seg.index, len(made))
        self.extra[seg.index] = [x for x in made if x not in seg.outputs]
        return self.extra[seg.index]

    def for_run(self, seg: Segment, env: Env) -> Assignments:
        """The assignments of ``seg`` at the shapes of ``env`` (planned again for new shapes)."""
        plans = self.assigned.get(seg.index)
        if not plans:
            return {}
        key = _shape_key(seg, env)
        made = plans.get(key)
        if made is None:  # other shapes (a smaller last batch): plan again for them
            made = self._assign(seg, env, results={*self.extra.get(seg.index, []), *seg.outputs},
                                donated=sorted(self._own[seg.index]))
            plans[key] = made
        return made

    def _buffers(self, seg: Segment, env: Env, donated: Collection[str] | None) -> list[Buffer]:
        """Memory ``seg`` may write into: donated values no later item reads (and no earlier
        segment writes into; ``donated`` narrows them), and values an earlier segment made, or
        an AllReduce reduced, that die here."""
        plan = self.plan
        last = plan.last_use
        if donated is None:
            donated = [x for x in sorted(plan.donated) if x not in self._claimed and
                       last.get(x, -1) <= seg.index]
        made = [x for x in seg.inputs if x in plan.made_by_segment and x not in plan.outputs
                and last.get(x) == seg.index and x not in plan.comm_touched]
        reduced = [x for x in seg.inputs if x in plan.reduced and last.get(x) == seg.index]
        out = []
        for x in [*donated, *made, *reduced]:
            value = env.get(x)
            if value is not None and value.data_type() in ORT_TYPES:
                # onnxruntime's own memory (a segment's result) may be viewed in other shapes
                out.append(Buffer(x, tuple(value.shape()), ORT_TYPES[value.data_type()],
                                  any_shape=x in made and self.any_shape))
        return out

    def _assign(self, seg: Segment, env: Env, results: Collection[str] | None = None,
                donated: Collection[str] | None = None) -> Assignments:
        """{result: (buffer, the result's shape)} for ``seg`` at the shapes of ``env``."""
        if not plannable(seg.nodes):
            return {}
        buffers = self._buffers(seg, env, donated)
        if not buffers:
            return {}
        known, consts, small = _segment_inputs(seg, env, self.plan.constants)
        shapes = static_shapes(seg.nodes, known, consts, self.plan.opsets, IR_VERSION)
        if results is not None:
            shapes = {k: v for k, v in shapes.items() if k in results}
        made = plan_segment(seg.nodes, buffers, shapes, keep=set(seg.outputs), constants=small)
        return {r: (b, shapes[r][0]) for r, b in made.items()}


def _shape_key(seg: Segment, env: Env) -> tuple:
    return tuple(tuple(env[x].shape()) if x in env else None for x in seg.inputs)


def _segment_inputs(seg: Segment, env: Env, constants: Mapping[str, onnx.TensorProto]
                    ) -> tuple[dict, dict[str, onnx.TensorProto], dict[str, np.ndarray]]:
    """(shape and type of each input in ``env``, the constants it reads, the values of the
    small ones): small values (scalars, shape targets) go by value, for Reshape."""
    known = {x: (tuple(env[x].shape()), ORT_TYPES[env[x].data_type()])
             for x in seg.inputs if x in env and env[x].data_type() in ORT_TYPES}
    consts = {x: constants[x] for x in seg.inputs if x not in env and x in constants}
    small = {x: numpy_helper.to_array(t) for x, t in consts.items()
             if int(np.prod(t.dims, dtype=np.int64)) <= SMALL_VALUE}
    for x in seg.inputs:
        value = env.get(x)
        if value is not None and value.data_type() in ORT_TYPES \
                and int(np.prod(value.shape(), dtype=np.int64)) <= SMALL_VALUE and \
                value.data_type() != BFLOAT16:
            small[x] = value.numpy()
            consts[x] = numpy_helper.from_array(small[x], x)
            known.pop(x, None)
    return known, consts, small
