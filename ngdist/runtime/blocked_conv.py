"""Convolutions on onnxruntime's blocked-channel (NCHWc) CPU kernels.

onnxruntime runs a Conv through its NCHWc kernels only when the graph optimiser can reorder
the weight once, at load time, which needs the weight to be a constant. In a training step
the weights are inputs, so every Conv takes the generic im2col + GEMM path (and every
ConvTranspose its GEMM + col2im path). For a depthwise Conv (one input and one output channel
per group) that path does one tiny GEMM per channel, several times slower than the NCHWc
kernel even with the reorders included (docs/benchmarks.md, "Blocked convolutions").

:class:`BlockConvs`, an onnx_ir pass of the runtime's session rewrites (runtime/rewrites.py,
run on every CPU session's model, given as a proto or as bytes), rewrites such a convolution into what the optimiser would have made of
it, with the weight reordered inside the graph at every run (a Reshape, Transpose, Reshape of
a small tensor; for a ConvTranspose a Gather reverses its kernel taps): ``ReorderInput``
(NCHW -> NCHWc), ``com.microsoft.nchwc`` ``Conv`` on the reordered weight, ``ReorderOutput``
back to NCHW. Depthwise Convs always (weight in OIHWBo
order, output channels blocked innermost); dense Convs (group 1) and stride-1 ConvTransposes
of group 1 (a Conv's data gradient, computed as the Conv of the output gradient with the
weight flipped and its channels swapped) in OIHWBiBo order when the output holds at least
``DENSE_OUTPUT_PER_WEIGHT`` elements per weight element: the 6-D reorder of a large weight on a
small map costs more than the kernel saves.

On by default on the CPU; ``NGDIST_CPU_BLOCKED_CONV=0`` turns it off. Each rewritten
convolution agrees with onnxruntime's own to float32 rounding, and a step's gradients agree
with float64 as closely as PyTorch's float32 ones.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from ngdist.errors import NgdistError
from ngdist.runtime.inplace import static_shapes

logger = logging.getLogger(__name__)

DOMAIN = "com.microsoft.nchwc"
ENV = "NGDIST_CPU_BLOCKED_CONV"  # "0" turns the rewrite off; on by default


def requested() -> bool:
    """Whether the rewrite is wanted: yes unless ``NGDIST_CPU_BLOCKED_CONV=0``."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("", "0", "1"):
        raise NgdistError(f"{ENV}={value!r}: set it to 0 to keep convolutions on "
                          "onnxruntime's generic kernels, or 1 (the default) to run them on "
                          "its blocked-channel CPU kernels")
    return value != "0"


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    g = model.graph
    out = {t.name: list(t.dims) for t in g.initializer}
    for v in [*g.input, *g.value_info, *g.output]:
        dims = v.type.tensor_type.shape.dim
        if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out.setdefault(v.name, [d.dim_value for d in dims])
    return out


def _depthwise(node: onnx.NodeProto, w_shape: Sequence[int] | None, block: int) -> bool:
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or w_shape is None or \
            len(w_shape) != 4:
        return False
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    channels = w_shape[0]
    return group > 1 and w_shape[1] == 1 and channels == group and channels % block == 0


def probe_model() -> onnx.ModelProto:
    """A ReorderInput of 4 channels: its output's channel count is the NCHWc block size of
    this CPU (8 with AVX2, 16 with AVX-512); a build or CPU without the kernels rejects it."""
    graph = helper.make_graph(
        [helper.make_node("ReorderInput", ["x"], ["y"], domain=DOMAIN)], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(DOMAIN, 1)],
                             ir_version=9)


# a dense Conv (or stride-1 ConvTranspose) goes to the blocked kernels when its output holds at
# least this many elements per weight element: the weight is reordered in the graph at every
# run, which pays only when the convolution's work outweighs it (the measured threshold:
# docs/benchmarks.md, "Blocked convolutions")
DENSE_OUTPUT_PER_WEIGHT = 2


@dataclass(frozen=True)
class _Target:
    """One convolution to move: ``kind`` "depthwise", "dense" or "transposed"."""

    kind: str
    w_shape: tuple[int, ...]


