"""Buffers a module's training-mode forward updates (other than norm layers' running
statistics) follow torch step by step: a running maximum assigned to the buffer attribute, an
average updated in place and a buffer assigned without being read, trained 3 SGD steps
against the same module in torch float64, through the built-in loss, a loss exported with the
model and the dynamo exporter. Updates one traced graph cannot reproduce are refused with the
buffers and modules named: a branch on the buffer's value (as I-BERT's QuantAct initialises
its range), a batch mean stored through a Python float, a forward that reads the updated buffer again (torch's update carries no
gradient, the graph's would; spectral norm, whose converged power iteration writes the same
bytes in place), an update the exporter does not see, an integer buffer. On 2 ranks the buffer is averaged as BatchNorm's
statistics are: a running mean of the batch mean equals torch's on the combined batch."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

import ngdist
from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront

nn = torch.nn
spectral_norm = nn.utils.parametrizations.spectral_norm


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class WithBuffer(nn.Module):
    """A Linear layer and one buffer of zeros (``BUFFER``, its dtype ``DTYPE``, 3 values)."""

    BUFFER, DTYPE, SHAPE = "x_max", torch.float32, (3,)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer(self.BUFFER, torch.zeros(self.SHAPE, dtype=self.DTYPE))


class RunningMax(WithBuffer):
    """Assigns a new tensor to a registered buffer, as a range observer does."""

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            self.x_max = torch.maximum(self.x_max, y.detach().abs().amax(0))
        return y * 2


class InPlaceAverage(WithBuffer):
    """Updates a buffer in place under no_grad, as BatchNorm's running mean is."""

    BUFFER = "avg"

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * y.mean(0))
        return torch.tanh(y)


class LastMean(WithBuffer):
    """Assigns the buffer without reading it: it is no input of the traced graph."""

    BUFFER = "last"

    def forward(self, x):
        y = self.fc(x)
        self.last = y.detach().mean(0)
        return y


class Branching(RunningMax):
    """Initialises the range on the first step and averages afterwards (I-BERT's QuantAct)."""

    def forward(self, x):
        y = self.fc(x)
        m = y.detach().abs().amax(0)
        if self.x_max.max() < 1e-5:
            self.x_max = self.x_max + m
        else:
            self.x_max = 0.9 * self.x_max + 0.1 * m
        return y


class PythonScalar(WithBuffer):
    """Stores the batch's mean through a Python float, which the trace keeps as a constant."""

    BUFFER = "last"

    def forward(self, x):
        y = self.fc(x)
        self.last.fill_(float(y.detach().mean()))
        return y


class ReadsUpdated(InPlaceAverage):
    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            self.avg.mul_(0.9).add_(0.1 * y.mean(0))
        return y - self.avg


class Untraced(WithBuffer):
    """Counts its forwards where the exporter does not look."""

    BUFFER = "seen"

    def forward(self, x):
        if not torch.onnx.is_in_onnx_export():
            self.seen += 1
        return self.fc(x)


class Counter(WithBuffer):
    BUFFER, DTYPE, SHAPE = "calls", torch.int64, ()

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


LOSSES = {"builtin": nn.CrossEntropyLoss(), "exported": nn.CrossEntropyLoss(label_smoothing=0.1)}


def _steps_match_torch(trainer, ref: nn.Module, loss) -> None:
    """Three SGD steps (lr 0.1) of ``trainer`` and of ``ref`` in torch on the same batches
    leave the same parameters and buffers (float64 both)."""
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((5, 4)), rng.integers(0, 3, 5)) for _ in range(3)]
    for x, y in batches:
        trainer.step({"x": x, "y": y})
        ref_opt.zero_grad()
        loss(ref(torch.tensor(x)), torch.tensor(y)).backward()
        ref_opt.step()
    got = trainer.state_dict()
    for name, value in ref.state_dict().items():
        assert got[name].dtype == np.float64, name
        np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("kind", [RunningMax, InPlaceAverage, LastMean],
                         ids=lambda k: k.__name__)
