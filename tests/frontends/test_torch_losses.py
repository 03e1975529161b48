"""Any torch loss trains: a loss module or function given as ``loss=`` is exported with the
model (frontends/torch_loss.py) and one SGD step equals torch's in float64 (NLLLoss after
log_softmax, CrossEntropyLoss with weight / label_smoothing / ignore_index, BCEWithLogitsLoss,
HuberLoss, KLDivLoss, a user's function); an exporter that changes a loss is refused; on 2 ranks
a counted mean (ignore_index, class weights) is divided by the global count, as torch on the
combined batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ngdist
from ngdist.errors import GraphError, OptionError
from ngdist.frontends import torch_loss

nn = torch.nn
F = nn.functional
C = 5
WEIGHT = torch.arange(1.0, C + 1, dtype=torch.float64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Net(nn.Module):
    def __init__(self, log_softmax: bool = False) -> None:
        super().__init__()
        self.l1, self.l2, self.log_softmax = nn.Linear(6, 8), nn.Linear(8, C), log_softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l2(torch.tanh(self.l1(x)))
        return F.log_softmax(h, dim=1) if self.log_softmax else h


def data(n: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    probs = rng.uniform(0.1, 1, (n, C))
    labels = rng.integers(0, C, n)
    labels[[1, 4]] = 2
    return {"x": rng.standard_normal((n, 6)), "indices": labels,
            "floats": rng.standard_normal((n, C)), "probs": probs / probs.sum(1, keepdims=True),
            "binary": rng.uniform(0, 1, (n, C))}


def user_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((output - labels) ** 2).sum(dim=1).mean() + 0.1 * output.abs().mean()


# name -> (output is log_softmax, loss, labels key)
CASES = {
    "NLLLoss": (True, nn.NLLLoss(), "indices"),
    "F.nll_loss": (True, F.nll_loss, "indices"),
    "CrossEntropyLoss after log_softmax": (True, nn.CrossEntropyLoss(), "indices"),
    "CrossEntropyLoss weight": (False, nn.CrossEntropyLoss(weight=WEIGHT), "indices"),
    "CrossEntropyLoss ignore_index": (False, nn.CrossEntropyLoss(ignore_index=2), "indices"),
    "CrossEntropyLoss label_smoothing": (False, nn.CrossEntropyLoss(label_smoothing=0.1),
                                         "indices"),
    "CrossEntropyLoss all three": (False, nn.CrossEntropyLoss(
        weight=WEIGHT, label_smoothing=0.2, ignore_index=2), "indices"),
    "CrossEntropyLoss sum": (False, nn.CrossEntropyLoss(reduction="sum"), "indices"),
    "BCEWithLogitsLoss": (False, nn.BCEWithLogitsLoss(), "binary"),
    "HuberLoss": (False, nn.HuberLoss(delta=0.5), "floats"),
    "KLDivLoss": (True, nn.KLDivLoss(reduction="batchmean"), "probs"),
    "user function": (False, user_loss, "floats"),
}


def one_step(log_softmax: bool, loss, key: str) -> tuple[float, float, float]:
    """(ngdist's loss, torch's loss, the largest parameter difference) after one SGD step."""
    torch.manual_seed(0)
    module = Net(log_softmax).double()
    ref = Net(log_softmax).double()
    ref.load_state_dict(module.state_dict())
    d = data()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), loss=loss,
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.5),
                             strategy="local")
    got = trainer.step({"x": d["x"], "y": d[key]}).loss
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    expected = loss(ref(torch.from_numpy(d["x"])), torch.from_numpy(d[key]))
    expected.backward()
    opt.step()
    params = trainer.parameters()
    err = max(float(np.abs(params[k] - v.detach().numpy()).max())
              for k, v in ref.state_dict().items())
    return got, float(expected), err


@pytest.mark.parametrize("case", list(CASES))
def test_a_torch_loss_trains_as_torch(case):
    got, expected, err = one_step(*CASES[case])
    assert err < 1e-9, case
    assert got == pytest.approx(expected, rel=1e-6), case


def test_builtin_forms_are_kept_and_the_rest_exported():
    assert torch_loss.builtin_name(nn.CrossEntropyLoss()) == "softmax_cross_entropy"
    assert torch_loss.builtin_name(nn.MSELoss()) == "mse"
    for loss in (nn.CrossEntropyLoss(ignore_index=2), nn.NLLLoss(), F.cross_entropy, user_loss):
        assert torch_loss.exported(loss)


def test_an_exporter_that_changes_the_loss_is_refused():
    """torch 2.13's dynamo exporter drops F.cross_entropy's label_smoothing."""
    with pytest.raises(GraphError, match=r"the ONNX export of loss <lambda> computes .* where "
                                         r"torch computes .* write the loss with plain"):
        one_step(False, lambda o, y: F.cross_entropy(o, y, label_smoothing=0.2), "indices")


def test_a_loss_that_is_not_a_scalar_is_refused():
    with pytest.raises(GraphError, match=r"loss CrossEntropyLoss does not give a float scalar"):
        one_step(False, nn.CrossEntropyLoss(reduction="none"), "indices")


def test_labels_named_like_an_input_or_output_are_refused():
    module = Net().double()
    with pytest.raises(GraphError, match=r"the labels input 'x' has the name of a model input "
                                         r"\(inputs: \['x'\]\); pass labels= another name"):
        ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), loss=nn.NLLLoss(),
                       labels="x", strategy="local", optimizer="sgd:lr=0.01")


def test_an_unknown_loss_string_gets_the_closest_name():
    with pytest.raises(OptionError, match=r"unknown loss 'softmax_crossentropy'; did you mean "
                                          r"'softmax_cross_entropy'\?"):
        ngdist.compile(Net(), torch.zeros(2, 6), loss="softmax_crossentropy", strategy="local",
                       optimizer=ngdist.optim.SGD(lr=0.1))


RANKS_SCRIPT = """
import sys

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
import ngdist
import test_torch_losses as T

