"""Keras / TensorFlow frontend: gradients against tf.GradientTape, optimizer translation,
a Keras CNN trained on digits on 2 ranks, and weights written back into the Keras model."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402 - the extra CI installs
import tf2onnx  # noqa: E402,F401 - the extra CI installs
import keras  # noqa: E402

import ngdist  # noqa: E402
from ngdist.data import load_digits  # noqa: E402
from ngdist.errors import GraphError, OptionError  # noqa: E402
from ngdist.frontends import keras as kfront  # noqa: E402
from step_probe import max_rel_err, rank_results, run_step  # noqa: E402

CNN_SOURCE = """
def make_cnn(keras, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])
"""
exec(CNN_SOURCE)  # noqa: S102  (the same definition runs inside the 2-rank script)


def make_softmax_mlp(seed: int = 0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(10, activation="softmax")])


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _images(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, 8, 8, 1)


@pytest.mark.parametrize("case", ["cnn_logits", "mlp_softmax_output"])
def test_first_step_loss_and_gradients_match_gradient_tape(case, digits):
    xtr, ytr, _, _ = digits
    if case == "cnn_logits":
        model = make_cnn(keras)  # noqa: F821
        x = _images(xtr[:32])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:  # from_logits=False on a Softmax output: trained on the Softmax's input
        model = make_softmax_mlp()
        x = xtr[:32]
        loss = keras.losses.SparseCategoricalCrossentropy()
    proto = _check_first_step(model, loss, x, ytr[:32])
    # the deployed graph still outputs what the Keras model outputs (probabilities here)
    ort_out = _run_inference(proto, {"x": x})
    np.testing.assert_allclose(ort_out, model(x, training=False).numpy(), atol=1e-5)


def test_mse_loss_gradients_match_gradient_tape():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    y = rng.standard_normal((16, 10)).astype(np.float32)
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10)])
    _check_first_step(model, keras.losses.MeanSquaredError(), x, y)


def _check_first_step(model, loss, x, y):
    """ngdist's first-step loss and gradients equal tf.GradientTape's (rel err <= 1e-4)."""
    proto, exp = kfront.training_model(model, loss=loss, optimizer=keras.optimizers.SGD(0.1))
    got = run_step(proto, {"x": x, "y": y})
    with tf.GradientTape() as tape:
        ref_loss = loss(y, model(x, training=True))
    grads = tape.gradient(ref_loss, model.trainable_variables)
    assert abs(float(got["loss"]) - float(ref_loss)) <= 1e-4 * abs(float(ref_loss))
    assert len(grads) == len(exp.links) > 0
    for var, ref in zip(model.trainable_variables, grads):
        mine = exp.links[var.path].to_keras(got[f"{var.path}.grad"], tuple(var.shape))
        assert max_rel_err(mine, ref.numpy()) <= 1e-4, var.path
    return proto


def _run_inference(proto, feeds):
    import onnxruntime as ort
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("make_opt", [
    lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    lambda: keras.optimizers.SGD(0.05, momentum=0.8, nesterov=True),
    lambda: keras.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6),
    lambda: keras.optimizers.Adadelta(1.0, rho=0.9, epsilon=1e-6),
    lambda: keras.optimizers.Nadam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6),
    lambda: keras.optimizers.RMSprop(0.01, rho=0.8, momentum=0.5, centered=True, epsilon=1e-4),
    lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.2, epsilon=1e-4),
    lambda: keras.optimizers.Adamax(0.01, beta_1=0.8, beta_2=0.9, epsilon=1e-4),
], ids=["sgd_momentum", "sgd_nesterov", "adam", "adadelta", "nadam", "rmsprop", "adagrad",
        "adamax"])
def test_optimizer_translation_follows_keras_for_three_steps(make_opt, digits):
    xtr, ytr, _, _ = digits
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = make_softmax_mlp(seed=1)
    model.pop()  # logits head
    model.add(keras.layers.Dense(10))
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    trainer = ngdist.compile(model, loss=loss, optimizer=make_opt(), strategy="local")
    opt = make_opt()
    for i in range(3):
        x, y = xtr[32 * i:32 * (i + 1)], ytr[32 * i:32 * (i + 1)]
        trainer.step({"x": x, "y": y})
        with tf.GradientTape() as tape:
            value = loss(y, ref(x, training=True))
        opt.apply_gradients(zip(tape.gradient(value, ref.trainable_variables),
                                ref.trainable_variables))
    trainer.to_keras()
    for mine, theirs in zip(model.trainable_variables, ref.trainable_variables):
        assert max_rel_err(mine.numpy(), theirs.numpy()) <= 1e-5, mine.path


def test_errors_are_clear():
    keras.utils.set_random_seed(0)
    bn = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                           keras.layers.BatchNormalization()])
    with pytest.raises(GraphError, match=r"trainable Keras BatchNormalization layers "
                                         r"\['batch_normalization.*'\] cannot be trained"):
        kfront.export(bn)
    mlp = make_softmax_mlp()
    with pytest.raises(GraphError, match="optimizer Lion has no ngdist counterpart"):
        kfront.translate_optimizer(keras.optimizers.Lion())
    with pytest.raises(GraphError, match=r"^SGD: \['clipnorm'\] have no ONNX counterpart; "
                                         r"leave them unset \(ngdist.compile takes "
                                         r"clip_grad_norm= and clip_grad_value=\)$"):
        kfront.translate_optimizer(keras.optimizers.SGD(0.1, clipnorm=1.0))
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(GraphError, match="learning-rate schedules are not supported"):
        kfront.translate_optimizer(keras.optimizers.SGD(sched))
    with pytest.raises(GraphError, match=r"^loss 42 is not a Keras loss, a loss name or a "
                                         r"function of \(y_true, y_pred\)$"):
        kfront.training_model(mlp, loss=42, optimizer="sgd:lr=0.01")
    with pytest.raises(OptionError) as info:  # neither given nor in model.compile
        ngdist.compile(mlp, strategy="local")
    assert str(info.value) == (
        f"Keras model {mlp.name!r} has no training step and no optimizer was given: pass "
        "optimizer= (e.g. optimizer=ngdist.optim.SGD(lr=0.01), a Keras optimizer such as "
        "keras.optimizers.SGD(0.01) (here or in model.compile), or a spec like "
        "'adamw:lr=1e-3')")


TRAIN_SCRIPT = CNN_SOURCE + """
import hashlib, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, keras, onnxruntime as ort
import ngdist
from ngdist.data import load_digits



