"""Sigmoid in a training graph, and the activations whose gradients use it (Softplus, Swish,
Mish, SiLU as exported): float32 values and gradients element by element against float64
over the whole float32 range, the graph's form, and a gate far in the saturated range
through ``ngdist.compile``'s frontend against torch float64."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from grad_harness import Runner, case, graph_case, grad_model, mk
from step_probe import gradient_errors, run_step

from ngdist.frontends import torch as tfront

TINY = float(np.finfo(np.float32).tiny)
ULP = float(np.finfo(np.float32).eps) / 2  # float32's unit roundoff, 2^-24


def _sigmoid64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x < 0, e / (1 + e), 1 / (1 + e))


def _range() -> np.ndarray:
    """Every scale of float32, both signs: a dense grid, logarithmic tails, the overflow
    edges of exp and the largest finite values."""
    grid = np.linspace(-110.0, 110.0, 220_001)
    tails = np.logspace(-30, np.log10(3.4e38), 4000)
    edges = np.array([0.0, 16.6, 16.7, 87.3, 88.7, 88.8, 103.9, 104.0, 1e30])
    return np.unique(np.concatenate([grid, tails, -tails, edges, -edges])).astype(np.float32)


def _run(built, x: np.ndarray, extra: str | None = None) -> list[np.ndarray]:
    """The lowered float32 model on ``x`` (weights 1): [loss, in0.grad(, extra)]."""
    weights = {"w0": np.ones_like(x, np.float64)}
    model = grad_model(built, np.float32, weights)
    if extra is not None:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(extra))
    return Runner(model, ort_only=True)({"in0": x})


def _relative_error(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| / |want| where want is a normal float32, else 0."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    normal = np.abs(want) >= TINY
    return np.where(normal, np.abs(got - want) / np.where(normal, np.abs(want), 1.0), 0.0)


def test_sigmoid_value_and_gradient_are_relatively_accurate_over_the_float32_range() -> None:
    """The float32 training graph's Sigmoid is 1/(1+exp(-x)) to 3 units of roundoff where the
    logistic is a normal float32, never NaN or inf, and 0 below the subnormals (onnxruntime's
    own Sigmoid is accurate to ~1.6e-7 absolute only: 7e7 ulps off at x = -17.5). Its gradient,
    y (1 - y) from that y, is as accurate wherever 1 - y does not cancel (x <= 0), and above
    that within torch's own float32 error plus that of y."""
    x = _range()
    built = case("Sigmoid-range", "Sigmoid", lambda g: [x.astype(np.float64)])
    _, grad, y = _run(built, x, extra="out0")
    assert np.isfinite(y).all() and np.isfinite(grad).all()
    want = _sigmoid64(x)
    assert _relative_error(y, want).max() < 3 * ULP
    assert np.all(y[want < TINY] <= TINY) and np.all((y >= 0) & (y <= 1))
    slope = want * _sigmoid64(-x)
    below = x <= 0
    assert _relative_error(grad[below], slope[below]).max() < 6 * ULP
    # above 0, 1 - y cancels: the error of y (a few units of roundoff of y) is the
    # gradient's, as in torch's float32 gradient (the same form)
    t = torch.from_numpy(x[~below]).requires_grad_()
    torch.sigmoid(t).sum().backward()
    torch_error = np.abs(t.grad.numpy().astype(np.float64) - slope[~below])
    assert np.all(np.abs(grad[~below] - slope[~below]) <= torch_error + 4 * ULP * want[~below])


SILU = graph_case("SiLU", [mk("Sigmoid", ["in0"], ["s"]), mk("Mul", ["in0", "s"], ["out0"])],
                  {"in0": np.zeros(1)})


def _silu_slope(x: np.ndarray) -> np.ndarray:
    s = _sigmoid64(x)
    return s * (1 + x * _sigmoid64(-x))


def _mish_slope(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.asarray(x, np.float64)).requires_grad_()
    torch.nn.functional.mish(t).sum().backward()
    return t.grad.numpy()