for name, (log_softmax, loss, key) in T.COUNTED.items():
    torch.manual_seed(0)
    module = T.Net(log_softmax).double()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), loss=loss,
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    assert any(n.op_type == "AllReduce" and "loss_count" in n.name
               for n in trainer.step_model.graph), name
    for s in range(T.STEPS):
        d = T.ranks_batch(s)
        half = slice(4 * trainer.rank, 4 * trainer.rank + 4)
        trainer.step({"x": d["x"][half], "y": d["indices"][half]})
    np.savez(f"{trainer.rank}.{name}.npz", **trainer.parameters())
"""
COUNTED = {"ce": (False, nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=2), "indices"),
           "nll": (True, nn.NLLLoss(ignore_index=2), "indices")}
STEPS = 3


def ranks_batch(step: int) -> dict[str, np.ndarray]:
    """8 samples: rank 0's half has no ignored label, rank 1's three of four."""
    d = data()
    d["x"] = d["x"] + step
    d["indices"] = np.array([0, 1, 3, 4, 2, 2, 2, 1])
    return d


@pytest.mark.mpi
def test_an_exported_counted_mean_uses_the_global_count_on_2_ranks(ranks, tmp_path):
    from pathlib import Path

    ranks(2, RANKS_SCRIPT, args=[str(Path(__file__).parent)], timeout=200)
    for name, (log_softmax, loss, _) in COUNTED.items():
        torch.manual_seed(0)
        ref = Net(log_softmax).double()
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for s in range(STEPS):
            d = ranks_batch(s)
            opt.zero_grad()
            loss(ref(torch.from_numpy(d["x"])), torch.from_numpy(d["indices"])).backward()
            opt.step()
        got = [dict(np.load(tmp_path / f"{r}.{name}.npz")) for r in range(2)]
        for k, v in ref.state_dict().items():
            assert got[1][k].tobytes() == got[0][k].tobytes(), (name, k)
            np.testing.assert_allclose(got[0][k], v.detach().numpy(), rtol=0, atol=1e-9,
                                       err_msg=f"{name} {k}")


def test_evaluate_computes_the_exported_loss_or_refuses():
    """evaluate() knows unweighted cross-entropy (NLLLoss after log_softmax exports as one)
    and mse: a weighted CrossEntropyLoss is refused rather than evaluated without its
    weights."""
    from ngdist.errors import NgdistError

    d = data()
    for log_softmax, loss in ((True, nn.NLLLoss()), (False, nn.CrossEntropyLoss(ignore_index=2))):
        module = Net(log_softmax).double()
        trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), loss=loss,
                                 optimizer=torch.optim.SGD(module.parameters(), lr=0.5),
                                 strategy="local")
        result = trainer.evaluate({"x": d["x"], "y": d["indices"]})
        expected = loss(module(torch.from_numpy(d["x"])), torch.from_numpy(d["indices"]))
        assert result.loss == pytest.approx(float(expected), rel=1e-9), loss
    module = Net().double()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(weight=WEIGHT), strategy="local",
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    with pytest.raises(NgdistError, match=r"comes from a SoftmaxCrossEntropyLoss node with class "
                                          r"weights: evaluate with trainer.predict\(\)"):
        trainer.evaluate({"x": d["x"], "y": d["indices"]})
