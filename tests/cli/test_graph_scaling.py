"""The large-graph path grows linearly with the graph: ``ngdist.compile`` of a forward chain
of Add nodes (rewrite, autodiff, the runtime's plan; no onnxruntime session yet) makes a number
of Python calls proportional to the chain's length. Counted with cProfile, not timed, so the
bound holds on a loaded machine: 4x the nodes may cost at most 4.6x the calls (a quadratic
part would cost 16x)."""
from __future__ import annotations

import cProfile
import pstats

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import ngdist


def add_chain(n: int) -> onnx.ModelProto:
    """x (N, 4) -> MatMul W -> n x Add b -> out: every Add reads the one parameter b."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.zeros(4, np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h0"])]
    nodes += [helper.make_node("Add", [f"h{i}", "b"], [f"h{i + 1}"]) for i in range(n)]
    graph = helper.make_graph(nodes, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info(f"h{n}", TensorProto.FLOAT,
                                                             ["N", 4])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def calls_to_compile(n: int) -> int:
    model = add_chain(n)
    profile = cProfile.Profile()
    profile.enable()
    trainer = ngdist.compile(model, loss="mse", optimizer=ngdist.optim.SGD(lr=0.01))
    profile.disable()
    trainer.close()
    return pstats.Stats(profile).total_calls


def test_compile_makes_calls_in_proportion_to_the_chain():
    calls_to_compile(50)  # imports and one-time set-up out of the way
    small, large = calls_to_compile(500), calls_to_compile(2000)
    assert large / small <= 4.6, (small, large)
