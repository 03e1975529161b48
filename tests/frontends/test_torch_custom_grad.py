"""Custom autograd Functions: the export keeps only their forward, so one whose backward is
not its forward's gradient is refused by name, and one whose backward is exact (or that torch
never differentiates) trains as torch trains it (torch float64 autograd as the oracle)."""
from __future__ import annotations

import pytest
import torch
from step_probe import gradient_errors, run_step

from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad  # the surrogate: round's gradient is zero almost everywhere


class Swish(torch.autograd.Function):
    """x * sigmoid(x) with its exact derivative written out (timm's memory-efficient form)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))


class Recomputed(torch.autograd.Function):
    """A reversible-style layer: the forward runs ``layer`` under no_grad, the backward runs
    it again with gradients, accumulating its parameters' gradients itself (Reformer)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        with torch.no_grad():
            return torch.tanh(layer(x))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = torch.tanh(ctx.layer(x))
            torch.autograd.backward(y, grad)
        return x.grad, None


class Net(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = (torch.nn.Linear(6, 8), torch.nn.Linear(8, 3),
                                  torch.nn.Linear(8, 8))

    def forward(self, x):
        if self.kind == "round_input":  # data only: torch never calls the backward
            x = StraightThroughRound.apply(x * 4) / 4
        h = self.a(x)
        if self.kind == "round":
            h = StraightThroughRound.apply(h * 4) / 4
        elif self.kind == "swish":
            h = Swish.apply(h)
        elif self.kind == "recomputed":
            h = Recomputed.apply(h, self.c)
        elif self.kind == "checkpoint":
            h = torch.utils.checkpoint.checkpoint(torch.tanh, h, use_reentrant=True)
        return self.b(h)


def _batch():
    torch.manual_seed(0)
    return torch.randn(5, 6), torch.randint(0, 3, (5,))


def test_a_straight_through_estimator_is_refused_naming_the_function():
    x, _ = _batch()
    with pytest.raises(GraphError) as info:
        tfront.training_model(Net("round"), (x,), loss=torch.nn.CrossEntropyLoss(),
                              optimizer="sgd:lr=0.1")
    assert str(info.value) == (
        "Net applies custom autograd Functions whose backward differs from autograd through "
        "their forward: test_torch_custom_grad.StraightThroughRound (the gradients of a.weight "
        "and 1 more differ). The ONNX export keeps only the forward, so ngdist would train "
        "with other gradients than torch; replace them with ordinary torch operations (for a "
        "straight-through estimator: x + (f(x) - x).detach())")


@pytest.mark.parametrize("kind", ["swish", "checkpoint", "recomputed", "round_input"])
def test_an_exact_or_unused_backward_trains_as_torch(kind):
    x, y = _batch()
    module = Net(kind)
    model, _ = tfront.training_model(module, (x,), loss=torch.nn.CrossEntropyLoss(),
                                     optimizer="sgd:lr=0.1")
    assert all(p.grad is None for p in module.parameters())  # the check's backward left none
    got = run_step(model, {"x": x.numpy(), "y": y.numpy()})
    ref = Net(kind).double()
    ref.load_state_dict(module.state_dict())
    loss = torch.nn.functional.cross_entropy(ref(x.double()), y)
    loss.backward()
    assert abs(float(got["loss"]) - float(loss)) < 1e-6
    errors = gradient_errors(got, {n: p.grad.numpy() for n, p in ref.named_parameters()
                                   if p.grad is not None})  # (c: only the recomputed layer)
    assert max(errors.values()) < 1e-5, errors
