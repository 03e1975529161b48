"""The compile path keeps no needless whole copy of a model's parameters: shape inference and
onnx's checker see copies without the large tensors' data, the step graph gets each tensor's
data once, and the torch frontend's write-back keeps its record of the export without data.
Each result is the same as with the whole model (bytes compared)."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import ngdist
from ngdist import zoo
from ngdist.api import to_training_model
from ngdist.frontends.onnx import normalize_forward
from ngdist.ir import copies, model as irmodel
from ngdist.ir.copies import TENSOR_DATA
from ngdist.ir.model import check_proto, split_training_model
from ngdist.passes.pipeline import run_passes

LARGE = copies.LARGE_BYTES  # no shape computation reads a tensor this large


def _training_model() -> onnx.ModelProto:
    """An MLP whose weight matrices (and Adam moments) are larger than LARGE."""
    return to_training_model(zoo.mlp((64, 512, 10), seed=0),
                             optimizer=ngdist.optim.AdamW(lr=1e-3))


def _has_data(t: onnx.TensorProto) -> bool:
    return any(t.HasField(f) if f == "raw_data" else len(getattr(t, f)) for f in TENSOR_DATA)


def _largest_seen(calls: list[onnx.ModelProto]) -> int:
    return max((t.ByteSize() for m in calls for t in m.graph.initializer), default=0)


@pytest.fixture
def inference_calls(monkeypatch: pytest.MonkeyPatch) -> list[onnx.ModelProto]:
    """Every model handed to onnx's shape inference, recorded."""
    calls: list[onnx.ModelProto] = []
    infer = onnx.shape_inference.infer_shapes

    def recording(model: onnx.ModelProto, *args, **kwargs):  # noqa: ANN202
        calls.append(model)
        return infer(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", recording)
    return calls


def test_split_infers_shapes_without_the_parameters_data(
        inference_calls, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _training_model()
    inference_calls.clear()
    inference, step = split_training_model(model)
    assert inference_calls, "the step graph's shapes were not inferred"
    assert _largest_seen(inference_calls) < LARGE
    proto = ir.to_proto(step)
    assert sum(t.ByteSize() > LARGE for t in proto.graph.initializer) == 3  # weight, moments
    # the same bytes as inference on the whole step graph gives (no tensor counts as large)
    monkeypatch.setattr(copies, "LARGE_BYTES", 1 << 62)
    inference_calls.clear()
    whole_inference, whole = split_training_model(model)
    assert _largest_seen(inference_calls) > LARGE
    assert proto.SerializeToString() == ir.to_proto(whole).SerializeToString()
    assert inference.SerializeToString() == whole_inference.SerializeToString()


def test_split_deep_copies_no_large_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _training_model()
    copied: list[int] = []
    deepcopy = copy.deepcopy

    def recording(obj, *args):  # noqa: ANN202
        copied.append(obj.ByteSize() if hasattr(obj, "ByteSize") else 0)
        return deepcopy(obj, *args)

    monkeypatch.setattr(copy, "deepcopy", recording)
    split_training_model(model)
    assert max(copied, default=0) < LARGE


def test_forward_shapes_inferred_without_the_parameters_data(inference_calls) -> None:
    _training_model()  # the ONNX frontend's normalize_forward infers the forward's shapes
    assert inference_calls and _largest_seen(inference_calls) < LARGE


def _folding_forward() -> onnx.ModelProto:
    """y = reshape(x @ W, [rows of x, columns of W]): shapes to fold, and a large W."""
    h = onnx.helper
    w = onnx.numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32), "W")
    ints = [onnx.numpy_helper.from_array(np.array([v], np.int64), n)
            for n, v in (("zero", 0), ("one", 1), ("two", 2))]
    nodes = [h.make_node("MatMul", ["x", "W"], ["xw"]),
             h.make_node("Shape", ["x"], ["sx"]), h.make_node("Shape", ["W"], ["sw"]),
             h.make_node("Slice", ["sx", "zero", "one"], ["rows"]),
             h.make_node("Slice", ["sw", "one", "two"], ["cols"]),
             h.make_node("Concat", ["rows", "cols"], ["target"], axis=0),
             h.make_node("Reshape", ["xw", "target"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                ["batch", 64])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                         [w, *ints])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("make", [_folding_forward, lambda: zoo.mlp((64, 512, 10), seed=0)])
def test_normalize_forward_gives_the_bytes_it_gives_on_the_whole_model(
        make, monkeypatch: pytest.MonkeyPatch) -> None:
    forward = make()
    before = forward.SerializeToString()
    got = normalize_forward(forward)
    assert forward.SerializeToString() == before  # the caller's model stays as it was
    monkeypatch.setattr(copies, "LARGE_BYTES", 1 << 62)  # no tensor is large: whole copies
    assert got.SerializeToString() == normalize_forward(forward).SerializeToString()
    if make is _folding_forward:  # the shapes were folded (the probe was fed W)
        assert any(t.name.endswith(("/ngdist.target", "/ngdist.folded"))
                   for t in got.graph.initializer)


def test_checker_sees_no_large_tensor_data(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[onnx.ModelProto] = []
    check = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model",
                        lambda m, *a, **k: (calls.append(m), check(m, *a, **k))[1])
    model = _training_model()
    check_proto(model, "model.onnx")
    assert calls and _largest_seen(calls) < LARGE


def test_checker_still_refuses_an_invalid_graph() -> None:
    model = _training_model()
    model.graph.node[0].input[0] = "nothing_makes_this"
    with pytest.raises(ngdist.errors.ModelLoadError, match="the ONNX model is invalid"):
        check_proto(model, "model.onnx")


def test_torch_write_back_keeps_the_export_without_data() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                 torch.nn.Linear(512, 10))
    trainer = ngdist.compile(module, torch.zeros(4, 64), loss=torch.nn.CrossEntropyLoss(),
                             strategy="local", optimizer="sgd:lr=0.01")
    exp = trainer._write_back.export
    for graph in (exp.train.graph, exp.eval.graph):
        assert graph.initializer and not any(_has_data(t) for t in graph.initializer)
        assert graph.node  # the graphs themselves stay
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    trainer.step({"input": x, "y": np.arange(4) % 10})
    trainer.to_torch()  # the write-back needs only the names
    assert np.array_equal(module[0].weight.detach().numpy(),
                          trainer.state_dict()["0.weight"])


