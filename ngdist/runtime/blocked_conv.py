"""Depthwise convolutions on onnxruntime's blocked-channel (NCHWc) CPU kernels.

onnxruntime runs a Conv through its NCHWc kernels only when the graph optimiser can reorder
the weight once, at load time, which needs the weight to be a constant. In a training step
the weights are inputs, so every Conv takes the generic im2col + GEMM path, and for a
depthwise Conv (one input and one output channel per group) that path does one tiny GEMM per
channel: x [8, 40, 16, 16] with a 7x7 depthwise kernel takes 1.8 ms there and 0.31 ms on the
NCHWc kernel, [8, 144, 16, 16] 3x3 1.2 vs 0.26 ms (one thread, the reorders included).

:func:`block_depthwise_convs` rewrites such a Conv into what the optimiser would have made of
it, with the weight reordered inside the graph at every run (a Reshape, Transpose, Reshape of
a small tensor): ``ReorderInput`` (NCHW -> NCHWc), ``com.microsoft.nchwc`` ``Conv`` on the
weight in OIHWBo order (output channels blocked innermost), ``ReorderOutput`` back to NCHW.
Dense convolutions stay as they are: their weights' 6-D reorder costs more than the kernel
saves ([8, 512, 2, 2] 3x3: 15.2 vs 5.0 ms).

On by default on the CPU; ``NGDIST_CPU_BLOCKED_CONV=0`` turns it off. It makes MobileNetV2,
MobileNetV3-Large and timm's ConvNeXt-Atto steps ~23% faster (8 images of 64x64, one
thread); each rewritten Conv agrees with onnxruntime's own to float32 rounding, and a step's
gradients agree with float64 as closely as PyTorch's float32 ones.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ngdist.errors import NgdistError

logger = logging.getLogger(__name__)

DOMAIN = "com.microsoft.nchwc"
ENV = "NGDIST_CPU_BLOCKED_CONV"  # "0" turns the rewrite off; on by default


def requested() -> bool:
    """Whether the rewrite is wanted: yes unless ``NGDIST_CPU_BLOCKED_CONV=0``."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("", "0", "1"):
        raise NgdistError(f"{ENV}={value!r}: set it to 0 to keep depthwise convolutions on "
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


def block_depthwise_convs(model: onnx.ModelProto, block: int,
                          shapes: Mapping[str, Sequence[int]] | None = None
                          ) -> onnx.ModelProto:
    """``model`` with each depthwise 2-D Conv whose weight is a float32 graph input (and whose
    channels are a multiple of ``block``, the CPU's NCHWc block size; 0: none) on the NCHWc
    kernels; ``shapes`` adds static shapes of the graph's inputs (a weight's shape must be
    known). Returns ``model`` itself when nothing applies, else a rewritten copy."""
    if block <= 4 or not requested() or not any(n.op_type == "Conv" for n in model.graph.node):
        return model
    known = _static_shapes(model)
    known.update({k: list(v) for k, v in (shapes or {}).items()})
    # weights fed to the graph as float32 inputs (a constant one onnxruntime reorders itself)
    weights = {v.name for v in model.graph.input
               if v.type.tensor_type.elem_type == TensorProto.FLOAT} - \
        {t.name for t in model.graph.initializer}
    targets = {i for i, n in enumerate(model.graph.node)
               if len(n.input) > 1 and n.input[1] in weights and
               _depthwise(n, known.get(n.input[1]), block)}
    if not targets:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    reordered: dict[str, str] = {}
    new_nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(nodes):
        if i not in targets:
            new_nodes.append(node)
            continue
        x, w = node.input[0], node.input[1]
        c, _, kh, kw = known[w]
        p = f"{node.output[0]}/nchwc"  # value names are unique; node names need not be
        if w not in reordered:  # OIHW -> OIHWBo: [C/B, B, 1, KH, KW] -> [C/B, 1, KH, KW, B]
            split = numpy_helper.from_array(np.array([c // block, block, 1, kh, kw], np.int64),
                                            f"{p}/split")
            flat = numpy_helper.from_array(np.array([c, 1, kh, kw], np.int64), f"{p}/flat")
            out.graph.initializer.extend([split, flat])
            new_nodes += [
                helper.make_node("Reshape", [w, split.name], [f"{p}/w5"], name=f"{p}/w5"),
                helper.make_node("Transpose", [f"{p}/w5"], [f"{p}/wt"], name=f"{p}/wt",
                                 perm=[0, 2, 3, 4, 1]),
                helper.make_node("Reshape", [f"{p}/wt", flat.name], [f"{p}/w"], name=f"{p}/w")]
            reordered[w] = f"{p}/w"
        conv = helper.make_node("Conv", [f"{p}/x", reordered[w], *node.input[2:]],
                                [f"{p}/y"], name=f"{p}/conv", domain=DOMAIN)
        conv.attribute.extend(node.attribute)
        new_nodes += [
            helper.make_node("ReorderInput", [x], [f"{p}/x"], name=f"{p}/x", domain=DOMAIN),
            conv,
            helper.make_node("ReorderOutput", [f"{p}/y"], [node.output[0]], name=f"{p}/out",
                             domain=DOMAIN, channels=c)]
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    logger.debug("%d depthwise Conv(s) on the NCHWc kernels", len(targets))
    return out
