"""``scatter_reduce`` and ``index_add`` through ngdist's symbolics (frontends/torch_scatter.py):
values against torch float64 in onnxruntime, gradients through ngdist's autodiff against torch
autograd in float64, for every reduction with and without ``self``, ties of amax/amin and
zeros of prod included, and ``index_add`` with repeated indices."""
from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest
import torch
from step_probe import gradient_errors, run_step

from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_symbolics import lent_symbolics

OPSET = 18
REDUCTIONS = ("sum", "prod", "amax", "amin", "mean")
INDEX = torch.tensor([[1, 0, 2, 1, 1], [1, 1, 2, 0, 1], [0, 1, 0, 1, 1], [1, 1, 0, 0, 1]])


def _ort(module: torch.nn.Module, *args: torch.Tensor) -> np.ndarray:
    buf = io.BytesIO()
    with lent_symbolics(OPSET):
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=OPSET)
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]


def _agree(module: torch.nn.Module, exact: torch.nn.Module, x: torch.Tensor,
           index: torch.Tensor) -> None:
    """Values in onnxruntime, and one step's loss and gradients through ngdist (an MSE
    against fixed targets), against the float64 copy ``exact`` in torch."""
    got = _ort(module, x, index)
    want = exact(x.double(), index)
    assert np.abs(got - want.detach().numpy()).max() < 1e-6
    y = torch.randn(*want.shape, generator=torch.Generator().manual_seed(1))
    model, exp = tfront.training_model(module, (x, index), loss=torch.nn.MSELoss(),
                                       input_names=["x", "index"], optimizer="sgd:lr=0.1")
    step = run_step(model, {"x": x.numpy(), "index": index.numpy(), "y": y.numpy()})
    loss = torch.nn.functional.mse_loss(exact(x.double(), index), y.double())
    loss.backward()
    assert abs(float(step["loss"]) - loss.item()) < 1e-6
    errors = gradient_errors(step, {n: p.grad.numpy() for n, p in exact.named_parameters()})
    assert max(errors.values()) < 1e-5, errors


class ScatterReduce(torch.nn.Module):
    """Both parameters scattered along axis 0 and along the last axis (a narrower index);
    ``src`` is ``s * x``, with x of ones: the ties and zeros set in ``s`` are exact."""

    def __init__(self, how: str, keep: bool) -> None:
        super().__init__()
        self.how, self.keep = how, keep
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 5, generator=gen))
        self.s = torch.nn.Parameter(torch.randn(4, 5, generator=gen))
        with torch.no_grad():
            self.s[2, 1] = self.s[3, 1] = self.s[1, 1]  # three updates of (1, 1) tie
            if keep:
                self.w[1, 1] = self.s[1, 1]  # and the kept self with them
            self.s[0, 0] = 0.0  # (1, 0): one zero update; (0, 2): two
            self.s[2, 2] = self.s[3, 2] = 0.0
            self.w[1, 4] = 0.0  # a zero self at a targeted position

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        src = self.s * x
        return torch.cat([
            self.w.scatter_reduce(0, index, src, self.how, include_self=self.keep),
            self.w.scatter_reduce(-1, index[:, :3], src[:, :3], self.how,
                                  include_self=self.keep)], 1)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("how", REDUCTIONS)
def test_scatter_reduce_values_and_gradients_match_torch_float64(how, keep):
    _agree(ScatterReduce(how, keep), ScatterReduce(how, keep).double(), torch.ones(4, 5), INDEX)


class Narrow(torch.nn.Module):
    def __init__(self, how: str, keep: bool) -> None:
        super().__init__()
        self.how, self.keep = how, keep

    def forward(self, x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return x.scatter_reduce(1, index, src, self.how, include_self=self.keep)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("how", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_src_is_read_over_the_index_and_integer_means_are_floored(how, keep, dtype):
    """A ``src`` larger than the index (read over the index's extent); integers: the
    identities of amax/amin are the type's extremes, a mean is floored (negative sums)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-9, 9, (3, 4), generator=gen).to(dtype)
    src = torch.randint(-9, 9, (3, 6), generator=gen).to(dtype)
    index = torch.tensor([[0, 0, 3], [2, 2, 2], [1, 3, 1]])
    got = _ort(Narrow(how, keep), x, index, src)
    assert got.dtype == x.numpy().dtype
    np.testing.assert_array_equal(got, Narrow(how, keep)(x, index, src).numpy())


class IndexAdd(torch.nn.Module):
    """A mixture of experts' merge (JetMoE's): rows added back at their token, each token's
    twice (a repeated index), along axis 0, the last axis (in place) and with ``alpha``."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha
        gen = torch.Generator().manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
        self.s = torch.nn.Parameter(torch.randn(4, 3, generator=gen))

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows = self.w.index_add(0, index, self.s * x)
        cols = self.w.t().clone()
        cols.index_add_(-1, index[:3], (self.s * x)[:3].t(), alpha=self.alpha)
        return torch.cat([rows, cols.t()], 1)


@pytest.mark.parametrize("alpha", [1, -0.5])
def test_index_add_with_repeated_indices_matches_torch_float64(alpha):
    index = torch.tensor([2, 0, 2, 3])  # no more rows than self: torch's symbolic exports it
    _agree(IndexAdd(alpha), IndexAdd(alpha).double(), torch.rand(4, 3) + 0.5, index)
