"""Acceptance: a LeNet-style CNN with BatchNorm (zoo.cnn) trained by ngdist.compile on the
bundled digits (1x8x8 images) on 2 ranks reaches >= 0.97 test accuracy, with parameters and
BatchNorm running statistics bit-for-bit identical on the ranks."""
from __future__ import annotations

import json

import numpy as np
import onnx

from ngdist import zoo
from ngdist.frontends.onnx import build_training_model
from ngdist.ir.model import split_training_model
from ngdist.passes.pipeline import run_passes

SCRIPT = r"""
import hashlib, json, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x_train, y_train, x_test, y_test = load_digits(images=True)
trainer = ngdist.compile(zoo.cnn(seed=0), loss="softmax_cross_entropy", labels="y",
                         optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                         strategy="allreduce", timeout=60)
global_batch = 32 * trainer.size
steps = len(x_train) // global_batch
for epoch in range(12):
    if epoch == 8:
        trainer.set_lr(0.01)
    perm = np.random.default_rng(epoch).permutation(len(x_train))  # same on every rank
    batches = ((x_train[perm[i:i + global_batch]], y_train[perm[i:i + global_batch]])
               for i in range(0, steps * global_batch, global_batch))
    for x, y in trainer.shard(batches):
        trainer.step({"x": x, "y": y})
state = trainer.state_dict()
digest = {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
          for k, v in sorted(state.items())}
accuracy = float((trainer.predict({"x": x_test})[0].argmax(1) == y_test).mean())
with open(f"result{trainer.rank}.json", "w") as fh:
    json.dump({"rank": trainer.rank, "accuracy": accuracy, "digest": digest,
               "buffers": sorted(trainer.meta.names("buffer")),
               "params": sorted(trainer.parameters()),
               "running_var": state["bn1.running_var"].tolist()}, fh)
trainer.close()
"""


def test_cnn_reaches_97_percent_on_two_ranks(ranks, tmp_path) -> None:
    ranks(2, SCRIPT, timeout=240)
    first, second = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1))
    assert first["accuracy"] >= 0.97, first["accuracy"]
    assert first["buffers"] == ["bn1.running_mean", "bn1.running_var"]
    assert not set(first["buffers"]) & set(first["params"])
    assert first["digest"] == second["digest"]  # params, BN buffers, optimizer state
    # the running variance was updated (from 1) by training, not left at its initial value
    assert not np.allclose(first["running_var"], 1.0)


def test_batchnorm_statistics_become_buffers() -> None:
    model = build_training_model(zoo.cnn(), optimizer="sgd")
    info = model.training_info[0]
    binding = {kv.key: kv.value for kv in info.update_binding}
    roles = json.loads({p.key: p.value for p in model.metadata_props}["ngdist.roles"])
    assert roles["bn1.running_mean"] == roles["bn1.running_var"] == "buffer"
    assert "bn1.running_mean" not in info.algorithm.node[-1].input  # not trained
    bn = next(n for n in info.algorithm.node if n.op_type == "BatchNormalization")
    assert binding["bn1.running_mean"] == bn.output[1]
    assert binding["bn1.running_var"] == bn.output[2]
    assert {bn.output[1], bn.output[2]} <= {o.name for o in info.algorithm.output}
    # the deployable graph normalizes with the running statistics
    inference_bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    assert list(inference_bn.output) == [bn.output[0]]
    assert onnx.helper.get_attribute_value(
        next(a for a in inference_bn.attribute if a.name == "training_mode")) == 0
    # through the pipeline: each buffer's new value is averaged over the ranks
    _, step = split_training_model(model)
    step = run_passes(step, "allreduce")
    from ngdist.passes.bucketing import reduced_by
    outputs = {v.name: v for v in step.graph.outputs}
    for name in ("bn1.running_mean", "bn1.running_var"):
        averaged = reduced_by(outputs[binding[name]])  # through the bucket's Split/Reshape
        assert averaged is not None and averaged.op_type == "AllReduce"


def test_explicit_params_cannot_include_buffers() -> None:
    import pytest

    from ngdist.errors import GraphError
    with pytest.raises(GraphError, match=r"params \['bn1.running_var'\] are running statistics"):
        build_training_model(zoo.cnn(), params=["conv1.weight", "bn1.running_var"],
                             optimizer="sgd:lr=0.01")


def test_forward_cnn_runs_and_is_valid() -> None:
    import onnxruntime as ort
    model = zoo.cnn()
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"x": np.random.default_rng(0).random((5, 1, 8, 8), np.float32)})[0]
    assert out.shape == (5, 10)


def test_running_statistics_follow_onnx_semantics_and_round_trip(tmp_path) -> None:
    """One local step updates the buffers as ONNX BatchNormalization defines (momentum 0.9,
    biased batch variance); the saved file keeps them in the main graph's initializers."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    import ngdist
    from ngdist.data import load_digits
    from ngdist.ir.model import get_meta

    x_train, y_train, _, _ = load_digits(images=True)
    x, y = x_train[:16], y_train[:16]
    forward = zoo.cnn(channels=(4, 4))
    inits = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    conv = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(inits["conv1.weight"], "w"),
         numpy_helper.from_array(inits["conv1.bias"], "b")]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    c = ort.InferenceSession(conv.SerializeToString(),
                             providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    trainer = ngdist.compile(forward, optimizer=ngdist.optim.SGD(lr=0.05), strategy="local")
    trainer.step({"x": x, "y": y})
    state = trainer.state_dict()
    np.testing.assert_allclose(state["bn1.running_mean"], 0.1 * c.mean((0, 2, 3)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["bn1.running_var"], 0.9 + 0.1 * c.var((0, 2, 3)),
                               rtol=1e-5, atol=1e-6)
    trainer.save(tmp_path / "cnn.onnx")
    saved = onnx.load(tmp_path / "cnn.onnx")
    main = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
    np.testing.assert_array_equal(main["bn1.running_var"], state["bn1.running_var"])
    assert "bn1.running_var" not in {t.name for t in saved.training_info[0].algorithm.initializer}
    _, step = split_training_model(saved)
    assert get_meta(step).roles["bn1.running_mean"] == "buffer"
    # the deployable graph normalizes with the saved running statistics (eval mode)
    sess = ort.InferenceSession(saved.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], trainer.predict({"x": x})[0],
                               rtol=1e-6)
    trainer.close()
