"""In-place results: elementwise results written into the memory of values that are dead by then.

onnxruntime gives each result of a session a buffer of its own, so an elementwise op over a
parameter-sized tensor reads its inputs and writes a third buffer, which on a CPU costs a
read for ownership of every line it writes. An op that writes into the memory of one of its
inputs runs about twice as fast (benchmarks/inplace_ops.py; docs/benchmarks.md), and the optimizer
update is a chain of such ops over every parameter: PyTorch runs it in place (``add_``,
``mul_``, ``lerp_``).

A step replaces its parameters and optimizer state with new values and never reads the old
ones again, and the gradients die in the update. :func:`plan_segment` picks, for one segment,
which elementwise results go into such memory: the result becomes an output of the segment,
bound (IOBinding) to the dead value's OrtValue. Any memory works for any result of the same
shape and type (the caller keeps whichever buffer ends up holding a new value), so a buffer
carries a chain of values. The rule that makes this safe whatever order onnxruntime runs the
segment's nodes in: a buffer holding value ``v`` is overwritten by node ``n`` only when every
node of the segment that reads ``v`` is ``n`` itself or an ancestor of ``n``, no later item of
the step reads ``v`` (the readers of a view of ``v``, such as a Reshape, or of an output that
onnxruntime computes in ``v``'s memory, such as BatchNormalization's running statistics, count
as readers of ``v``), and ``n`` is an elementwise op (output element i depends on input
elements i only) whose result has ``v``'s shape and type. A buffer that receives a step output
keeps it.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

# onnxruntime CPU kernels whose output element i reads only input elements i (broadcast
# operands aside): writing the output over an input of the same shape is safe
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Neg", "Max", "Min", "Abs",
                         "Reciprocal"})
# (op, input index) that reads only the type or shape of a value, never its elements
METADATA_ONLY = frozenset({("CastLike", 1), ("Shape", 0), ("Size", 0)})
# ops whose output onnxruntime makes a view of the input (no copy) inside a session
VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
# other kernels whose outputs share an input's memory in onnxruntime: (output, input) index
# pairs. BatchNormalization in training mode updates the running mean and variance in place
ALIASES = {"BatchNormalization": ((1, 3), (2, 4))}
# segments planned in place hold only these ops: elementwise ops and views, and ops known to
# write fresh memory (the scalar arithmetic of an optimizer, a bucket's Split)
PLANNED_OPS = ELEMENTWISE | VIEWS | frozenset({
    "Constant", "Split", "Concat", "Slice", "Cast", "CastLike", "Where", "Pow", "Greater",
    "Less", "Equal", "Not", "And", "Or", "Shape", "Size", "Sign", "Exp", "Log", "Clip",
    "ReduceSum", "ReduceMean", "Sum", "Expand"})


def plannable(nodes: Sequence[onnx.NodeProto]) -> bool:
    """Whether a segment holds only ops of ``PLANNED_OPS`` (the update of a step): nothing in
    it shares memory in ways :func:`plan_segment` does not know of."""
    return all(n.op_type in PLANNED_OPS and n.domain in ("", "ai.onnx") for n in nodes)


# smaller results stay in onnxruntime's memory: they fit in the caches (1 MiB of float32 is a
# core's L2 here), where a new buffer costs little, and binding one costs more than it saves
# (MobileNetV2: docs/benchmarks.md, "In-place update")
MIN_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class Buffer:
    """Memory a segment may write into: the value it holds when the segment starts, that
    value's shape and ONNX element type, and whether a result of another shape with as many
    elements may go there (through a view of the memory in that shape)."""

    name: str
    shape: tuple[int, ...]
    elem_type: int
    any_shape: bool = False

    def fits(self, shape: tuple[int, ...], elem_type: int) -> bool:
        return elem_type == self.elem_type and (
            shape == self.shape or
            self.any_shape and int(np.prod(shape, dtype=np.int64)) ==
            int(np.prod(self.shape, dtype=np.int64)))


Shapes = dict[str, tuple[tuple[int, ...], int]]  # value -> (static shape, ONNX element type)


def static_shapes(nodes: Sequence[onnx.NodeProto], inputs: Shapes,
                  constants: Mapping[str, onnx.TensorProto],
                  opsets: Sequence[onnx.OperatorSetIdProto], ir_version: int) -> Shapes:
    """Shape and element type of every value of the segment whose shape is static, by ONNX
    shape inference from the inputs' actual shapes. ONNX infers no shape for a MaxUnpool's
    result even when its ``output_shape`` is ``Shape(v)`` of a value of known shape (MaxPool's
    gradient): that result gets v's shape, and inference runs again from there."""
    vi = [helper.make_tensor_value_info(n, t, list(s)) for n, (s, t) in inputs.items()]
    graph = helper.make_graph(list(nodes), "segment", vi, [], initializer=list(constants.values()))
    model = helper.make_model(graph, opset_imports=list(opsets), ir_version=ir_version)
    shape_of = {n.output[0]: n.input[0] for n in nodes
                if n.op_type == "Shape" and not n.attribute}
    unpooled = {n.output[0]: shape_of[n.input[2]] for n in nodes
                if n.op_type == "MaxUnpool" and len(n.input) > 2 and n.input[2] in shape_of}
    out: Shapes = {}
    for _ in range(2):
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False,
                                                         data_prop=True)
        except Exception:  # noqa: BLE001 - no shapes: nothing is planned in place
            return {}
        out = {}
        for v in inferred.graph.value_info:
            t = v.type.tensor_type
            if not t.HasField("shape") or not t.elem_type:
                continue
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            if None not in dims:
                out[v.name] = (tuple(int(d) for d in dims), t.elem_type)
        known = {**inputs, **out}
        hints = {result: known[src][0] for result, src in unpooled.items()
                 if result not in out and src in known}
        if not hints:
            break
        elem = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
        model.graph.value_info.extend(  # the shape of v, the element type of the unpooled data
            helper.make_tensor_value_info(result, elem.get(result) or known[unpooled[result]][1],
                                          list(shape)) for result, shape in hints.items())
    return out


