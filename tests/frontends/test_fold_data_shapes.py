"""Shape folding never freezes an extent that depends on data: the number of elements NonZero
finds (tokens routed to one expert) can be the same at every probe batch size by chance, yet it
is no property of the batch size. Shapes downstream of NonZero, or of a Reshape/Expand whose
target is computed from data, stay computed at run time; shapes that depend on the batch
size only are still folded."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ngdist.frontends.cleanup import batch_feeds, fold_static_shapes


def _model():
    """big = x[x > 5] zero-filled to its count (ConstantOfShape of the NonZero count), and a
    batch-independent shape value: the width of x."""
    consts = [numpy_helper.from_array(np.array(5.0, np.float32), "five"),
              numpy_helper.from_array(np.array([1], np.int64), "one"),
              numpy_helper.from_array(np.array([2], np.int64), "two")]
    nodes = [
        helper.make_node("Greater", ["x", "five"], ["above"]),
        helper.make_node("NonZero", ["above"], ["where"]),
        helper.make_node("Shape", ["where"], ["where_shape"]),
        helper.make_node("Slice", ["where_shape", "one", "two"], ["count"]),
        helper.make_node("ConstantOfShape", ["count"], ["zeros"]),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Slice", ["x_shape", "one", "two"], ["width"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("zeros", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("width", TensorProto.INT64, None)], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_count_found_by_nonzero_is_not_folded():
    model = _model()
    example = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    assert not np.any(example > 5)  # every probe finds nothing
    fold_static_shapes(model, batch_feeds({"x": example}))
    inits = {t.name for t in model.graph.initializer}
    assert "count" not in inits and "where_shape" not in inits
    assert "width" in inits  # a shape of the batch alone is folded
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.zeros((3, 4), np.float32)
    x[0, 1] = x[2, 0] = x[2, 3] = 9.0
    zeros, width = sess.run(None, {"x": x})
    assert zeros.shape == (3,) and width.tolist() == [4]


def test_folded_values_are_initializers_named_apart_from_the_outputs_they_replace():
    """The training export is folded further than the eval export, whose graph receives the
    training graph's initializers: a folded value under its node output's name was declared
    twice there (canary: '/model/model/decoder/Concat_2_output_0 is redeclared')."""
    import copy

    import onnx

    consts = [numpy_helper.from_array(np.array([1], np.int64), "one"),
              numpy_helper.from_array(np.array([2], np.int64), "two"),
              numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    nodes = [helper.make_node("Shape", ["x"], ["x_shape"]),
             helper.make_node("Slice", ["x_shape", "one", "two"], ["width"]),
             helper.make_node("Concat", ["minus_one", "width"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"]),
             helper.make_node("Relu", ["flat"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    other = copy.deepcopy(model)  # the export that was not folded
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    assert fold_static_shapes(model, batch_feeds({"x": x})) >= 1
    added = [t for t in model.graph.initializer if t.name not in {c.name for c in consts}]
    assert added and all(t.name.endswith("/ngdist.folded") for t in added)
    other.graph.initializer.extend(added)
    onnx.checker.check_model(other, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"x": x[:3]})[0], np.maximum(x[:3], 0))