def applies(model: onnx.ModelProto, block: int,
            shapes: Mapping[str, Sequence[int]] | None = None) -> bool:
    """Whether :class:`BlockConvs` may change ``model`` at NCHWc block size ``block`` (more than
    4 channels per block; 0: no such kernels here): the rewrite is wanted and the graph has a
    convolution of a kind it rewrites (read from the proto: a graph without one is not
    converted to onnx_ir and back)."""
    return block > 4 and requested() and \
        any(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node) and \
        bool(_kinds(model, block, _known_shapes(model, shapes)))


class BlockConvs(ir.passes.InPlacePass):
    """The model's 2-D convolutions whose float32 weight is a graph input (and whose channels
    are multiples of ``block``, the CPU's NCHWc block size) on the NCHWc kernels: every
    depthwise Conv; a dense Conv (group 1) when its output holds at least
    ``DENSE_OUTPUT_PER_WEIGHT`` elements per weight element; a stride-1 ConvTranspose of group
    1 (the data gradient of a Conv), under the same rule, as the Conv of its input with the
    weight flipped and its channels swapped. ``shapes`` gives static shapes of the graph's
    inputs (a weight's shape must be known, and a dense one's output size). A Relu that alone
    reads a rewritten convolution's result (found through onnx_ir's uses, no readers map of
    its own) runs inside the blocked kernel. The shapes are read from the model's proto (ONNX
    shape inference); the graph is rewritten in place."""

    def __init__(self, block: int, shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        super().__init__()
        self.block = block
        self.shapes = shapes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        targets = _targets(ir.to_proto(model), self.block, self.shapes) \
            if self.block > 4 else {}
        if not targets:
            return ir.passes.PassResult(model, modified=False)
        graph = model.graph
        nodes = list(graph)  # (the proto's node order)
        reordered: dict[tuple[str, str], ir.Value] = {}
        for i, target in targets.items():
            _block(graph, nodes[i], target, _fusable_relu(nodes[i]), reordered, self.block)
        graph.opset_imports.setdefault(DOMAIN, 1)
        logger.debug("%d convolution(s) on the NCHWc kernels: %s", len(targets),
                     sorted(t.kind for t in targets.values()))
        return ir.passes.PassResult(model, modified=True)


def _targets(model: onnx.ModelProto, block: int, shapes: Mapping[str, Sequence[int]] | None
             ) -> dict[int, _Target]:
    """{node index: how it is rewritten} of the convolutions :class:`BlockConvs` rewrites."""
    known = _known_shapes(model, shapes)
    kinds = _kinds(model, block, known)
    if any(kind != "depthwise" for kind, _ in kinds.values()):  # output sizes decide these
        known.update(_inferred_shapes(model, known))
    targets: dict[int, _Target] = {}
    for i, (kind, w_shape) in kinds.items():
        if kind != "depthwise":
            y_shape = known.get(model.graph.node[i].output[0])
            if y_shape is None or \
                    math.prod(y_shape) < DENSE_OUTPUT_PER_WEIGHT * math.prod(w_shape):
                continue
        targets[i] = _Target(kind, tuple(w_shape))
    return targets


def _known_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None
                  ) -> dict[str, list[int]]:
    known = _static_shapes(model)
    known.update({k: list(v) for k, v in (shapes or {}).items()})
    return known


def _kinds(model: onnx.ModelProto, block: int, known: Mapping[str, list[int]]
           ) -> dict[int, tuple[str, list[int]]]:
    """{node index: (kind, weight shape)} of the convolutions whose own attributes and
    weight (a float32 graph input: onnxruntime reorders a constant one itself) qualify."""
    weights = {v.name for v in model.graph.input
               if v.type.tensor_type.elem_type == TensorProto.FLOAT} - \
        {t.name for t in model.graph.initializer}
    return {i: (kind, known[n.input[1]]) for i, n in enumerate(model.graph.node)
            if len(n.input) > 1 and n.input[1] in weights and n.domain in ("", "ai.onnx") and
            n.op_type in ("Conv", "ConvTranspose") and
            (kind := _kind(n, known.get(n.input[1]), block)) is not None}


