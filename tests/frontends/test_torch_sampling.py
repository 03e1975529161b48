"""Training-mode sampling and custom backwards through the torch frontend: ``exponential_``
(PhiMoE's Gumbel sampling of experts) exports as ``-log(1 - U) / lambd`` of onnxruntime's
uniform draws, checked against the exponential distribution itself; a module that applies a
``torch.autograd.Function`` whose backward is not its forward's derivative is refused (the
export keeps only the forward: frontends/torch_custom_grad.py)."""
from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest
import torch

from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_symbolics import lent_symbolics


class Exponential(torch.nn.Module):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate

    def forward(self, x):
        return torch.empty_like(x).exponential_(self.rate)


@pytest.mark.parametrize("rate", [1.0, 2.5])
def test_exponential_draws_follow_the_exponential_distribution(rate):
    buf = io.BytesIO()
    with lent_symbolics(18):
        torch.onnx.export(Exponential(rate), (torch.zeros(4),), buf, dynamo=False,
                          opset_version=18, input_names=["x"], output_names=["e"],
                          dynamic_axes={"x": {0: "n"}})
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    n = 200_000
    draws = np.sort(sess.run(None, {"x": np.zeros(n, np.float32)})[0].astype(np.float64))
    assert draws.dtype == np.float64 and np.isfinite(draws).all() and draws.min() >= 0
    # Kolmogorov-Smirnov distance to the CDF 1 - exp(-rate x): 0.0036 is its 1% level at n
    cdf = 1.0 - np.exp(-rate * draws)
    ks = max(np.abs(cdf - np.arange(1, n + 1) / n).max(), np.abs(cdf - np.arange(n) / n).max())
    assert ks < 1.63 / np.sqrt(n), ks
    assert abs(draws.mean() * rate - 1.0) < 0.01


class Uniform(torch.nn.Module):
    def forward(self, x):
        return torch.empty_like(x).uniform_(-0.5, 2.0)


def test_uniform_draws_cover_their_interval_evenly():
    buf = io.BytesIO()
    with lent_symbolics(18):
        torch.onnx.export(Uniform(), (torch.zeros(4),), buf, dynamo=False, opset_version=18,
                          input_names=["x"], output_names=["u"], dynamic_axes={"x": {0: "n"}})
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    n = 200_000
    draws = np.sort(sess.run(None, {"x": np.zeros(n, np.float32)})[0].astype(np.float64))
    assert draws.min() >= -0.5 and draws.max() < 2.0
    cdf = (draws + 0.5) / 2.5
    ks = max(np.abs(cdf - np.arange(1, n + 1) / n).max(), np.abs(cdf - np.arange(n) / n).max())
    assert ks < 1.63 / np.sqrt(n), ks


class Straight(torch.autograd.Function):
    """x * 2 forward, the gradient passed straight through (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad


class UsesStraight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return Straight.apply(self.lin(x))


def test_a_custom_backward_that_is_not_the_forwards_derivative_is_refused():
    with pytest.raises(GraphError, match="^UsesStraight applies custom autograd Functions "
                       "whose backward differs from autograd through their forward: "
                       "test_torch_sampling.Straight \\(the gradients of lin.weight and 1 "
                       "more differ\\)"):
        tfront.training_model(UsesStraight(), (torch.randn(4, 3),), loss=torch.nn.MSELoss(),
                              optimizer="sgd:lr=0.1")
    assert "apply" in torch.autograd.Function.__dict__
    assert Straight.apply(torch.ones(1)).item() == 2.0  # torch's apply is back