def test_step_proto_without_data_is_the_same_bytes_as_a_stripped_copy() -> None:
    _, step = split_training_model(_training_model())
    step = run_passes(step, "local")
    meta = irmodel.get_meta(step)
    held = lambda n: meta.roles.get(n, "data") != "data"  # noqa: E731
    before = ir.to_proto(step).SerializeToString()
    got = copies.to_proto_without_data(step, held)
    assert got.SerializeToString() == \
        copies.without_tensor_data(ir.to_proto(step), held).SerializeToString()
    assert not any(_has_data(t) for t in got.graph.initializer if held(t.name))
    assert ir.to_proto(step).SerializeToString() == before  # the step keeps its data


@pytest.mark.parametrize("dtype, n", [(np.float32, LARGE // 4), (np.float32, LARGE // 4 + 1),
                                      (np.float16, LARGE // 2 + 1), (np.int64, 3),
                                      (np.float64, LARGE // 8 + 1)])
@pytest.mark.parametrize("raw", [True, False])
def test_large_is_the_data_size_from_type_and_dims(dtype, n, raw) -> None:
    """``large`` reads the type and dims, not the data (the data may be typed fields or be
    absent, as in a copy without data), and agrees with the array's size."""
    array = np.arange(n).astype(dtype)
    tensor = onnx.numpy_helper.from_array(array, "t")
    if not raw:
        tensor = onnx.helper.make_tensor("t", tensor.data_type, array.shape, array.ravel())
    assert copies.large(tensor) == (array.nbytes > LARGE)
    placeholder = copies.copy_fields(tensor, onnx.TensorProto(), TENSOR_DATA)
    assert copies.large(placeholder) == (array.nbytes > LARGE)


def test_a_string_tensor_is_large_by_its_serialised_size() -> None:
    short = onnx.helper.make_tensor("s", onnx.TensorProto.STRING, [2], [b"a", b"b"])
    long = onnx.helper.make_tensor("s", onnx.TensorProto.STRING, [1], [b"x" * (LARGE + 1)])
    assert (copies.large(short), copies.large(long)) == (False, True)
