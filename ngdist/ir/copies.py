"""Copies of ONNX models that leave tensors' data out, and the data put back; the subgraphs a
node holds (``node_subgraphs``) and the outer values it reads (``outer_reads``).

A protobuf message (upb) keeps all it ever held until the whole message is freed: a tensor
overwritten in place (``CopyFrom``) or a repeated field cleared and filled again leaves the old
data in its memory. A model with large tensors is therefore copied field by field into a fresh
message, with the data of the tensors no consumer reads left out (shape inference, onnx's
checker, the executor's step proto, the write-back's record of the export) or replaced
(``with_tensor_data``), never deep-copied or changed in place.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from ngdist.errors import GraphError

TENSOR_DATA = ("raw_data", "float_data", "int32_data", "int64_data", "double_data")
LARGE_BYTES = 1 << 16  # bytes: no shape input (Reshape's, Pad's, Resize's) is this large


def large(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is larger than any tensor a shape computation reads: its size from
    its type and dims (``ByteSize`` walks the data: 0.14 s for a 400 MB weight, and a model's
    split asks of every tensor)."""
    if tensor.data_type == onnx.TensorProto.STRING:
        return tensor.ByteSize() > LARGE_BYTES
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return math.prod(tensor.dims) * itemsize > LARGE_BYTES


def node_subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs ``node``'s attributes hold (an If's branches, a Loop's or Scan's body)."""
    return [sub for a in node.attribute
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def outer_reads(node: onnx.NodeProto) -> set[str]:
    """The values of the graph around ``node`` that it reads: its inputs and every name its
    subgraphs read without making it themselves (an If branch may read a weight that is not
    among the If's inputs)."""
    names = {i for i in node.input if i}
    for sub in node_subgraphs(node):
        made = {i.name for i in sub.input} | {t.name for t in sub.initializer}
        read: set[str] = set()
        for inner in sub.node:
            read |= outer_reads(inner)
            made.update(inner.output)
        names |= read - made
    return names


def copy_fields(src: Any, dst: Any, skip: tuple[str, ...]) -> Any:
    """``dst`` with every field of the protobuf message ``src`` but those named in ``skip``
    (a copy that leaves out, e.g., tensor data without copying it first)."""
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        if field.is_repeated:
            getattr(dst, field.name).extend(value)
        elif field.message_type is not None:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)
    return dst


def without_tensor_data(proto: onnx.ModelProto, drop: Callable[[str], bool]) -> onnx.ModelProto:
    """A copy of ``proto`` whose initializers named so that ``drop(name)`` hold no data (their
    type and dims stay), copied field by field: no whole copy first."""
    out = copy_fields(proto, onnx.ModelProto(), ("graph",))
    copy_fields(proto.graph, out.graph, ("initializer",))
    for t in proto.graph.initializer:
        if drop(t.name):
            copy_fields(t, out.graph.initializer.add(), TENSOR_DATA)
        else:
            out.graph.initializer.append(t)
    return out


def with_tensor_data(proto: onnx.ModelProto, values: Mapping[str, np.ndarray]
                     ) -> onnx.ModelProto:
    """A fresh copy of ``proto`` whose initializers named in ``values`` hold those values.
    (Set in place instead, each one's data would stay beside the old: a protobuf message
    keeps all it ever held until it is freed.)"""
    out = copy_fields(proto, onnx.ModelProto(), ("graph",))
    copy_fields(proto.graph, out.graph, ("initializer",))
    for t in proto.graph.initializer:
        out.graph.initializer.append(numpy_helper.from_array(values[t.name], t.name)
                                     if t.name in values else t)
    return out


def to_proto_without_data(model: ir.Model, drop: Callable[[str], bool]) -> onnx.ModelProto:
    """``without_tensor_data(ir.to_proto(model), drop)`` without the whole proto first: the
    initializers named so that ``drop(name)`` are serialised as placeholders of their type and
    dims (no data is read), which then lose the placeholder's fields."""
    inits = model.graph.initializers
    saved = {n: v.const_value for n, v in inits.items()
             if v.const_value is not None and drop(n)}
    try:
        for n, t in saved.items():
            inits[n].const_value = ir.ExternalTensor(
                "", None, None, t.dtype, shape=t.shape, name=t.name, doc_string=t.doc_string,
                metadata_props=dict(t.metadata_props))
        proto = ir.to_proto(model)
    finally:
        for n, t in saved.items():
            inits[n].const_value = t
    for t in proto.graph.initializer:
        if t.name in saved:
            t.ClearField("data_location")
            t.ClearField("external_data")
    return proto


def put_tensor_data(graph: onnx.GraphProto, tensors: dict[int, onnx.TensorProto]) -> None:
    """``graph``'s initializers at the positions of ``tensors`` (copies of those without their
    data, e.g. from :func:`without_tensor_data`) become those tensors, data included."""
    for k, tensor in tensors.items():
        target = graph.initializer[k]
        if target.name != tensor.name:
            raise GraphError(f"initializer {k} is {target.name!r}, not {tensor.name!r}: the "
                             "graph's initializers were reordered")
        target.CopyFrom(tensor)


def checker_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for onnx's checker, copied without its large tensors' data (the checker
    serialises the model and parses it again: two whole copies otherwise): the main graph's
    become inputs of their type and shape (the checker refuses a tensor without data;
    ``check_tensor_data`` checks theirs), the training step's hold none (the checker does not
    read them)."""
    out = copy_fields(model, onnx.ModelProto(), ("graph", "training_info"))
    copy_fields(model.graph, out.graph, ("initializer",))
    inputs = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if not large(t):
            out.graph.initializer.append(t)
        elif t.name not in inputs:
            out.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type,
                                                                      list(t.dims)))
    for info in model.training_info:
        light = copy_fields(info, out.training_info.add(), ("algorithm",))
        copy_fields(info.algorithm, light.algorithm, ("initializer",))
        for t in info.algorithm.initializer:
            copy_fields(t, light.algorithm.initializer.add(),
                        TENSOR_DATA if large(t) else ())
    return out
