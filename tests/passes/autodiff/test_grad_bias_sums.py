"""Gradients that sum a broadcast operand over many leading positions (a bias or a
LayerNorm's scale over a batch of sequences), float32 against the float64 sum: onnxruntime
adds the positions one after another into each output where the innermost axis is kept, so
the backward sums one axis at a time."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from grad_harness import Runner, grad_model, graph_case, mk

from ngdist.passes.autodiff.registry import GradContext

B, T, C = 8, 256, 64


def _float32_grads(built, weights) -> dict[str, np.ndarray]:
    model = grad_model(built, np.float32, weights)
    names = [o.name for o in model.graph.output]
    feeds = {k: v.astype(np.float32) for k, v in built.inputs.items()}
    return dict(zip(names, Runner(model, ort_only=True)(feeds)))


@pytest.mark.parametrize("op", ["Add", "LayerNormalization"])
def test_a_bias_gradient_over_a_batch_of_sequences_is_as_accurate_as_torch(op) -> None:
    """The gradient of the [C] operand of an Add ([B, T, C] + [C]) and of a LayerNorm's bias
    and scale: the float32 sums over B x T = 2048 rows within 2e-7 of the sum of magnitudes
    (one ReduceSum over both axes: 9e-7; torch's float32 sums ~6e-8)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, C)) + 0.3
    if op == "Add":
        built = graph_case("bias-add", [mk("Add", ["x", "b"], ["y"])],
                           {"x": x, "b": rng.standard_normal(C)})
        params = {"b": None}
    else:
        built = graph_case("bias-ln", [mk("LayerNormalization", ["x", "s", "b"], ["y"])],
                           {"x": x, "s": rng.standard_normal(C), "b": rng.standard_normal(C)})
        params = {"s": None, "b": None}
    w = rng.standard_normal((B, T, C)) + 0.5
    got = _float32_grads(built, {"w0": w})
    exact = torch.from_numpy(built.inputs["x"]).requires_grad_()
    leaves = {k: torch.from_numpy(built.inputs[k]).requires_grad_() for k in params}
    # the sum of the magnitudes of the terms each gradient entry adds up
    magnitude = {"b": np.abs(w).sum((0, 1))}
    if op == "Add":
        out = exact + leaves["b"]
    else:
        out = torch.nn.functional.layer_norm(exact, (C,), leaves["s"], leaves["b"])
        xhat = torch.nn.functional.layer_norm(exact.detach(), (C,)).numpy()
        magnitude["s"] = np.abs(w * xhat).sum((0, 1))
    (out * torch.from_numpy(w)).sum().backward()
    for k, leaf in leaves.items():
        error = np.abs(got[f"{k}.grad"] - leaf.grad.numpy()) / magnitude[k]
        assert error.max() < 2e-7, (k, error.max())


def test_the_sum_runs_one_axis_at_a_time_where_the_innermost_axis_is_kept() -> None:
    """[B, T, C] over (0, 1): two ReduceSums, T first; over (0, 2, 3) of NCHW, whose
    innermost axis is reduced (onnxruntime's vectorised sums), one."""
    import onnx_ir as ir

    graph = ir.Graph([], [], nodes=[], name="g")
    anchor = ir.Node("", "Identity", [], num_outputs=1)
    graph.append(anchor)
    ctx = GradContext(graph, anchor, 18)
    ctx.sum_over(ir.Value(name="v"), [0, 1], 3)
    sums = [n for n in graph if n.op_type == "ReduceSum"]
    axes = [ctx.constant_value(n.inputs[1]).tolist() for n in sums]
    assert axes == [[1], [0]]
    ctx.sum_over(ir.Value(name="w"), [0, 2, 3], 4)
    sums = [n for n in graph if n.op_type == "ReduceSum"]
    assert [ctx.constant_value(n.inputs[1]).tolist() for n in sums][2:] == [[0, 2, 3]]


@pytest.mark.parametrize("op", ["Add", "Mul"])
@pytest.mark.parametrize("shape", [[1], []])
def test_a_scalar_operand_gradient_over_a_whole_tensor_is_as_accurate_as_torch(op, shape
                                                                               ) -> None:
    """The gradient of a scalar or [1]-shaped operand of Add / Mul over an [8, 16, 64, 64]
    activation (a learnable affine scale or bias): a sum over all 524288 positions of
    terms that cancel, within 2e-9 of the sum of their magnitudes of the float64 sum (one
    ReduceSum over every axis: 5e-9 to 1e-8; torch's float32 sum ~3e-11)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16, 64, 64)) + 0.1
    p = rng.standard_normal(shape) + 1.0
    built = graph_case(f"scalar-{op}-{len(shape)}", [mk(op, ["x", "p"], ["y"])],
                       {"x": x, "p": p})
    w = rng.standard_normal(x.shape)
    got = _float32_grads(built, {"w0": w})["p.grad"]
    x64, p64 = torch.from_numpy(built.inputs["x"]), torch.from_numpy(built.inputs["p"])
    p64.requires_grad_()
    out = x64 + p64 if op == "Add" else x64 * p64
    (out * torch.from_numpy(w)).sum().backward()
    terms = np.abs(w) if op == "Add" else np.abs(w * built.inputs["x"])
    error = float(np.abs(got - p64.grad.numpy()).max()) / float(terms.sum())
    assert got.shape == tuple(shape)
    assert error < 2e-9, error