def test_forward_updated_buffer_follows_torch_float64(kind, loss):
    torch.manual_seed(0)
    module = kind().double()
    ref = copy.deepcopy(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = ngdist.compile(module, torch.zeros(4, 4, dtype=torch.float64), loss=LOSSES[loss],
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                             strategy="local")
    for name, value in module.state_dict().items():  # the three traces left it as it was
        assert torch.equal(value, before[name]), name
    _steps_match_torch(trainer, ref, LOSSES[loss])
    assert not torch.equal(ref.get_buffer(kind.BUFFER), before[kind.BUFFER])
    trainer.to_torch()
    np.testing.assert_allclose(module.get_buffer(kind.BUFFER).numpy(),
                               ref.get_buffer(kind.BUFFER).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", [RunningMax, InPlaceAverage], ids=lambda k: k.__name__)
def test_dynamo_export_carries_the_update_too(kind):
    """torch.export traces with fake tensors (the buffers never move): a real forward finds
    the updated buffers; the training model then steps them as torch does."""
    torch.manual_seed(0)
    module = kind().double()
    ref = copy.deepcopy(module)
    model, exp = tfront.training_model(module, torch.zeros(4, 4, dtype=torch.float64),
                                       loss=nn.CrossEntropyLoss(), exporter="dynamo",
                                       optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    assert exp.exporter == "dynamo"
    _steps_match_torch(ngdist.compile(model, strategy="local"), ref, nn.CrossEntropyLoss())


RANK_SCRIPT = """
import sys

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
import ngdist
from test_torch_buffers import InPlaceAverage, global_batch

torch.manual_seed(0)
module = InPlaceAverage().double()
trainer = ngdist.compile(module, torch.zeros(4, 4, dtype=torch.float64), strategy="allreduce",
                         loss=torch.nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
for s in range(3):
    (shard,) = trainer.shard([global_batch(s)])
    trainer.step(shard)
np.savez(f"rank{trainer.rank}.npz", **trainer.state_dict())
"""


def global_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 + step)
    return {"x": rng.standard_normal((8, 4)), "y": rng.integers(0, 3, 8)}


@pytest.mark.mpi
def test_ranks_average_the_buffer_as_batchnorm_statistics(ranks, tmp_path):
    """Each rank's update from its half of the batch, averaged over the ranks (as BatchNorm's
    statistics are): a running mean of the batch mean then equals torch's on the combined
    batch, and every rank holds the same bytes."""
    ranks(2, RANK_SCRIPT, args=[str(Path(__file__).resolve().parent)], timeout=200)
    torch.manual_seed(0)
    ref = InPlaceAverage().double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(3):
        b = global_batch(s)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.tensor(b["x"])), torch.tensor(b["y"])).backward()
        ref_opt.step()
    got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for name, value in ref.state_dict().items():
        assert got[1][name].tobytes() == got[0][name].tobytes(), name
        np.testing.assert_allclose(got[0][name], value.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


REFUSED = {
    "branching": (Branching, (
        "Branching reads tensor values into Python (a branch, float(), .item()) where its "
        "training-mode forward updates buffers ('x_max'): traced again from the state one "
        "forward leaves, on other inputs, it gives another graph, so one traced graph cannot "
        "update them as torch does. Write the update with tensor operations (torch.where for "
        "a branch), or compile a model whose forward does not update buffers")),
    "python_scalar": (PythonScalar, (
        "PythonScalar reads tensor values into Python (a branch, float(), .item()) where its "
        "training-mode forward updates buffers ('last'): traced again from the state one "
        "forward leaves, on other inputs, it gives another graph, so one traced graph cannot "
        "update them as torch does. Write the update with tensor operations (torch.where for "
        "a branch), or compile a model whose forward does not update buffers")),
    "reads_updated": (ReadsUpdated, (
        "the training-mode forward of ReadsUpdated reads the buffers 'avg' after updating "
        "them from values that depend on parameters: torch updates them without gradient "
        "(no_grad, detach), which the exported graph cannot express, so its gradients would "
        "differ. Read the buffers before updating them, or compile a model whose forward does "
        "not update buffers")),
    # its power iteration has converged: the forward writes u and v in place with the same
    # bytes (their _version shows the write); sigma = u W v then reads them again
    "spectral_norm": (lambda: nn.Sequential(spectral_norm(nn.Linear(4, 3))), (
        "the training-mode forward of _SpectralNorm '0.parametrizations.weight.0' reads the "
        "buffers '0.parametrizations.weight.0._u', '0.parametrizations.weight.0._v' after "
        "updating them from values that depend on parameters: torch updates them without "
        "gradient (no_grad, detach), which the exported graph cannot express, so its "
        "gradients would differ. Read the buffers before updating them, or compile a model "
        "whose forward does not update buffers")),
    "untraced": (Untraced, (
        "the training-mode forward of Untraced changes the buffers 'seen', but the traced "
        "graph does not (the update is no traced tensor operation); compute it with torch "
        "operations on tensors, or compile a model whose forward does not update buffers")),
    "integer": (lambda: nn.Sequential(nn.Identity(), Counter()), (  # a submodule's name
        "the training-mode forward of Counter '1' changes the non-float buffers '1.calls' "
        "(torch.int64); ngdist updates float buffers only. Keep the buffer as a float tensor, "
        "or update it outside the module's forward")),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_update_one_graph_cannot_reproduce_is_refused(case):
    make, message = REFUSED[case]
    torch.manual_seed(0)
    module = make()
    with pytest.raises(GraphError) as err:
        ngdist.compile(module, torch.zeros(4, 4), loss=nn.CrossEntropyLoss(), strategy="local",
                       optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    assert str(err.value) == message
