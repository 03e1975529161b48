"""ngdist.ir.shapes: outputs that ONNX's shape inference leaves untyped get their input's
type and shape, and inference continues past them; a shape computed from static sizes gives
the rank of what it shapes."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ngdist.ir.shapes import fill_same_shape_outputs, infer


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


def test_a_shape_computed_from_static_sizes_gives_the_expanded_rank() -> None:
    """torch's ``repeat``: Expand(x, ConstantOfShape(Shape(repeats))), then Tile."""
    nodes = [helper.make_node("Shape", ["r"], ["n"]),
             helper.make_node("ConstantOfShape", ["n"], ["ones"],
                              value=helper.make_tensor("one", TensorProto.INT64, [1], [1])),
             helper.make_node("Expand", ["x", "ones"], ["e"]),
             helper.make_node("Tile", ["e", "r"], ["t"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
                     helper.make_tensor_value_info("r", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert "t" not in _shapes(onnx.shape_inference.infer_shapes(model))
    assert len(_shapes(infer(model))["t"]) == 3
