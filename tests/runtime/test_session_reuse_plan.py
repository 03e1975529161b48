"""Sessions of large graphs are planned without onnxruntime's memory-reuse plan, whose planner
is quadratic in the graph's values (sessions.py, ``REUSE_PLAN_MAX_NODES``); smaller graphs
keep it. The results are the same bits either way."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ngdist.runtime.sessions import REUSE_PLAN_MAX_NODES, make_session, node_count, \
    plans_reuse


def _chain(nodes: int) -> onnx.ModelProto:
    """``nodes`` nodes: x -> (Mul by a, Add b, Tanh) repeated, each step's constants its own
    (values of several sizes, so the planner has buffers to reuse)."""
    rng = np.random.default_rng(0)
    body, inits, value = [], [], "x"
    for k in range(nodes // 3):
        a, b = f"a{k}", f"b{k}"
        inits += [numpy_helper.from_array(rng.uniform(0.5, 1.5, [16]).astype(np.float32), a),
                  numpy_helper.from_array(rng.standard_normal([16]).astype(np.float32), b)]
        body += [helper.make_node("Mul", [value, a], [f"m{k}"]),
                 helper.make_node("Add", [f"m{k}", b], [f"s{k}"]),
                 helper.make_node("Tanh", [f"s{k}"], [f"t{k}"])]
        value = f"t{k}"
    graph = helper.make_graph(body, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info(value, TensorProto.FLOAT, [8, 16])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_large_graphs_are_planned_without_the_reuse_plan_with_the_same_results() -> None:
    model = _chain(REUSE_PLAN_MAX_NODES + 3)
    assert node_count(model) > REUSE_PLAN_MAX_NODES
    assert node_count(model.SerializeToString()) == node_count(model)
    assert not plans_reuse(model) and not plans_reuse(model.SerializeToString())
    x = np.random.default_rng(1).standard_normal([8, 16]).astype(np.float32)
    ours = make_session(model, intra_op_threads=1)
    assert ours.get_session_options().enable_mem_reuse is False
    blob = make_session(model.SerializeToString(), intra_op_threads=1)
    assert blob.get_session_options().enable_mem_reuse is False
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    planned = ort.InferenceSession(model.SerializeToString(), opts,
                                   providers=["CPUExecutionProvider"])
    assert planned.get_session_options().enable_mem_reuse is True
    expected = planned.run(None, {"x": x})[0]
    for sess in (ours, blob):
        got = sess.run(None, {"x": x})[0]
        assert got.tobytes() == expected.tobytes()


def test_smaller_graphs_keep_the_reuse_plan() -> None:
    model = _chain(REUSE_PLAN_MAX_NODES - 1)
    assert plans_reuse(model)
    assert make_session(model, intra_op_threads=1).get_session_options().enable_mem_reuse
    assert make_session(model, optimize=False).get_session_options().enable_mem_reuse