def softmax(z):  # predictions as class probabilities: logits' rounding scales with them
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


xtr, ytr, xte, yte = load_digits()
xtr, xte = xtr.reshape(-1, 8, 8, 1), xte.reshape(-1, 8, 8, 1)
model = make_cnn(keras)
trainer = ngdist.compile(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         optimizer=keras.optimizers.Adam(0.005), timeout=60)
rng = np.random.default_rng(0)
for epoch in range(12):
    order = rng.permutation(len(xtr))
    for i in range(0, len(order) - 63, 64):
        idx = order[i:i + 64]
        trainer.step(next(trainer.shard([{"x": xtr[idx], "y": ytr[idx]}])))
params = trainer.parameters()
digest = {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
          for k, v in sorted(params.items())}  # the bytes of every parameter
pred = trainer.predict({"x": xte})[0]
path = sys.argv[1]
trainer.save(path)
trainer.to_keras()
if trainer.rank == 0:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    saved = sess.run(None, {"x": xte})[0]
    mine = model.predict(xte, verbose=0)
    print("RESULT " + json.dumps({
        "acc": float((saved.argmax(1) == yte).mean()),
        "diff": float(np.abs(softmax(mine) - softmax(saved)).max()),
        "logit_diff": float(np.abs(mine - saved).max()),
        "same_classes": bool((mine.argmax(1) == saved.argmax(1)).all()),
        "predict_diff": float(np.abs(pred - saved).max()),
        "digest": digest}))
else:
    print("RESULT " + json.dumps({"digest": digest}))
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_keras_cnn_on_two_ranks_reaches_097_and_writes_back(ranks, tmp_path):
    proc = ranks(2, TRAIN_SCRIPT, timeout=240, args=[str(tmp_path / "keras_cnn.onnx")])
    main, results = rank_results(proc, 2)
    assert main["acc"] >= 0.97, main
    assert main["diff"] <= 1e-5 and main["same_classes"], main
    assert main["predict_diff"] == 0.0, main
    assert results[0]["digest"] == results[1]["digest"]  # the same bytes on both ranks
