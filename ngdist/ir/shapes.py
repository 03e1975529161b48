"""Types and shapes that ONNX's shape inference leaves out.

``onnx.shape_inference`` infers some function ops through their function bodies, which fail
for some element types and attributes (GroupNormalization-21 with a stash type,
MeanVarianceNormalization in float64): their outputs get no type and no shape, and neither
does anything after them. The outputs of the ops below have the type and shape of their first
input by definition, so they are filled in from it and inference runs again.

Inference propagates data (``infer``): a shape computed in the graph from static sizes gives
the rank of what it shapes. torch's ``repeat`` exports as ``Expand(x,
ConstantOfShape(Shape(repeats)))`` followed by a Tile: without the value of that Shape, the
Expand's output has no rank, nor has anything after it, and gradient rules that need a rank
(MatMul's) fail on it. Where the forward's shapes were folded to constants this did not show;
a graph that runs at its example batch only keeps them computed.

A sequence type has one element shape, so inference gives pieces of different sizes one size
symbol; onnxruntime's planner would take them for one size, so those symbols are cleared.
"""
from __future__ import annotations

import logging

import onnx

logger = logging.getLogger(__name__)

# output 0 has input 0's element type and shape
SAME_AS_INPUT = frozenset({
    "GroupNormalization", "InstanceNormalization", "RMSNormalization", "LayerNormalization",
    "MeanVarianceNormalization", "LpNormalization", "LRN", "Gelu", "Mish", "Swish", "Celu",
    "HardSwish", "HardSigmoid", "Softsign", "Softplus", "Elu", "Selu", "ThresholdedRelu",
    "Shrink"})


def _typed(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    values = [*graph.input, *graph.value_info, *graph.output]
    known = {v.name: v for v in values
             if v.type.tensor_type.elem_type and v.type.tensor_type.HasField("shape")}
    for t in graph.initializer:
        if t.name not in known:
            known[t.name] = onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)
    return known


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ONNX's shape inference, data propagated; without propagation (logged)
    where propagating fails; the size symbols of sequence elements cleared
    (``unshare_sequence_sizes``)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 (onnx raises several kinds)
        logger.debug("shape inference with data propagation failed (%s); without it", exc)
        inferred = onnx.shape_inference.infer_shapes(model)
    return unshare_sequence_sizes(inferred)


def unshare_sequence_sizes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (in place) without the size symbols ONNX's inference gives a sequence's
    elements, wherever they appear: a sequence type has one element shape, so pieces of
    different sizes (SplitToSequence by sizes computed in the graph, torch.split by counts
    of the data) share one symbol, which onnxruntime's memory planner takes for one size (a
    buffer of 11 rows reused for 20 fails the step). Symbols the graph's inputs name stay."""
    g = model.graph
    named = {d.dim_param for v in g.input for d in v.type.tensor_type.shape.dim}
    shared = {d.dim_param for v in g.value_info if v.type.HasField("sequence_type")
              for d in v.type.sequence_type.elem_type.tensor_type.shape.dim} - named - {""}
    for v in (*g.value_info, *g.output) if shared else ():
        typ = v.type.sequence_type.elem_type if v.type.HasField("sequence_type") else v.type
        for d in typ.tensor_type.shape.dim:
            if d.dim_param in shared:
                d.Clear()
    return model


def fill_same_shape_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the missing types and shapes of SAME_AS_INPUT outputs filled in from
    their inputs, and shape inference run again after each round that filled one."""
    for _ in range(len(model.graph.node)):
        known = _typed(model.graph)
        filled = 0
        for node in model.graph.node:
            if node.domain not in ("", "ai.onnx") or node.op_type not in SAME_AS_INPUT or \
                    not node.input or not node.output or node.output[0] in known or \
                    node.input[0] not in known:
                continue
            outputs = [o for o in model.graph.output if o.name == node.output[0]]
            info = outputs[0] if outputs else model.graph.value_info.add()
            info.CopyFrom(known[node.input[0]])
            info.name = node.output[0]
            known[info.name] = info
            filled += 1
        if not filled:
            break
        model = infer(model)
    return model
