"""Bad input ends with a clear error (and a non-zero CLI exit),, never a hang."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ngdist
from ngdist import zoo
from ngdist.errors import GradientError, InputError, ModelLoadError
from ngdist.ir.model import save_proto



@pytest.fixture
def mlp_file(tmp_path) -> Path:
    path = tmp_path / "mlp.onnx"
    save_proto(zoo.mlp((64, 16, 10)), path)
    return path


def test_truncated_file(cli, tmp_path, mlp_file):
    data = mlp_file.read_bytes()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or not ONNX"):
        ngdist.compile(str(bad))
    proc = cli("inspect", str(bad), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("ngdist: error: ")
    assert "truncated" in proc.stderr and "Traceback" not in proc.stderr


def test_not_onnx_and_missing(cli, tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(ModelLoadError, match="truncated or not ONNX"):
        ngdist.compile(str(text))
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="the file is empty"):
        ngdist.compile(str(empty))
    with pytest.raises(ModelLoadError, match="no such file"):
        ngdist.compile(str(tmp_path / "absent.onnx"))
    proc = cli("rewrite", str(text), "-o", str(tmp_path / "out.onnx"), "--optimizer", "sgd:lr=0.1",
               cwd=tmp_path)
    assert proc.returncode == 1 and "not ONNX" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_op_without_gradient_rule(cli, tmp_path):
    # Det has no gradient rule; the error names the op type and the node
    w = numpy_helper.from_array(np.ones((4, 9), np.float32), "w")
    v = numpy_helper.from_array(np.ones((4, 3), np.float32), "v")
    shape = numpy_helper.from_array(np.array([-1, 3, 3], np.int64), "shape")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Reshape", ["h", "shape"], ["m"], name="square"),
         helper.make_node("Det", ["m"], ["d"], name="the_det"),
         helper.make_node("Unsqueeze", ["d", "axis"], ["du"], name="col"),
         helper.make_node("MatMul", ["x", "v"], ["h2"], name="mm2"),
         helper.make_node("Mul", ["du", "h2"], ["logits"], name="mul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 3])],
        [w, v, shape, numpy_helper.from_array(np.array([1], np.int64), "axis")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(GradientError, match=r"Det \(node 'the_det'\)"):
        ngdist.compile(model, optimizer=ngdist.optim.SGD(lr=0.1))
    path = tmp_path / "det.onnx"
    save_proto(model, path)
    proc = cli("rewrite", str(path), "-o", str(tmp_path / "o.onnx"), "--optimizer", "sgd", cwd=tmp_path)
    assert proc.returncode == 1 and "Det (node 'the_det')" in proc.stderr


def test_batch_errors():
    tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1))
    x = np.zeros((4, 64), np.float32)
    y = np.zeros(4, np.int64)
    with pytest.raises(InputError, match=r"the batch is missing input\(s\) \['y'\]; the model's "
                                         r"data inputs are \['x', 'y'\]"):
        tr.step({"x": x})
    with pytest.raises(InputError, match=r"unknown input\(s\) \['z'\]"):
        tr.step({"x": x, "y": y, "z": y})
    with pytest.raises(InputError, match=r"input 'x' has shape \(4, 63\); the model expects "
                                         r"\[batch, 64\] \(axis 1\)"):
        tr.step({"x": np.zeros((4, 63), np.float32), "y": y})
    with pytest.raises(InputError, match=r"input 'x' has shape \(64,\), the model expects rank 2"):
        tr.step({"x": np.zeros(64, np.float32), "y": y})
    before = tr.parameters()
    tr.step({"x": x, "y": y})  # after errors, the trainer still works
    assert tr.steps_done == 1
    assert not all(np.array_equal(before[k], v) for k, v in tr.parameters().items())


def test_a_declared_extent_far_beyond_any_batch_is_refused_at_the_step_not_in_memory():
    """The shape probe of the ONNX frontend does not allocate a declared [batch, 10^13]
    input (13.6 PiB); the trainer builds, and a batch of another extent gets its error."""
    model = zoo.mlp((64, 16, 10))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 10 ** 13
    tr = ngdist.compile(model, optimizer=ngdist.optim.SGD(lr=0.1))
    with pytest.raises(InputError, match=r"input 'x' has shape \(4, 64\); the model expects "
                                         r"\[batch, 10000000000000\] \(axis 1\)"):
        tr.step({"x": np.zeros((4, 64), np.float32), "y": np.zeros(4, np.int64)})


def test_save_is_atomic(tmp_path, monkeypatch):
    tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1))
    path = tmp_path / "trained.onnx"
    tr.save(path)
    original = path.read_bytes()
    tr.step({"x": np.ones((4, 64), np.float32), "y": np.arange(4)})

    def boom(self, *a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", boom)
    with pytest.raises(OSError, match="simulated"):
        tr.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == original  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trained.onnx"]  # no temp left over
    loaded = onnx.load(path)
    onnx.checker.check_model(loaded)
    assert loaded.training_info


DIFFERENT_MODEL = """
import ngdist
from ngdist import zoo
hidden = 16 if ngdist.rank() == 0 else 17
ngdist.compile(zoo.mlp((64, hidden, 10)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=20)
"""


@pytest.mark.mpi
def test_rank_with_different_model(ranks):
    proc = ranks(2, DIFFERENT_MODEL, timeout=60, check=False)
    assert proc.returncode != 0
    assert "ranks [1] hold a different step graph than rank 0" in proc.stderr
    assert "start every rank with the same model" in proc.stderr


RANK_DIES = """
import os, sys, numpy as np, ngdist
from ngdist import zoo
tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1),
                    timeout=float(sys.argv[2]))
