"""ngdist/frontends/renames.py: a value renamed by ``rename_graph`` is renamed where it is
produced, declared or read -- a node's inputs and outputs, what an If branch reads of the
outer graph, initializers, graph inputs, outputs and value_info -- so the renamed model
passes onnx.checker and computes what the original did (the ONNX reference evaluator)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ngdist.frontends.renames import rename_graph


def _model() -> onnx.ModelProto:
    """y = If(c, then: mid * w, else: mid + x), mid = x + w; w an initializer."""
    vec = [3]

    def branch(name: str, op: str, other: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["mid", other], [f"{name}_out"])], name,
                                 [], [helper.make_tensor_value_info(f"{name}_out",
                                                                    TensorProto.FLOAT, vec)])

    nodes = [helper.make_node("Add", ["x", "w"], ["mid"], name="add"),
             helper.make_node("If", ["c"], ["y"], name="if",
                              then_branch=branch("then", "Mul", "w"),
                              else_branch=branch("else", "Add", "x"))]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, vec),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, vec)],
        [numpy_helper.from_array(np.array([0.5, -2.0, 3.0], np.float32), "w")],
        value_info=[helper.make_tensor_value_info("mid", TensorProto.FLOAT, vec)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_every_place_a_value_is_named_is_renamed_and_the_model_computes_the_same():
    model = _model()
    x = np.array([1.0, 2.0, -4.0], np.float32)
    before = {c: ReferenceEvaluator(model).run(None, {"x": x, "c": np.array(c)})[0]
              for c in (True, False)}
    rename_graph(model.graph, {"x": "input", "w": "weight", "mid": "hidden", "y": "output",
                               "absent": "never"})
    onnx.checker.check_model(model, full_check=True)
    g = model.graph
    assert [i.name for i in g.input] == ["input", "c"]
    assert [o.name for o in g.output] == ["output"]
    assert [t.name for t in g.initializer] == ["weight"]
    assert [v.name for v in g.value_info] == ["hidden"]
    assert list(g.node[0].input) == ["input", "weight"] and list(g.node[0].output) == ["hidden"]
    branches = {a.name: list(a.g.node[0].input) for a in g.node[1].attribute}
    assert branches == {"then_branch": ["hidden", "weight"], "else_branch": ["hidden", "input"]}
    names = {n for node in g.node for n in [*node.input, *node.output]}
    assert not names & {"x", "w", "mid", "y", "never"}
    for c, want in before.items():
        got = ReferenceEvaluator(model).run(None, {"input": x, "c": np.array(c)})[0]
        assert np.array_equal(got, want)


def test_an_empty_map_leaves_the_graph_as_it_was():
    model = _model()
    data = model.SerializeToString()
    rename_graph(model.graph, {})
    assert model.SerializeToString() == data