@pytest.mark.parametrize("name, make, slope, bound", [
    ("Softplus", lambda x: case("Softplus-far", "Softplus", lambda g: [x]), _sigmoid64, 3),
    ("Swish", lambda x: case("Swish-far", "Swish", lambda g: [x], opset=24), _silu_slope, 6),
    ("SiLU", lambda x: graph_case("SiLU-far", SILU.nodes, {"in0": x}), _silu_slope, 6),
    ("Mish", lambda x: case("Mish-far", "Mish", lambda g: [x]), _mish_slope, 6)])
def test_gradients_that_use_a_sigmoid_are_relatively_accurate_far_below_zero(
        name, make, slope, bound) -> None:
    """Softplus', Swish's, SiLU's and Mish's gradients on [-80, -4]: their sigmoid is the
    accurate one, so a small gradient keeps float32's relative accuracy, element by element
    against float64 (with onnxruntime's Sigmoid: off by up to 5x in relative terms)."""
    x = np.linspace(-80.0, -4.0, 7601).astype(np.float32)
    _, grad = _run(make(x.astype(np.float64)), x)
    want = slope(x)
    assert np.isfinite(grad).all()
    assert _relative_error(grad, want).max() < bound * ULP, name


def test_the_training_graph_computes_each_sigmoid_once_and_its_gradient_from_the_output() -> None:
    """The forward Sigmoid becomes Neg, Exp, Add and a Reciprocal that keeps the node's name and
    output; the backward reads that output (y (1 - y)) and computes no exponential of its own."""
    x = np.linspace(-3.0, 3.0, 12).reshape(3, 4)
    built = case("Sigmoid-form", "Sigmoid", lambda g: [x])
    lowered = grad_model(built, np.float32, {"w0": np.ones_like(x)})
    ops = [n.op_type for n in lowered.graph.node]
    assert "Sigmoid" not in ops and ops.count("Exp") == 1 and ops.count("Reciprocal") == 1
    forward = next(n for n in lowered.graph.node if n.name == "node0")
    assert forward.op_type == "Reciprocal" and list(forward.output) == ["out0"]
    readers = [n for n in lowered.graph.node if "out0" in n.input and "/grad/" in n.name]
    assert readers and {n.op_type for n in readers} <= {"Sub", "Mul"}


class Gate(torch.nn.Module):
    """A forget gate as in Hugging Face's bailing_hybrid (KDA's safe gate): a log-decay
    ``lower_bound * sigmoid(exp(A_log) * (x W + dt_bias))`` whose argument sits far below 0,
    summed over time and exponentiated."""

    def __init__(self) -> None:
        super().__init__()
        self.f_proj = torch.nn.Linear(8, 16, bias=False)
        self.dt_bias = torch.nn.Parameter(torch.linspace(-12.0, -8.0, 16))
        self.A_log = torch.nn.Parameter(torch.full((1,), 0.7))
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        gate = -5.0 * torch.sigmoid(self.A_log.exp() * (self.f_proj(x) + self.dt_bias))
        return self.out(torch.exp(gate.cumsum(1) * 1e4) * x.sum(-1, keepdim=True)).mean(1)


def test_a_saturated_gate_trains_like_torch_float64() -> None:
    """Every gradient of the gate model within 1e-5 of torch float64 (relative to each
    tensor's largest); dt_bias' was 1.6e-4 off with onnxruntime's Sigmoid."""
    torch.manual_seed(0)
    module = Gate()
    x, labels = torch.randn(4, 5, 8), torch.randint(0, 3, (4,))
    model, _ = tfront.training_model(module, (x,), loss=torch.nn.CrossEntropyLoss(),
                                     optimizer="sgd:lr=0.1")
    got = run_step(model, {"x": x.numpy(), "y": labels.numpy()})
    ref = Gate().double()
    ref.load_state_dict(module.state_dict())
    loss = torch.nn.functional.cross_entropy(ref(x.double()), labels)
    loss.backward()
    assert abs(float(got["loss"]) - float(loss)) < 1e-5
    errors = gradient_errors(got, {n: p.grad.numpy() for n, p in ref.named_parameters()})
    assert max(errors.values()) < 1e-5, errors
