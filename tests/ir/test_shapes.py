"""ngdist.ir.shapes: outputs that ONNX's shape inference leaves untyped get their input's
type and shape, and inference continues past them; a shape computed from static sizes gives
the rank of what it shapes; pieces of a sequence share no size symbol."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ngdist.ir.shapes import fill_same_shape_outputs, infer
from ngdist.runtime.sessions import make_session


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


def _split_pieces() -> onnx.ModelProto:
    """x split into two pieces by sizes fed at run time; each piece through Exp twice, summed."""
    nodes = [helper.make_node("SplitToSequence", ["x", "sizes"], ["s"], axis=0),
             *(helper.make_node("SequenceAt", ["s", f"i{k}"], [f"p{k}"]) for k in (0, 1)),
             *(n for k in (0, 1) for n in (
                 helper.make_node("Exp", [f"p{k}"], [f"e{k}"]),
                 helper.make_node("Exp", [f"e{k}"], [f"f{k}"]),
                 helper.make_node("ReduceSum", [f"f{k}"], [f"r{k}"], keepdims=0))),
             helper.make_node("Add", ["r0", "r1"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 4]),
                     helper.make_tensor_value_info("sizes", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("out", TensorProto.DOUBLE, [])],
        initializer=[helper.make_tensor(f"i{k}", TensorProto.INT64, [], [k]) for k in (0, 1)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_pieces_of_a_sequence_share_no_size_symbol() -> None:
    """ONNX's inference gives a sequence one element shape, so pieces of 2 and 5 rows shared
    one symbol, which onnxruntime's planner takes for one size; the graph's input symbol
    stays. (onnxruntime reuses the buffer of 2 rows for 5 here with a warning; in JetMoE's
    step a Gemm gradient failed on it: hf/causal/jetmoe in the model sweep.)"""
    model = infer(_split_pieces())
    shapes = _shapes(model)
    assert shapes["p0"][1:] == shapes["p1"][1:] == [4]
    params = {v.name: v.type.tensor_type.shape.dim[0].dim_param for v in model.graph.value_info
              if v.type.tensor_type.shape.dim}
    assert {params[f"{p}{k}"] for p in "pef" for k in (0, 1)} == {""}  # each size unknown
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][0] == "n"
    x = np.random.default_rng(0).standard_normal((7, 4))
    (got,) = make_session(model).run(None, {"x": x, "sizes": np.array([2, 5])})
    np.testing.assert_allclose(got, np.exp(np.exp(x)).sum(), rtol=1e-12)
