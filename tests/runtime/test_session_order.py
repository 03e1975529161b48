"""Large session graphs go to onnxruntime with their shape computations right after what they
read (runtime/rewrites.py, ``shapes_first``): the session computes what the ONNX reference
evaluator computes of the graph as given, the caller's model keeps its order, and graphs with a
random op, or small ones, are given as they are."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ngdist.runtime import rewrites
from ngdist.runtime.sessions import make_session

LAYERS = 6


def _model(dropout: bool = False) -> onnx.ModelProto:
    """Relu layers, then x.view(batch, 2, -1) -> Relu -> view back, whose targets are computed
    from Shape(x) after the layers that do not read them (as exporters and gradient rules
    place them), and a ConstantOfShape of the batch size."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"])]
    h = "x"
    for k in range(LAYERS):
        nodes.append(helper.make_node("Relu", [h], [f"r{k}"]))
        h = f"r{k}"
    nodes += [helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
              helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"]),
              helper.make_node("Concat", ["batch1", "two", "minus"], ["split"], axis=0),
              helper.make_node("Concat", ["batch1", "minus"], ["flat"], axis=0),
              helper.make_node("ConstantOfShape", ["batch1"], ["ones"],
                               value=numpy_helper.from_array(np.ones(1, np.float32))),
              helper.make_node("Reshape", [h, "split"], ["v"]),
              helper.make_node("Neg", ["v"], ["n"]),
              helper.make_node("Reshape", ["n", "flat"], ["back"])]
    h = "back"
    if dropout:
        nodes.append(helper.make_node("Dropout", [h], ["dropped"]))
        h = "dropped"
    nodes += [helper.make_node("ReduceSum", [h, "one"], ["rows"], keepdims=0),
              helper.make_node("Add", ["rows", "ones"], ["y"])]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("zero", 0), ("axes", [0]), ("two", [2]), ("minus", [-1]), ("one", [1]))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(rewrites, "SHAPES_FIRST_MIN_NODES", 4)


def test_shape_computations_follow_what_they_read(small_threshold, monkeypatch):
    model = _model()
    g = model.graph
    order = rewrites.shapes_first(g)
    assert order is not None and sorted(order) == list(range(len(g.node)))
    names = [g.node[k].output[0] for k in order]
    assert names[:5] == ["shape", "batch", "batch1", "split", "flat"]  # right after Shape
    assert names.index("ones") > names.index(f"r{LAYERS - 1}")  # ConstantOfShape stays
    made = {"x", *(t.name for t in g.initializer)}
    for k in order:  # still topological
        assert all(i in made for i in g.node[k].input)
        made.update(g.node[k].output)
    before = model.SerializeToString()
    sess = make_session(model, optimize=False)
    assert model.SerializeToString() == before  # the caller's model keeps its order
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = [sess.run(None, {"x": x})[0], make_session(model).run(None, {"x": x})[0]]
    monkeypatch.setattr(rewrites, "SHAPES_FIRST_MIN_NODES", 4000)
    assert rewrites.shapes_first(g) is None
    as_given = [make_session(model, optimize=False).run(None, {"x": x})[0],
                make_session(model).run(None, {"x": x})[0]]
    for mine, theirs in zip(got, as_given):
        np.testing.assert_allclose(mine, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(mine, theirs)  # the same bits as the graph as given


def test_graphs_with_random_ops_or_few_nodes_keep_their_order(small_threshold, monkeypatch):
    assert rewrites.shapes_first(_model(dropout=True).graph) is None
    monkeypatch.setattr(rewrites, "SHAPES_FIRST_MIN_NODES", 4000)
    assert rewrites.shapes_first(_model().graph) is None
    model = _model()
    assert rewrites.session_bytes(model) == model.SerializeToString()
