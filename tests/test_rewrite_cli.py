"""`ngdist rewrite` / `ngdist inspect`, and the training-model file round trip."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnx
from onnx import numpy_helper

import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.ir.model import assemble_training_model, save_proto, split_training_model



def test_roundtrip_keeps_training_info():
    model = ngdist.to_training_model(zoo.mlp((64, 16, 10)),
                                     optimizer=ngdist.optim.Adam(lr=1e-3))
    inference, step = split_training_model(model)
    again = assemble_training_model(inference, step)
    onnx.checker.check_model(again)
    a, b = model.training_info[0], again.training_info[0]
    assert {(kv.key, kv.value) for kv in a.update_binding} == \
        {(kv.key, kv.value) for kv in b.update_binding}
    assert [n.op_type for n in a.algorithm.node] == [n.op_type for n in b.algorithm.node]
    assert [(n.name, list(n.input), list(n.output)) for n in a.algorithm.node] == \
        [(n.name, list(n.input), list(n.output)) for n in b.algorithm.node]
    def tensors(ts):
        return {t.name: numpy_helper.to_array(t) for t in ts}
    for x, y in [(model.graph.initializer, again.graph.initializer),
                 (a.algorithm.initializer, b.algorithm.initializer)]:
        tx, ty = tensors(x), tensors(y)
        assert tx.keys() == ty.keys()
        assert all(np.array_equal(tx[k], ty[k]) for k in tx)
    assert [i.name for i in a.algorithm.input] == [i.name for i in b.algorithm.input] == ["x", "y"]
    # the inference graph is untouched and deployable
    assert [n.op_type for n in again.graph.node] == ["Gemm", "Relu", "Gemm"]


def test_rewrite_inspect_and_same_trajectory(cli, tmp_path, same_trajectory):
    training = ngdist.to_training_model(
        zoo.mlp((64, 32, 10)), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    save_proto(training, tmp_path / "training.onnx")
    proc = cli("rewrite", "training.onnx", "-o", "dist.onnx", "--bucket-bytes", "4096",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rewritten = onnx.load(tmp_path / "dist.onnx")
    onnx.checker.check_model(rewritten)
    ops = [(n.domain, n.op_type) for n in rewritten.training_info[0].algorithm.node]
    assert ("ngdist", "AllReduce") in ops
    assert not any(d == "ai.onnx.preview.training" for d, _ in ops)  # fully lowered

    proc = cli("inspect", "dist.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # 4 KiB buckets: fc1 (10x32 + 10 floats = 1320 B) fits one bucket, fc0.weight (8 KiB) is
    # alone, fc0.bias (128 B) starts the last one
    assert "comm nodes: 3" in out
    assert "ngdist/allreduce/bucket0" in out and "ngdist/allreduce/bucket2" in out
    # bucket 0 is one flat buffer of both fc1 gradients; each line names a tensor and its size
    assert "2 tensor(s) in one flat buffer, 1,320 B" in out
    members = [line.split() for line in out.splitlines() if line.startswith("      ")]
    assert members == [["fc1.weight.grad", "1,280", "B"], ["fc1.bias.grad", "40", "B"],
                       ["fc0.weight.grad", "8,192", "B"], ["fc0.bias.grad", "128", "B"]]
    assert "parameters: 4" in out

    x, y, _, _ = load_digits()
    a = ngdist.compile(str(tmp_path / "training.onnx"), bucket_bytes=4096)
    b = ngdist.compile(str(tmp_path / "dist.onnx"))
    same_trajectory(a, b, x, y, steps=10, batch=32)


def test_inspect_forward_model_and_help(cli, tmp_path):
    save_proto(zoo.mlp((64, 16, 10)), tmp_path / "mlp.onnx")
    proc = cli("inspect", "mlp.onnx", cwd=tmp_path)
    assert proc.returncode == 0
    assert "training model: no (forward only)" in proc.stdout and "parameters: 4" in proc.stdout
    proc = cli("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "rewrite" in proc.stdout and "demo" in proc.stdout
    proc = cli("rewrite", "--help", cwd=tmp_path)
    assert "--bucket-bytes" in proc.stdout


def test_saved_model_is_deployable(tmp_path):
    import onnxruntime as ort

    x, y, xt, yt = load_digits()
    tr = ngdist.compile(zoo.mlp((64, 32, 10)), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    for s in range(30):
        tr.step({"x": x[s * 32:(s + 1) * 32], "y": y[s * 32:(s + 1) * 32]})
    tr.save(tmp_path / "trained.onnx")
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(None, {"x": xt})
    np.testing.assert_array_equal(logits, tr.predict({"x": xt})[0])
    names = {t.name for t in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    assert names == {"fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"}
    # the trained model can be loaded again and continues from its state
    again = ngdist.compile(str(tmp_path / "trained.onnx"))
    assert int(again.state_dict()["ngdist.step"]) == 30
    for k, v in tr.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[k], v)


RUN_REWRITTEN = """
import sys, numpy as np, ngdist
from ngdist.data import load_digits
x, y, _, _ = load_digits()
tr = ngdist.compile(sys.argv[1], timeout=60)
for s in range(10):
    (bx, by), = tr.shard([(x[s * 64:(s + 1) * 64], y[s * 64:(s + 1) * 64])])
    tr.step({"x": bx, "y": by})
np.savez(f"p{tr.rank}.npz", **tr.parameters())
"""


def test_ngdist_run_launches_rewritten_file(cli, tmp_path):
    training = ngdist.to_training_model(zoo.mlp((64, 32, 10), seed=3),
                                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    save_proto(training, tmp_path / "training.onnx")
    assert cli("rewrite", "training.onnx", "-o", "dist.onnx", cwd=tmp_path).returncode == 0
    (tmp_path / "train.py").write_text(RUN_REWRITTEN)
    proc = cli("run", "-n", "2", "--timeout", "60", "--", sys.executable, "train.py", "dist.onnx",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    p0, p1 = dict(np.load(tmp_path / "p0.npz")), dict(np.load(tmp_path / "p1.npz"))
    assert all(np.array_equal(p0[k], p1[k]) for k in p0)
    # equals one process on the combined batches
    x, y, _, _ = load_digits()
    ref = ngdist.compile(str(tmp_path / "training.onnx"))
    for s in range(10):
        ref.step({"x": x[s * 64:(s + 1) * 64], "y": y[s * 64:(s + 1) * 64]})
    for k, v in ref.parameters().items():
        assert np.abs(p0[k] - v).max() <= 1e-5 * np.abs(v).max(), k


def test_example_script_runs_as_documented(cli, tmp_path):
    """examples/train_mlp.py, launched the way its docstring and the README say, trains on 2
    ranks and writes a deployable model that classifies held-out digits."""
    proc = cli("run", "-n", "2", "--", sys.executable,
               str(Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"),
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"rank 0: last loss [0-9.]+, test accuracy ([0-9.]+)",
                               proc.stdout).group(1))
    assert accuracy >= 0.95, proc.stdout
    _, _, x_test, y_test = load_digits()
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    saved = sess.run(None, {"x": x_test})[0].argmax(1)
    assert abs((saved == y_test).mean() - accuracy) < 1e-3  # the file is the trained model
