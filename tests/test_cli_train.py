"""``ngdist train MODEL.onnx --data FILE.npz -n N``: the real command, relaunched under mpiexec.

Oracles: the same command on one rank with the concatenated batch (same parameters), test
accuracy of the saved model run by a plain onnxruntime session, exact error messages.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from ngdist import zoo
from ngdist.data import load_digits

from conftest import TRAIN_SAMPLES, ngdist_train


def _params(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(path)
    assert model.training_info, "the saved file is a training model"
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_train_on_2_ranks_equals_1_rank_with_the_whole_batch(train_files):
    common = ["mlp.onnx", "--data", "digits.npz", "--optimizer", "sgd:lr=0.1,momentum=0.9",
              "--epochs", "4"]
    two = ngdist_train(train_files, *common, "-n", "2", "--batch-size", "16", "--save", "two.onnx")
    assert two.returncode == 0, two.stderr
    assert "train mlp.onnx on 2 rank(s): 100%" in two.stderr  # the progress bar (rank 0 only)
    assert two.stderr.count("train mlp.onnx on 2 rank(s):   0%") == 1
    # relaunched under ngdist's supervisor: each line says its rank
    assert "[rank 0] trained 4 epoch(s), 80 steps of 32 samples on 2 rank(s)" in two.stdout
    one = ngdist_train(train_files, *common, "-n", "1", "--batch-size", "32", "--save", "one.onnx")
    assert one.returncode == 0, one.stderr
    p2, p1, p0 = _params(train_files / "two.onnx"), _params(train_files / "one.onnx"), \
        {t.name: numpy_helper.to_array(t) for t in zoo.mlp((64, 32, 10), seed=0).graph.initializer}
    assert sorted(p2) == sorted(p1) == sorted(p0)
    for name in p0:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-4, atol=2e-6, err_msg=name)
        assert not np.allclose(p2[name], p0[name], atol=1e-3), f"{name} did not train"
    # the saved graph is the trained, deployable model
    _, _, x_test, y_test = load_digits()
    sess = ort.InferenceSession(str(train_files / "two.onnx"), providers=["CPUExecutionProvider"])
    accuracy = float((sess.run(None, {"x": x_test})[0].argmax(1) == y_test).mean())
    assert accuracy >= 0.9, accuracy


@pytest.mark.parametrize("n", ["1", "2"])
def test_missing_array_is_a_clear_error(train_files, n):
    x_train, _, _, _ = load_digits()
    np.savez(train_files / "nolabels.npz", x=x_train[:64])
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "nolabels.npz", "-n", n)
    assert proc.returncode == 1
    assert proc.stderr == ("ngdist: error: nolabels.npz: no array 'y' (the labels); the file "
                           "holds ['x'], the model needs ['x', 'y']\n")
    assert not (train_files / "out.onnx").exists()


def test_shape_that_does_not_fit_is_a_clear_error(train_files):
    x_train, y_train, _, _ = load_digits()
    np.savez(train_files / "bad.npz", x=x_train[:64, :63], y=y_train[:64])
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "bad.npz", "-n", "2")
    assert proc.returncode == 1
    assert proc.stderr == ("ngdist: error: bad.npz: array 'x' has shape (64, 63), which does "
                           "not fit the model input 'x' of shape [batch, 64]\n")
    np.savez(train_files / "bad.npz", x=x_train[:64], y=y_train[:64, None])
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "bad.npz", "-n", "2")
    assert proc.returncode == 1
    assert proc.stderr == ("ngdist: error: bad.npz: array 'y' has shape (64, 1), which does "
                           "not fit the labels 'y' of shape [batch]\n")


def test_float_labels_and_uneven_arrays_are_clear_errors(train_files):
    x_train, y_train, _, _ = load_digits()
    np.savez(train_files / "bad.npz", x=x_train[:64], y=y_train[:64].astype(np.float32))
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "bad.npz")
    assert (proc.returncode, proc.stderr) == (
        1, "ngdist: error: bad.npz: array 'y' has dtype float32; int64 is needed for the "
           "labels 'y'\n")
    np.savez(train_files / "bad.npz", x=x_train[:64], y=y_train[:60])
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "bad.npz")
    assert (proc.returncode, proc.stderr) == (
        1, "ngdist: error: bad.npz: the arrays hold different numbers of samples (axis 0): "
           "{'x': 64, 'y': 60}\n")