def _noop_input(n: onnx.NodeProto, values: Mapping[str, np.ndarray]) -> str | None:
    """The input that ``n`` passes through when onnxruntime's graph optimizer may remove it
    as a no-op (x + 0, x - 0, x * 1, x / 1 with a constant operand): its output is then that
    input's memory."""
    neutral = {"Add": 0, "Sub": 0, "Mul": 1, "Div": 1}.get(n.op_type)
    if neutral is None or len(n.input) != 2:
        return None
    for k, other in ((0, 1), (1, 0)):
        c = values.get(n.input[other])
        if c is not None and (k == 0 or n.op_type in ("Add", "Mul")) and \
                bool(np.all(c == neutral)):
            return n.input[k]
    return None


def plan_segment(nodes: Sequence[onnx.NodeProto], buffers: Sequence[Buffer],
                 shapes: Mapping[str, tuple[tuple[int, ...], int]],
                 keep: Collection[str], min_elements: int = MIN_ELEMENTS,
                 constants: Mapping[str, np.ndarray] | None = None) -> dict[str, str]:
    """{result: buffer name}: which results of ``nodes`` (one segment, in a topological order)
    are written into which of ``buffers``. ``shapes``: static shape and element type of the
    segment's values; ``keep``: values read after the segment or returned by the step (a buffer
    that receives one is not overwritten again); results of fewer than ``min_elements``
    elements stay where onnxruntime puts them; ``constants``: values of the segment's small
    constants (a no-op such as ``x * 1`` counts as a view of x)."""
    root, passes, readers = _memory_readers(nodes, constants)
    kept = {root.get(x, x) for x in keep}
    ancestors = _ancestors(nodes)
    holding = {b.name: b.name for b in buffers}  # buffer -> the value it holds now
    free = {b.name: b for b in buffers}
    plan: dict[str, str] = {}
    for i, n in enumerate(nodes):
        if n.op_type not in ELEMENTWISE or n.domain not in ("", "ai.onnx") or \
                len(n.output) != 1 or i in passes:
            continue
        out = n.output[0]
        if shapes.get(out) is None or out in plan or \
                int(np.prod(shapes[out][0], dtype=np.int64)) < min_elements:
            continue
        mask = ancestors[i] | (1 << i)
        # prefer the memory of an operand (the op then streams over one buffer less)
        order = sorted(free, key=lambda b: holding[b] not in n.input)
        for b in order:
            if not free[b].fits(*shapes[out]):
                continue
            held = holding[b]
            if any(not (mask >> r) & 1 for r in readers.get(held, ())):
                continue
            plan[out] = b
            holding[b] = out
            if out in kept:
                del free[b]
            break
    return plan


def _memory_readers(nodes: Sequence[onnx.NodeProto], constants: Mapping[str, np.ndarray] | None
                    ) -> tuple[dict[str, str], set[int], dict[str, list[int]]]:
    """(value -> the value whose memory it may be, the nodes whose output may be their
    input's memory, memory -> the nodes that read it). A view (Reshape, Squeeze, a no-op ...)
    may share its input's memory: its readers read that memory."""
    values = dict(constants or {})
    for n in nodes:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = onnx.numpy_helper.to_array(n.attribute[0].t)
    root: dict[str, str] = {}
    passes: set[int] = set()  # nodes whose output may be their input's memory
    for i, n in enumerate(nodes):
        pairs = ((0, 0),) if n.op_type in VIEWS else ALIASES.get(n.op_type, ())
        noop = _noop_input(n, values)
        if noop is not None:
            pairs = ((0, list(n.input).index(noop)),)
        if pairs:
            passes.add(i)
        for o, k in pairs:
            if o < len(n.output) and k < len(n.input) and n.output[o] and n.input[k]:
                root[n.output[o]] = root.get(n.input[k], n.input[k])
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for k, x in enumerate(n.input):
            if x and (n.op_type, k) not in METADATA_ONLY:
                readers.setdefault(root.get(x, x), []).append(i)
    return root, passes, readers


def _ancestors(nodes: Sequence[onnx.NodeProto]) -> list[int]:
    """Bit j of entry i: node j is an ancestor of node i."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    ancestors: list[int] = []
    for n in nodes:
        bits = 0
        for x in n.input:
            p = producer.get(x)
            if p is not None:
                bits |= ancestors[p] | (1 << p)
        ancestors.append(bits)
    return ancestors