x, y = np.ones((4, 64), np.float32), np.arange(4)
for step in range(50):
    if step == 3 and tr.rank == 1:
        if sys.argv[1] == "exit0":
            os._exit(0)  # vanishes without finalizing MPI, status 0
        elif sys.argv[1] == "sysexit":
            sys.exit(0)  # a user's early exit: MPI is finalized on this rank only
        else:
            os.kill(os.getpid(), 9)  # killed (e.g. by the OOM killer)
    tr.step({"x": x, "y": y})
"""

GONE = ("ngdist: error on rank 0: CommError: ngdist.AllReduce 'ngdist/allreduce/bucket0' cannot "
        "complete on rank 0: the process of rank 1 (pid ")


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["exit0", "sysexit", "sigkill"])
def test_rank_dies_mid_training(ranks, how):
    """A rank whose process is gone, or whose program has ended (sys.exit(0): it waits at the
    end of the job), is noticed on its host within seconds (not the 30 s timeout), with an
    error naming the op, or the rank and its steps."""
    import time

    limit = "30"
    start = time.monotonic()
    proc = ranks(2, RANK_DIES, args=[how, limit], timeout=90, check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    seen = f"exit status {proc.returncode} after {elapsed:.1f} s, output:\n{out[-2000:]}"
    if how == "exit0":
        assert GONE in out and "has exited. Look at that rank's output" in out, seen
        assert elapsed < 20, seen
    elif how == "sigkill":  # the launcher may tear the job down first, reporting the kill
        assert GONE in out or "Killed (signal 9)" in out, seen
        assert elapsed < 20, seen
    else:
        assert ("ngdist: error on rank 0: CommError: rank 1 (pid " in out
                and "ran out of data after 3 step(s): it ended its program (exit status 0) "
                    "while rank 0 waits for it in step 4" in out), seen
        assert elapsed < 20, seen


def _pool_model(kernel: list[int], strides: list[int]) -> onnx.ModelProto:
    """x [batch, 1, 8, 8] -> Conv 1x1 -> MaxPool -> Flatten -> Gemm(10 classes)."""
    w = numpy_helper.from_array(np.full((10, 1), 0.1, np.float32), "fc.weight")
    c = numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "conv.weight")
    nodes = [helper.make_node("Conv", ["x", "conv.weight"], ["h"], name="conv"),
             helper.make_node("MaxPool", ["h"], ["p"], name="pool", kernel_shape=kernel,
                              strides=strides),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fc.weight"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], [w, c])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("kernel, strides, message", [
    ([9, 1], [8, 1], "MaxPool 'pool': its window of 9 (kernel 9, dilation 1) does not fit spatial "
                     "axis 0 of size 8 with pads 0 + 0; its output would be empty"),
    ([8, 1], [0, 1], "MaxPool 'pool' has kernel [8, 1], strides [0, 1], dilations [1, 1], pads "
                     "[0, 0, 0, 0]: kernel sizes, strides and dilations must be at least 1 and "
                     "pads at least 0")])
def test_pool_window_that_cannot_run_is_refused_naming_the_node(kernel, strides, message):
    with pytest.raises(GradientError) as info:
        ngdist.compile(_pool_model(kernel, strides), optimizer=ngdist.optim.SGD(lr=0.1))
    assert str(info.value) == f"gradient rule of MaxPool failed on node 'pool': {message}"
