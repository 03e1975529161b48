"""Mistakes in what a user trains are refused before they train the wrong thing: labels that are
not class ids, batches whose inputs differ in size, global batches smaller than the rank count,
a Softmax before softmax_cross_entropy, a batch size baked into the model, a NaN/Inf loss."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import ngdist
from ngdist import zoo
from ngdist.api import RuntimeOptions
from ngdist.errors import GraphError, InputError, NgdistError, OptionError

SGD = ngdist.optim.SGD(lr=0.1)


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _x(n: int = 4) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def mlp():
    return ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=SGD)


# ------------------------------------------------------------------ labels

def test_labels_must_be_integer_class_ids(mlp):
    with pytest.raises(InputError) as err:
        mlp.step({"x": _x(), "y": np.array([0, 1, 2.5, 3])})
    assert str(err.value) == (
        "labels 'y' of softmax_cross_entropy must be integer class ids; value 2.5 (flat index 2) "
        "is not: pass the class index of each sample (e.g. y.astype(np.int64)), not one-hot "
        "vectors or probabilities")
    with pytest.raises(InputError, match=r"value nan \(flat index 3\) is not"):
        mlp.step({"x": _x(), "y": np.array([0, 1, 2, np.nan])})
    with pytest.raises(InputError, match=r"must be integer class ids; value 0.5 \(flat index 0\)"):
        mlp.step({"x": _x(), "y": np.full((4, 10), 0.5, np.float32)})  # probabilities


def test_labels_in_range(mlp):
    with pytest.raises(InputError) as err:
        mlp.step({"x": _x(), "y": np.array([0, -1, 2, 3])})
    assert str(err.value) == (
        "labels 'y' of softmax_cross_entropy hold -1 (flat index 1); class ids must be in "
        "[0, 10) and the loss has no ignore_index: fix the labels, or give the loss an "
        "ignore_index for samples to skip")
    with pytest.raises(InputError) as err:
        mlp.step({"x": _x(), "y": np.array([0, 10, 2, 3])})
    assert str(err.value) == (
        "labels 'y' of softmax_cross_entropy hold 10 (flat index 1), but the model's output "
        "'logits' has 10 classes: class ids must be in [0, 10); fix the labels or give the "
        "model 11 or more outputs")
    steps = mlp.steps_done
    stats = mlp.step({"x": _x(), "y": np.array([0.0, 9.0, 2.0, 3.0])})  # integer-valued floats
    assert mlp.steps_done == steps + 1 and np.isfinite(stats.loss)


def test_ignore_index_is_allowed():
    # an explicit loss graph (loss=None) whose SoftmaxCrossEntropyLoss ignores -1
    w = numpy_helper.from_array(np.full((64, 10), 0.01, np.float32), "w")
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["logits"]),
         helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"],
                          reduction="mean", ignore_index=-1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64]),
         helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    tr = ngdist.compile(model, loss=None, optimizer=SGD)
    stats = tr.step({"x": _x(), "y": np.array([0, -1, 9, -1])})
    assert np.isfinite(stats.loss)
    with pytest.raises(InputError, match=r"hold -2 \(flat index 1\); class ids must be in "
                                         r"\[0, 10\) and the loss ignores only -1"):
        tr.step({"x": _x(), "y": np.array([0, -2, 9, -1])})
    with pytest.raises(InputError, match=r"hold 10 \(flat index 2\), but the model's output "
                                         r"'logits' has 10 classes"):
        tr.step({"x": _x(), "y": np.array([0, -1, 10, -1])})


def test_classes_known_only_at_run_time():
    # the logits' last dimension follows the input's: known from this batch's shapes
    w = numpy_helper.from_array(np.ones((1,), np.float32), "w")
    model = _model([helper.make_node("Mul", ["x", "w"], ["logits"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "k"])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], [w])
    tr = ngdist.compile(model, optimizer=SGD)
    x = np.zeros((4, 6), np.float32)
    tr.step({"x": x, "y": np.array([0, 1, 2, 5])})
    with pytest.raises(InputError, match=r"hold 6 \(flat index 1\), but the model's output "
                                         r"'logits' has 6 classes: class ids must be in \[0, 6\)"):
        tr.step({"x": x, "y": np.array([0, 6, 2, 3])})
    tr.step({"x": np.zeros((4, 8), np.float32), "y": np.array([0, 6, 7, 3])})  # 8 classes now


# ------------------------------------------------------------------ batch sizes

def test_inputs_share_the_batch_size(mlp):
    with pytest.raises(InputError) as err:
        mlp.step({"x": _x(4), "y": np.arange(5)})
    assert str(err.value) == (
        "the batch's inputs differ in size along axis 0: 'x' has 4 samples, 'y' has 5; every "
        "input of a batch needs one row per sample")
    with pytest.raises(InputError, match=r"the global batch's inputs differ in size along axis "
                                         r"0: 'x' has 8 samples, 'y' has 7"):
        list(mlp.shard([{"x": _x(8), "y": np.arange(7)}]))
    with pytest.raises(InputError, match=r"'\[0\]' has 8 samples, '\[1\]' has 7"):
        list(mlp.shard([(_x(8), np.arange(7))]))


def test_global_batch_smaller_than_ranks(mlp, monkeypatch, caplog):
    monkeypatch.setattr(mlp, "num_workers", 4)
    with pytest.raises(InputError) as err:
        list(mlp.shard([{"x": _x(3), "y": np.arange(3)}]))
    assert str(err.value) == (
        "the global batch has 3 sample(s) for 4 training ranks, so some rank's shard would be "
        "empty: the global batch must have at least as many samples as ranks (4)")
    monkeypatch.setattr(mlp, "_uneven_logged", False)
    with caplog.at_level(logging.INFO, logger="ngdist.runtime.global_batches"):
        shards = list(mlp.shard([{"x": _x(10), "y": np.arange(10)}] * 2 +
                                [{"x": _x(8), "y": np.arange(8)}]))
    assert [len(s["y"]) for s in shards] == [3, 3, 2]  # rank 0 of 4
    uneven = [r.getMessage() for r in caplog.records if "divide evenly" in r.getMessage()]
    assert uneven == ["the global batch of 10 samples does not divide evenly over 4 ranks: "
                      "shards differ by up to 1 sample(s) (np.array_split), and the averaged "
                      "gradient weighs a sample of a smaller shard slightly more (logged once)"]


def test_fixed_batch_size_in_the_model():
    # an exporter's static batch 1 survives in a Reshape; the labels inherit it
    w = numpy_helper.from_array(np.full((64, 10), 0.01, np.float32), "w")
    shape = numpy_helper.from_array(np.array([1, 64], np.int64), "shape")
    model = _model([helper.make_node("Reshape", ["x", "shape"], ["xr"]),
                    helper.make_node("MatMul", ["xr", "w"], ["logits"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                   [w, shape])
    tr = ngdist.compile(model, optimizer=SGD)
    with pytest.raises(InputError) as err:
        tr.step({"x": _x(16), "y": np.zeros(16, np.int64)})
    assert str(err.value) == (
        "input 'x' has a fixed batch size of 1 in the model; this rank's shard has 16 samples: "
        "export the model with a dynamic batch axis")
    tr.step({"x": _x(1), "y": np.zeros(1, np.int64)})


# ------------------------------------------------------------------ Softmax before the loss

def _softmax_model(op: str, two_outputs: bool = False):
    w = numpy_helper.from_array(np.full((64, 10), 0.01, np.float32), "w")
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["n", 10])]
    if two_outputs:
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10]))
    return _model([helper.make_node("MatMul", ["x", "w"], ["logits"]),
                   helper.make_node(op, ["logits"], ["probs"], name="head", axis=-1)],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                  outputs, [w])


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_output_with_cross_entropy_refused(op):
    with pytest.raises(GraphError) as err:
        ngdist.compile(_softmax_model(op), optimizer=SGD)  # default loss: softmax_cross_entropy
    assert str(err.value) == (
        f"the model's output 'probs' is already a {op} (node 'head'), and "
        "loss='softmax_cross_entropy' applies a softmax itself, so training would apply it "
        f"twice: remove the {op} from the model so that it outputs logits (or pass output= "
        "naming the logits), or pass loss=None with an explicit loss graph whose first output "
        "is the loss")
    with pytest.raises(GraphError, match=f"already a {op}"):
        ngdist.compile(_softmax_model(op), loss="cross_entropy", optimizer=SGD)


def test_softmax_output_other_uses_allowed():
    ngdist.compile(_softmax_model("Softmax"), loss="mse", optimizer=SGD)
    tr = ngdist.compile(_softmax_model("Softmax", two_outputs=True), output="logits",
                        optimizer=SGD)
    assert np.isfinite(tr.step({"x": _x(), "y": np.arange(4)}).loss)


# ------------------------------------------------------------------ NaN/Inf loss

def test_nan_loss_stops_training():
    tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=SGD)
    assert tr.nan_check
    y = np.arange(4)
    tr.step({"x": _x(), "y": y})
    bad = _x()
    bad[2, 5] = np.nan
    with pytest.raises(NgdistError) as err:
        tr.step({"x": bad, "y": y})
    assert str(err.value) == (
        "the loss is nan at step 2 (rank 0); the parameters of this step are not usable: check "
        "the batch for NaN/Inf values and lower the learning rate, or pass nan_check=False to "
        "ngdist.compile to train on regardless")
    assert tr.step({"x": bad, "y": y}, fetch_stats=False) is None  # the loss is not read


def test_nan_check_opt_out():
    tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=SGD, nan_check=False)
    assert not tr.nan_check
    bad = _x()
    bad[0, 0] = np.inf
    assert np.isnan(tr.step({"x": bad, "y": np.arange(4)}).loss)
    assert "nan_check" in RuntimeOptions.names()
    with pytest.raises(OptionError, match="option 'nan_check' of ngdist.compile takes"):
        RuntimeOptions(nan_check="yes")