def _node(op_type: str, inputs: Sequence[ir.Value | None], *attrs: ir.Attr, name: str,
          domain: str = "", output: str | None = None) -> ir.Node:
    """A node of one output named ``output`` (default: ``name``), its attributes typed
    (onnx_ir's ``ir.node`` infers them through slow protocol checks)."""
    return ir.Node(domain, op_type, inputs, attrs, name=name,
                   outputs=[ir.Value(name=output or name)])


def _block(graph: ir.Graph, node: ir.Node, target: _Target, relu: ir.Node | None,
           reordered: dict[tuple[str, str], ir.Value], block: int) -> None:
    """Convolution ``node`` (and the ``relu`` that alone reads it) replaced by ReorderInput ->
    NCHWc Conv -> ReorderOutput, with its weight reordered once per (weight, kind)."""
    p = f"{node.outputs[0].name}/nchwc"  # value names are unique; node names need not be
    w = node.inputs[1]
    new: list[ir.Node] = []
    key = (w.name, target.kind)
    if key not in reordered:
        weight_nodes = _reorder_weight(graph, w, target, block, p)
        new += weight_nodes
        reordered[key] = weight_nodes[-1].outputs[0]
    attrs = list(node.attributes.values()) if node.op_type == "Conv" else \
        _as_conv(node, target)
    if relu is not None:  # the Relu that alone reads the result runs inside the kernel
        attrs.append(ir.AttrString("activation", "Relu"))
    channels = target.w_shape[1] if target.kind == "transposed" else target.w_shape[0]
    x = _node("ReorderInput", [node.inputs[0]], name=f"{p}/x", domain=DOMAIN)
    conv = _node("Conv", [x.outputs[0], reordered[key], *node.inputs[2:]], *attrs,
                 name=f"{p}/conv", domain=DOMAIN, output=f"{p}/y")
    out = _node("ReorderOutput", [conv.outputs[0]], ir.AttrInt64("channels", channels),
                name=f"{p}/out", domain=DOMAIN)
    new += [x, conv, out]
    old = [node] if relu is None else [node, relu]
    ir.convenience.replace_nodes_and_values(graph, node, old, new, [old[-1].outputs[0]],
                                            [out.outputs[0]])


def _fusable_relu(conv: ir.Node) -> ir.Node | None:
    """The Relu that alone reads ``conv``'s result, which is no graph output (the blocked
    Conv then applies it itself), else None."""
    result = conv.outputs[0]
    uses = list(result.uses())
    if len(uses) != 1 or result.is_graph_output():
        return None
    n = uses[0].node
    return n if n.op_type == "Relu" and n.domain in ("", "ai.onnx") else None


def _kind(node: onnx.NodeProto, w_shape: Sequence[int] | None, block: int) -> str | None:
    """"depthwise", "dense", "transposed" or None (stays) by the node's own attributes."""
    if w_shape is None or len(w_shape) != 4:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    group = attrs.get("group", 1)
    if node.op_type == "Conv":
        if _depthwise(node, w_shape, block):
            return "depthwise"
        if group == 1 and w_shape[0] % block == 0 and w_shape[1] % block == 0:
            return "dense"
        return None
    # ConvTranspose: stride 1 and explicit pads that its flipped Conv can take
    kernel = list(w_shape[2:])
    if group != 1 or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or \
            "output_shape" in attrs or any(s != 1 for s in attrs.get("strides", [1, 1])) or \
            any(attrs.get("output_padding", [0, 0])) or \
            list(attrs.get("kernel_shape", kernel)) != kernel or \
            any(p < 0 for p in _flipped_window(attrs, kernel)[1]) or \
            w_shape[0] % block or w_shape[1] % block:
        return None
    return "transposed"


