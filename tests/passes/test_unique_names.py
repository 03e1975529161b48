"""Every node and value the passes make has a name no other node or value of the step graph
has: onnxruntime rejects a graph with two nodes of the same name. A gradient of a parameter the
loss ignores (a zero gradient, made in a context of its own) used to repeat the backward seed's
name ``grad/grad/Shape_1``; a forward graph that already holds names of the backward pattern
must not collide either. Each step graph also passes ``onnx.checker`` with ``full_check``."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import ngdist
from step_probe import check_step_graph, gradient_errors, run_step, torch_step

nn = torch.nn


class EncoderWithAuxHead(nn.Module):
    """A TransformerEncoderLayer classifier with a second (auxiliary) output: the loss reads the
    first output only, so the auxiliary head's gradients are zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head, self.aux = nn.Linear(16, 3), nn.Linear(16, 2)

    def forward(self, x):
        z = self.layer(x).mean(1)
        return self.head(z), self.aux(z)


def _export_as_users_do(module: nn.Module, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 5, 16),), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, opset_version=17,
                          input_names=["x"], output_names=["out", "aux"],
                          dynamic_axes={"x": {0: "N"}})


def test_user_exported_transformer_encoder_layer_steps_and_matches_torch(tmp_path):
    module = EncoderWithAuxHead()
    path = tmp_path / "encoder.onnx"
    _export_as_users_do(module, path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 16)).astype(np.float32)
    y = np.array([0, 1, 2, 0], np.int64)
    trainer = ngdist.compile(str(path), loss="softmax_cross_entropy", strategy="allreduce",
                             optimizer=ngdist.optim.SGD(lr=0.1))
    check_step_graph(trainer.step_model)
    stats = trainer.step({"x": x, "y": y})  # onnxruntime loads every segment
    assert np.isfinite(stats.loss)
    # the gradients of that step graph: torch autograd in float64 is the oracle
    model = ngdist.to_training_model(onnx.load(str(path)), loss="softmax_cross_entropy",
                                     optimizer="sgd:lr=0.01")
    got = run_step(model, {"x": x, "y": y})

    class First(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)[0]

    loss, grads, _ = torch_step(First(module), x, y, nn.CrossEntropyLoss(), float64=True)
    assert abs(float(got["loss"]) - loss) <= 1e-5 * abs(loss)
    onnx_names = {"inner." + k: k for k in module.state_dict()}
    named = {onnx_names[k]: v for k, v in grads.items() if onnx_names[k] in
             {t.name for t in model.graph.initializer}}
    assert {"head.weight", "layer.norm2.weight"} <= set(named)
    errors = gradient_errors(got, named)
    assert max(errors.values()) <= 1e-4, errors
    for name in ("aux.weight", "aux.bias"):
        assert not np.any(got[f"{name}.grad"]), name


def test_names_already_in_the_forward_graph_are_not_reused():
    """A forward graph whose nodes and values carry the names the backward pass would make
    first (``grad/grad/Shape_1``, ``relu/grad/...``) still gets a step graph with unique names."""
    w = numpy_helper.from_array(np.full((3, 3), 0.5, np.float32), "w")
    unused = numpy_helper.from_array(np.ones(2, np.float32), "unused")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["grad/grad/Shape_1:0"],
                              name="grad/grad/Shape_1"),
             helper.make_node("Relu", ["grad/grad/Shape_1:0"], ["relu/grad/Mul_2:0"],
                              name="relu"),
             helper.make_node("Identity", ["relu/grad/Mul_2:0"], ["out"], name="relu/grad/Mul_3")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3])], [w, unused])
    forward = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    trainer = ngdist.compile(forward, loss="softmax_cross_entropy", strategy="allreduce",
                             optimizer=ngdist.optim.SGD(lr=0.1))
    check_step_graph(trainer.step_model)
    stats = trainer.step({"x": np.eye(3, dtype=np.float32), "y": np.array([0, 1, 2])})
    assert np.isfinite(stats.loss)
    weights = trainer.state_dict()
    assert np.array_equal(weights["unused"], np.ones(2, np.float32))  # zero gradient
    assert not np.array_equal(weights["w"], np.full((3, 3), 0.5, np.float32))
