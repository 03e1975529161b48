"""Values torch keeps out of autograd, through the PyTorch frontend, against torch in float64.

A parameter read only under ``torch.no_grad()`` or through ``.detach()`` gets no gradient and
is not trained (torch's optimizers skip a parameter whose ``.grad`` is None: no weight decay,
no momentum); a straight-through estimator ``h + (q(h) - h).detach()`` passes the gradient of
the identity, not ``q``'s; a statistic of a trained weight taken under ``no_grad`` scales
without adding its own derivative. Gradients of one step, then 3 steps of SGD with momentum and
weight decay and of AdamW, match torch float64. The dynamo exporter marks ``.detach()`` too.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ngdist
from ngdist.frontends import torch as tfront
from step_probe import gradient_errors, max_rel_err, run_step, torch_step

nn = torch.nn
D, CLASSES = 5, 3
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class NoGradIndex(nn.Module):
    """A Linear plus rows of a parameter read under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, CLASSES)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x):
        with torch.no_grad():
            t = self.bias[[0, 1, 2]]
        return self.lin(x) + t


class DetachIndex(NoGradIndex):
    def forward(self, x):
        return self.lin(x) + self.bias[[0, 1, 2]].detach()


class StraightThrough(nn.Module):
    """A hidden layer quantised by tanh with the straight-through gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(D, 8)
        self.b = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.a(x)
        return self.b(h + (torch.tanh(3.0 * h) - h).detach())


class NoGradScale(nn.Module):
    """A Linear whose output is divided by its weight's mean magnitude taken under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, CLASSES)

    def forward(self, x):
        with torch.no_grad():
            scale = self.lin.weight.abs().mean() + 0.5
        return self.lin(x) / scale


MODELS = {"no_grad_index": NoGradIndex, "detach_index": DetachIndex,
          "straight_through": StraightThrough, "no_grad_scale": NoGradScale}
OPTIMIZERS = {
    "sgd_momentum_decay": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9,
                                                     weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
}


def _batches(steps: int, batch: int = 6):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((steps, batch, D)).astype(np.float32),
            rng.integers(0, CLASSES, (steps, batch)))


# the dynamo exporter (TorchScript's fallback) marks detach; its graphs keep no trace of no_grad
CASES = [(name, "torchscript") for name in sorted(MODELS)] + \
    [("detach_index", "dynamo"), ("straight_through", "dynamo")]


@pytest.mark.parametrize("name,exporter", CASES)
def test_gradients_match_torch_float64(name, exporter):
    module = MODELS[name]()
    x, y = _batches(1)
    model, _ = tfront.training_model(module, torch.zeros(2, D), loss=nn.CrossEntropyLoss(),
                                     optimizer="sgd:lr=0.01", exporter=exporter)
    got = run_step(model, {"x": x[0], "y": y[0]})
    loss, grads, _ = torch_step(module, x[0], y[0], nn.CrossEntropyLoss(), float64=True)
    assert abs(float(got["loss"]) - loss) <= TOL * abs(loss)
    assert set(grads) == {n[:-len(".grad")] for n in got if n.endswith(".grad")}
    errors = gradient_errors(got, grads)
    assert max(errors.values()) <= TOL, errors


def _train_torch(module: nn.Module, make_opt, x, y) -> nn.Module:
    opt = make_opt(module.parameters())
    for b in range(len(x)):
        opt.zero_grad()
        nn.functional.cross_entropy(module(torch.from_numpy(x[b]).to(torch.float64)),
                                    torch.from_numpy(y[b])).backward()
        opt.step()
    return module


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_three_steps_match_torch_float64(name, opt):
    module = MODELS[name]()
    x, y = _batches(3)
    ref = _train_torch(copy.deepcopy(module).double(), OPTIMIZERS[opt], x, y)
    trainer = ngdist.compile(module, torch.zeros(2, D), loss=nn.CrossEntropyLoss(),
                             optimizer=OPTIMIZERS[opt](module.parameters()), strategy="local")
    for b in range(3):
        trainer.step({"x": x[b], "y": y[b]})
    trainer.to_torch()
    for (pname, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        err = max_rel_err(mine.detach().numpy(), theirs.detach().numpy())
        assert err <= TOL, (pname, err)
    if isinstance(module, NoGradIndex):  # torch's optimizer skipped it: not even decayed
        assert torch.equal(module.bias, MODELS[name]().bias)
