"""A shape probe asked again with the same bytes is not run again (frontends/shape_probes.py):
the eval-mode export of a module whose graph is its training-mode one, and a module compiled
a second time, make no probe session of their own; a probe whose feeds or weights differ is
run. What the probes return is what the ONNX reference evaluator computes, and the models
built from kept results are the bytes of those built from fresh runs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ngdist.frontends import shape_probes
from ngdist.frontends import torch as tfront
from ngdist.frontends.cleanup import batch_feeds


class Heads(torch.nn.Module):
    """x.view(batch, heads, -1): a Reshape whose target is computed from the batch size;
    ``dropout``: a training-mode graph unlike the eval-mode one."""

    def __init__(self, dropout: float | None = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(dropout) if dropout is not None else torch.nn.Identity()
        self.out = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))
        return self.out(h.view(x.shape[0], 2, -1)).sum(1)


@pytest.fixture
def sessions(monkeypatch):
    """The probe sessions made while the test runs (none kept from before it)."""
    made: list[int] = []
    real = shape_probes.make_session

    def counted(model, *args, **kwargs):
        made.append(len(model.graph.node))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(shape_probes, "make_session", counted)
    monkeypatch.setattr(shape_probes, "_RESULTS", type(shape_probes._RESULTS)())
    return made


def _x() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0))


def test_eval_export_equal_to_the_training_one_is_probed_once(sessions):
    exp = tfront.export(Heads(), _x(), input_names=["x"])
    assert len(sessions) == 1  # the eval graph's probe: the training graph's results
    assert exp.eval.graph.SerializeToString(deterministic=True) == \
        exp.train.graph.SerializeToString(deterministic=True)
    del sessions[:]
    tfront.export(Heads(dropout=0.5), _x(), input_names=["x"])
    assert len(sessions) == 2  # Dropout in training mode only: two graphs, two probes


def test_module_compiled_again_makes_no_probe_session_and_the_same_model(sessions):
    module = Heads()

    def build() -> onnx.ModelProto:
        model, _ = tfront.training_model(module, _x(), loss=torch.nn.CrossEntropyLoss(),
                                         input_names=["x"], optimizer="sgd:lr=0.1")
        return model

    first = build()
    made = len(sessions)
    assert made >= 1
    second = build()
    assert len(sessions) == made
    assert first.SerializeToString(deterministic=True) == \
        second.SerializeToString(deterministic=True)
    got = onnx.reference.ReferenceEvaluator(first).run(None, {"x": _x().numpy()})[0]
    with torch.no_grad():
        want = module.double()(_x().double()).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _probe() -> tuple[onnx.ModelProto, list[str]]:
    """Shape values of x @ w: its batch size, its width, and their product."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Shape", ["h"], ["shape"]),
             helper.make_node("ReduceProd", ["shape"], ["size"], keepdims=0),
             helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0)]
    graph = helper.make_graph(
        nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
                         helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 5])],
        [helper.make_empty_tensor_value_info(n) for n in ("shape", "size", "batch")],
        [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return model, ["shape", "size", "batch"]


def test_kept_results_are_the_runs_own_and_other_feeds_are_run(sessions):
    probe, names = _probe()
    feeds = batch_feeds({"x": np.ones((2, 3), np.float32)})
    weights = {"w": np.ones((3, 5), np.float32)}
    ref = ReferenceEvaluator(probe)

    def expected(f):
        return dict(zip(names, ref.run(names, {**f, **weights})))

    first = shape_probes.probe_runs(probe, names, feeds, weights)
    again = shape_probes.probe_runs(probe, names, feeds, weights)
    assert len(sessions) == 1
    for runs in (first, again):
        for run, f in zip(runs, feeds):
            want = expected(f)
            for n in names:
                np.testing.assert_array_equal(run[n], want[n])
                assert not run[n].flags.writeable  # shared: nobody writes into them
    other = batch_feeds({"x": np.full((2, 3), 2.0, np.float32)})  # the same shapes
    runs = shape_probes.probe_runs(probe, names, other, weights)
    assert len(sessions) == 2
    assert [r["batch"].item() for r in runs] == [len(f["x"]) for f in other]
    shape_probes.probe_runs(probe, names, feeds, {"w": np.zeros((3, 5), np.float32)})
    assert len(sessions) == 3  # weights are part of what a probe depends on


def test_kept_results_stay_within_their_byte_budget(sessions, monkeypatch):
    probe, names = _probe()
    weights = {"w": np.ones((3, 5), np.float32)}
    feeds = [batch_feeds({"x": np.full((2, 3), v, np.float32)}) for v in (1.0, 2.0)]
    one = shape_probes._nbytes(shape_probes.probe_runs(probe, names, feeds[0], weights))
    shape_probes._RESULTS.clear()
    monkeypatch.setattr(shape_probes, "CACHED_MAX_BYTES", one)  # room for one probe's results
    for f in (*feeds, feeds[1]):
        shape_probes.probe_runs(probe, names, f, weights)
    assert len(sessions) == 3  # the first probe once more, then the second from its results
    assert len(shape_probes._RESULTS) == 1
    shape_probes.probe_runs(probe, names, feeds[0], weights)
    assert len(sessions) == 4  # dropped for the second
