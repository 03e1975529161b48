"""Autodiff's output grows linearly with the model: a bounded number of backward nodes per
forward node, and one Constant per distinct constant (a chain of n activations shares its
zeros and ones instead of emitting one per node)."""
from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import ngdist
from ngdist.passes.pipeline import rewrite
from ngdist.zoo import chain


def _step(n: int) -> onnx.GraphProto:
    training = ngdist.to_training_model(chain(n), loss="softmax_cross_entropy",
                                        optimizer=ngdist.optim.SGD(lr=0.1))
    return rewrite(training).training_info[0].algorithm


def _step_ops(n: int) -> collections.Counter:
    return collections.Counter(node.op_type for node in _step(n).node)


@pytest.mark.parametrize("n", [10, 200])
def test_chain_backward_has_three_nodes_per_activation_and_shared_constants(n):
    ops = _step_ops(n)
    small = _step_ops(2)
    # Relu' = Mul(gy, CastLike(Greater(x, 0), gy)), Tanh' = Mul(gy, Sub(1, Mul(y, y)))
    pairs = (n - 2) // 2
    grown = {op: ops[op] - small[op] for op in ops if ops[op] != small[op]}
    assert grown == {"Relu": pairs, "Tanh": pairs, "Greater": pairs, "CastLike": pairs,
                     "Sub": pairs, "Mul": 3 * pairs}, grown
    assert ops["Constant"] == small["Constant"]
    step = _step(n)
    constants = {o for node in step.node if node.op_type == "Constant" for o in node.output}
    cast_constants = [node.name for node in step.node
                      if node.op_type == "CastLike" and node.input[0] in constants]
    assert cast_constants == []  # float32 is known: constants are made in it


def test_chain_gradient_matches_finite_differences():
    n = 6
    model = chain(n, features=5, classes=3)
    trainer = ngdist.compile(model, loss="mse", labels="y", optimizer=ngdist.optim.SGD(lr=1.0),
                             strategy="local")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 5)).astype(np.float32)
    y = rng.normal(size=(4, 3)).astype(np.float32)
    w0 = trainer.parameters()["w"].astype(np.float64)
    trainer.step({"x": x, "y": y})
    grad = (w0 - trainer.parameters()["w"]) / 1.0  # SGD lr=1: the step is the gradient
    def loss(w):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for i, init in enumerate(m.graph.initializer):
            if init.name == "w":
                m.graph.initializer[i].CopyFrom(numpy_helper.from_array(w.astype(np.float32), "w"))
        out = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
        return float(np.mean((out.astype(np.float64) - y) ** 2))

    eps = 1e-2
    for idx in [(0, 0), (1, 3), (2, 4)]:
        wp, wm = w0.copy(), w0.copy()
        wp[idx] += eps
        wm[idx] -= eps
        fd = (loss(wp) - loss(wm)) / (2 * eps)
        assert grad[idx] == pytest.approx(fd, rel=2e-2, abs=1e-4), idx