def _flipped_window(attrs: Mapping[str, Any], kernel: list[int]
                    ) -> tuple[list[int], list[int]]:
    """(dilations, pads) of the Conv that computes a stride-1 ConvTranspose with attributes
    ``attrs``: the same dilations, pads (k - 1) d - p on either side (negative: no such
    Conv)."""
    dilations = list(attrs.get("dilations", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    return dilations, [(k - 1) * d - p for p, k, d in zip(pads, kernel * 2, dilations * 2)]


def _as_conv(node: ir.Node, target: _Target) -> list[ir.Attr]:
    """The attributes of the Conv that computes stride-1 ``ConvTranspose`` ``node``."""
    kernel = list(target.w_shape[2:])
    dilations, pads = _flipped_window(
        {name: attr.value for name, attr in node.attributes.items()}, kernel)
    return [ir.AttrInt64s("kernel_shape", kernel), ir.AttrInt64s("dilations", dilations),
            ir.AttrInt64s("pads", pads)]


def _reorder_weight(graph: ir.Graph, w: ir.Value, target: _Target, block: int, p: str
                    ) -> list[ir.Node]:
    """Nodes that reorder weight ``w`` for the blocked Conv (their shape constants registered
    as initializers of ``graph``); the last one's output is the reordered weight. Depthwise:
    OIHW -> OIHWBo ([C/B, B, 1, KH, KW] -> [C/B, 1, KH, KW, B]); dense: OIHW -> OIHWBiBo
    ([O/B, Bo, I/B, Bi, KH*KW] -> [O/B, I/B, KH*KW, Bi, Bo]); transposed: W [I, O, KH, KW] of
    the ConvTranspose read as the Conv weight [O, I, KH, KW] in OIHWBiBo with its taps
    flipped along KH and KW."""
    a, b, kh, kw = target.w_shape

    def ints(name: str, values: list[int]) -> ir.Value:
        value = ir.Value(name=f"{p}/{name}",
                         const_value=ir.Tensor(np.array(values, np.int64), name=f"{p}/{name}"))
        graph.register_initializer(value)
        return value

    if target.kind == "depthwise":
        split, perm, flat = [a // block, block, 1, kh, kw], [0, 2, 3, 4, 1], [a, 1, kh, kw]
    elif target.kind == "dense":
        split = [a // block, block, b // block, block, kh * kw]
        perm, flat = [0, 2, 4, 3, 1], [a, b, kh, kw]
    else:  # [I/B, Bi, O/B, Bo, KH*KW] -> [O/B, I/B, KH*KW, Bi, Bo], the taps reversed below
        split = [a // block, block, b // block, block, kh * kw]
        perm, flat = [2, 0, 4, 1, 3], [b, a, kh, kw]
    nodes = [_node("Reshape", [w, ints("split", split)], name=f"{p}/w5")]
    nodes.append(_node("Transpose", [nodes[-1].outputs[0]], ir.AttrInt64s("perm", perm),
                       name=f"{p}/wt"))
    if target.kind == "transposed":
        # flipping both spatial axes reverses the row-major taps: a Gather of whole
        # [Bi, Bo] blocks (a Slice with negative steps over KH and KW costs 2x the time)
        taps = ints("taps", list(range(kh * kw - 1, -1, -1)))
        nodes.append(_node("Gather", [nodes[-1].outputs[0], taps], ir.AttrInt64("axis", 2),
                           name=f"{p}/wf"))
    nodes.append(_node("Reshape", [nodes[-1].outputs[0], ints("flat", flat)], name=f"{p}/w"))
    return nodes


def _inferred_shapes(model: onnx.ModelProto, known: Mapping[str, Sequence[int]]
                     ) -> dict[str, list[int]]:
    """Static shapes of the model's values by ONNX shape inference (``inplace.static_shapes``)
    from ``known`` input shapes; {} when inference fails."""
    inputs = {v.name: (tuple(known[v.name]), v.type.tensor_type.elem_type)
              for v in model.graph.input if v.name in known}
    constants = {t.name: t for t in model.graph.initializer}
    shapes = static_shapes(list(model.graph.node), inputs, constants, list(model.opset_import),
                           model.ir_version)
    return {k: list(s) for k, (s, _) in shapes.items() if k not in known}
