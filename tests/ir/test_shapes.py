"""ngdist.ir.shapes: outputs that ONNX's shape inference leaves untyped get their input's
type and shape, and inference continues past them."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ngdist.ir.shapes import fill_same_shape_outputs


def _model() -> onnx.ModelProto:
    nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["gn"], num_groups=2,
                              stash_type=TensorProto.DOUBLE),
             helper.make_node("ReduceMean", ["gn"], ["m"], keepdims=0),
             helper.make_node("GroupNormalization", ["gn", "s", "b"], ["gn2"], num_groups=2,
                              stash_type=TensorProto.DOUBLE)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 4, 3]),
                     helper.make_tensor_value_info("s", TensorProto.DOUBLE, [4]),
                     helper.make_tensor_value_info("b", TensorProto.DOUBLE, [4])],
        [helper.make_tensor_value_info("m", TensorProto.DOUBLE, None),
         helper.make_tensor_value_info("gn2", TensorProto.DOUBLE, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*model.graph.value_info, *model.graph.output]
            if v.type.tensor_type.shape.dim}


def test_group_normalization_outputs_get_the_input_shape_and_inference_goes_on() -> None:
    inferred = onnx.shape_inference.infer_shapes(_model())
    assert "gn" not in _shapes(inferred)  # what ONNX alone leaves out
    filled = _shapes(fill_same_shape_outputs(inferred))
    assert filled["gn"] == ["n", 4, 3]
    assert filled["gn2"] == ["n", 4, 3]
