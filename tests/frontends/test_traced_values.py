"""Values the TorchScript tracer takes from a module's data: a mixture of experts that splits
its tokens by ``counts.tolist()`` of its router's choices is traced with the example batch's
counts as constants, so its graph computes something else than torch on any other batch
(measured: 0.24 off torch float64 in the eval outputs of a second batch). The frontend checks
the eval graph against torch on a second batch and, where it differs and the dynamo exporter
cannot export the module either, refuses naming the source line. A module whose
``.tolist()`` is of shapes only still compiles, and computes torch's outputs at other batch
sizes; so does one that converts data it does not route by."""
from __future__ import annotations

import copy
import inspect
import logging

import numpy as np
import onnx
import pytest
import torch

import ngdist
from ngdist.errors import GraphError
from ngdist.frontends import torch_exporters, torch_trace_check as check

nn = torch.nn


class SplitByCounts(nn.Module):
    """Routes each row to the argmax of a router and splits the sorted rows by the experts'
    counts as Python ints, as mixture-of-experts layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        e = self.router(x).argmax(-1)
        order = torch.argsort(e * x.shape[0] + torch.arange(x.shape[0]))
        counts = torch.bincount(e, minlength=3)
        parts = torch.split(x[order], counts.tolist())
        out = torch.cat([self.experts[i](p) for i, p in enumerate(parts)])
        return self.head(out[torch.argsort(order)])


class ShapeList(nn.Module):
    """Converts its input's feature size, not its data, to a Python list."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        (cols,) = torch.tensor(x.shape[1:]).tolist()
        return self.fc(x.reshape(-1, cols)) * 2


class CheckedInput(ShapeList):
    """Converts a test of its data to a Python bool that decides nothing the graph holds."""

    def forward(self, x):
        if bool(torch.isnan(x).any()):
            raise ValueError("NaN input")
        return torch.tanh(self.fc(x))


class ScaledByCount(ShapeList):
    """Scales its output by a count of its data taken as a Python int, which torch.export
    keeps as a symbolic value."""

    def forward(self, x):
        n = int(x[:, 0].gt(0).sum())
        return self.fc(x) * n


def _split_line() -> str:
    lines, first = inspect.getsourcelines(SplitByCounts.forward)
    offset = next(i for i, ln in enumerate(lines) if "counts.tolist()" in ln)
    return f"{__file__}:{first + offset}"


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)


def _compile(module: nn.Module, x: torch.Tensor):
    return ngdist.compile(module, x, loss=nn.CrossEntropyLoss(),
                          optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                          strategy="local")


def test_split_by_data_counts_is_refused_naming_the_line():
    x, x2 = _batches()
    module = SplitByCounts().double()
    counts = [torch.bincount(module.router(b).argmax(-1), minlength=3).tolist() for b in (x, x2)]
    assert counts[0] != counts[1]  # the second batch routes otherwise
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(GraphError) as info:
        _compile(module, x)
    assert str(info.value) == (
        f"SplitByCounts's exported graph holds values the tracer took from the example batch's "
        f"data (tensors converted to Python values at {_split_line()}): it computes something "
        "else than torch on other batches, and the dynamo exporter could not export the module "
        "instead. Compute those values with tensor operations (no .tolist(), .item(), int() of "
        "data), or compile an ONNX file you exported yourself")
    for name, value in module.state_dict().items():  # the checks left the module as it was
        assert torch.equal(value, before[name]), name


def test_a_count_the_dynamo_exporter_keeps_trains_as_torch_float64():
    from ngdist.frontends import torch as tfront

    module = ScaledByCount().double()
    ref = copy.deepcopy(module)
    x, _ = _batches()
    model, exp = tfront.training_model(module, x, loss=nn.CrossEntropyLoss(),
                                       optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    assert exp.exporter == "dynamo"
    trainer = ngdist.compile(model, strategy="local")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rng = np.random.default_rng(1)
    for _ in range(3):  # batches of other counts than the example's
        xb, yb = rng.standard_normal((6, 4)), rng.integers(0, 3, 6)
        np.testing.assert_allclose(trainer.predict({"x": xb})[0],
                                   ref.eval()(torch.tensor(xb)).detach().numpy(), rtol=1e-6)
        trainer.step({"x": xb, "y": yb})
        ref_opt.zero_grad()
        nn.CrossEntropyLoss()(ref.train()(torch.tensor(xb)), torch.tensor(yb)).backward()
        ref_opt.step()
    got = trainer.state_dict()
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-6, atol=1e-9, err_msg=name)


def test_the_eval_graph_differs_from_torch_without_the_check(monkeypatch):
    """What the refusal prevents: the graph's split sizes are the example batch's."""
    from ngdist.frontends import torch as tfront

    monkeypatch.setattr(tfront, "traced_from_data", lambda *a, **k: False)
    x, x2 = _batches()
    module = SplitByCounts().double()
    ref = copy.deepcopy(module).eval()
    trainer = _compile(module, x)
    got = trainer.predict({"x": x2.numpy()})[0]
    assert np.abs(got - ref(x2).detach().numpy()).max() > 0.1


@pytest.mark.parametrize("kind", [ShapeList, CheckedInput], ids=lambda k: k.__name__)
def test_harmless_conversions_compile_and_follow_torch(kind, caplog):
    caplog.set_level(logging.INFO, logger=check.__name__)
    torch.manual_seed(0)
    module = kind().double()
    ref = copy.deepcopy(module).eval()
    trainer = _compile(module, torch.randn(8, 4, dtype=torch.float64))
    for rows in (3, 5):
        x = torch.randn(rows, 4, dtype=torch.float64)
        np.testing.assert_allclose(trainer.predict({"x": x.numpy()})[0],
                                   ref(x).detach().numpy(), rtol=1e-6, atol=1e-9)
    assert "the eval graph matches torch on a second batch" in caplog.text


def test_conversions_are_noted_on_the_graph_and_taken_once():
    model = onnx.ModelProto()
    model.metadata_props.add(key="other", value="kept")

    class TracerWarning(Warning):
        pass

    seen = [type("W", (), {"category": TracerWarning, "filename": "m.py", "lineno": 7,
                           "message": "Converting a tensor to a Python list might cause ..."}),
            type("W", (), {"category": UserWarning, "filename": "n.py", "lineno": 1,
                           "message": "Converting a tensor to a Python list"})]
    torch_exporters._note_conversions(model, seen)
    assert check.take_conversions(model) == ["m.py:7"]
    assert check.take_conversions(model) == []
    assert [(p.key, p.value) for p in model.metadata_props] == [("other", "kept")]


def test_second_batch_changes_data_not_ids_range_or_masks():
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(5, 9, (4, 6)), "mask": np.ones((4, 6), np.int64),
             "x": rng.standard_normal((4, 3)).astype(np.float32)}
    other = check.second_batch(feeds)
    assert set(np.unique(other["ids"])) <= set(np.unique(feeds["ids"]))
    assert not np.array_equal(other["ids"], feeds["ids"])
    assert np.array_equal(other["mask"], feeds["mask"])
    assert other["x"].dtype == np.float32 and not np.allclose(other["x"], feeds["x"])
