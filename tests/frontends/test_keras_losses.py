"""Keras losses other than ngdist's own nodes are exported with the model through tf2onnx, and
Keras' weight decay on every optimizer (with ``exclude_from_weight_decay``) is followed: each
against TensorFlow's own training step (``tf.GradientTape`` and the Keras optimizer), float32."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402 - the extra CI installs
import keras  # noqa: E402

import ngdist  # noqa: E402
from ngdist.errors import GraphError  # noqa: E402
from ngdist.frontends import keras as kfront  # noqa: E402
from ngdist.frontends import keras_loss  # noqa: E402
from step_probe import max_rel_err  # noqa: E402

STEPS = 3


def make_mlp(softmax: bool = False):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(5, activation="softmax" if softmax else None)])


def batches(one_hot: bool):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        x = rng.standard_normal((8, 12)).astype(np.float32)
        y = rng.integers(0, 5, 8)
        out.append((x, np.eye(5, dtype=np.float32)[y] if one_hot else y))
    return out


def train_both(make_model, loss, make_opt, one_hot: bool = True):
    """(ngdist's trained Keras model, TensorFlow's, ngdist's losses, TensorFlow's losses)."""
    model, ref = make_model(), make_model()
    trainer = ngdist.compile(model, loss=loss, optimizer=make_opt(), strategy="local")
    opt, fn = make_opt(), keras.losses.get(loss) if isinstance(loss, str) else loss
    mine, theirs = [], []
    for x, y in batches(one_hot):
        mine.append(float(trainer.step({"x": x, "y": y}).loss))
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(fn(y, ref(x, training=True)))  # model.compile's mean
        opt.apply_gradients(zip(tape.gradient(value, ref.trainable_variables),
                                ref.trainable_variables))
        theirs.append(float(value))
    trainer.to_keras()
    return model, ref, mine, theirs


def cubic(y_true, y_pred):
    """A user's own loss."""
    return tf.reduce_mean(tf.abs(y_true - y_pred) ** 3)


LOSSES = {
    "categorical_logits": (make_mlp, keras.losses.CategoricalCrossentropy(from_logits=True)),
    "categorical_probabilities": (lambda: make_mlp(softmax=True),
                                  keras.losses.CategoricalCrossentropy()),
    "categorical_smoothing": (make_mlp, keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=0.1)),
    "huber": (make_mlp, keras.losses.Huber(delta=0.5)),
    "kl_divergence_by_name": (lambda: make_mlp(softmax=True), "kl_divergence"),
    "users_function": (make_mlp, cubic),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_keras_loss_is_exported_with_the_model_and_trains_as_tensorflow(name):
    make_model, loss = LOSSES[name]
    model, ref, mine, theirs = train_both(make_model, loss, lambda: keras.optimizers.SGD(0.5))
    np.testing.assert_allclose(mine, theirs, rtol=1e-5)  # the loss of every step
    assert len(set(theirs)) == STEPS
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        assert max_rel_err(a.numpy(), b.numpy()) <= 1e-5, a.path


def test_the_deployed_graph_of_an_exported_loss_is_the_model_alone():
    model = make_mlp(softmax=True)
    proto, exp = kfront.training_model(model, loss=keras.losses.CategoricalCrossentropy(),
                                       optimizer="sgd:lr=0.1")
    assert [i.name for i in proto.graph.input] == ["x"]
    assert [o.name for o in proto.graph.output] == ["output"]
    assert keras_loss.LOSS_OUTPUT in [o.name for o in proto.training_info[0].algorithm.output]
    import onnxruntime as ort
    x = batches(True)[0][0]
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], model(x).numpy(), atol=1e-6)


def test_adamw_follows_keras_with_variables_excluded_from_weight_decay():
    def make_opt():
        opt = keras.optimizers.AdamW(0.05, weight_decay=0.5, beta_1=0.8, epsilon=1e-6)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, ref, _, _ = train_both(make_mlp, loss, make_opt, one_hot=False)
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        assert max_rel_err(a.numpy(), b.numpy()) <= 1e-5, a.path
    mlp = make_mlp()
    biases = [v.path for v in mlp.trainable_variables if v.path.endswith("/bias")]
    assert kfront.translate_optimizer(make_opt(), mlp) == ngdist.optim.KerasAdamW(
        lr=float(np.float32(0.05)), betas=(0.8, 0.999), eps=1e-6, weight_decay=0.5,
        groups=({"params": biases, "weight_decay": 0.0},))  # (Keras' lr is a float32)
    assert len(biases) == 2
    # the exclusion matters: without it the biases decay and end elsewhere
    plain, _, _, _ = train_both(make_mlp, loss, lambda: keras.optimizers.AdamW(
        0.05, weight_decay=0.5, beta_1=0.8, epsilon=1e-6), one_hot=False)
    assert max(np.abs(a.numpy() - b.numpy()).max() for a, b in
               zip(plain.trainable_variables, ref.trainable_variables)) > 1e-3


KERAS_DECAYED = {  # every optimizer the frontend translates, with Keras' weight_decay
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.8, nesterov=True,
                                                 weight_decay=0.5),
    "sgd": lambda: keras.optimizers.SGD(0.05, weight_decay=0.5),
    "rmsprop_centered_momentum": lambda: keras.optimizers.RMSprop(
        0.01, rho=0.8, momentum=0.5, centered=True, epsilon=1e-4, weight_decay=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05, epsilon=1e-4, weight_decay=0.5),
    "adamax": lambda: keras.optimizers.Adamax(0.01, beta_1=0.8, epsilon=1e-4, weight_decay=0.5),
    "nadam": lambda: keras.optimizers.Nadam(0.01, beta_1=0.8, epsilon=1e-6, weight_decay=0.5),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0, epsilon=1e-6, weight_decay=0.5),
    "adam": lambda: keras.optimizers.Adam(0.01, epsilon=1e-6, weight_decay=0.5),
}


@pytest.mark.parametrize("name", sorted(KERAS_DECAYED))
def test_keras_weight_decay_follows_tensorflow_on_every_optimizer(name):
    """Keras' decoupled decay x <- x - x * wd * lr before the update, the biases excluded
    (exclude_from_weight_decay: a group without it): TensorFlow's step within 1e-5."""
    def make_opt():
        opt = KERAS_DECAYED[name]()
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, ref, _, _ = train_both(make_mlp, loss, make_opt, one_hot=False)
    start = make_mlp()
    for a, b, c in zip(model.trainable_variables, ref.trainable_variables,
                       start.trainable_variables):
        assert max_rel_err(a.numpy() - c.numpy(), b.numpy() - c.numpy()) <= 1e-5, a.path
        assert max_rel_err(a.numpy(), b.numpy()) <= 1e-5, a.path
    got = kfront.translate_optimizer(make_opt(), make_mlp())
    assert got.weight_decay == 0.5 and [g["weight_decay"] for g in got.groups] == [0.0]
    # the decay matters: without it the kernels end elsewhere
    plain, _, _, _ = train_both(make_mlp, loss, lambda: type(make_opt())(
        **{**make_opt().get_config(), "weight_decay": None}), one_hot=False)
    assert max(np.abs(a.numpy() - b.numpy()).max() for a, b in
               zip(plain.trainable_variables, ref.trainable_variables)) > 1e-4


def test_a_loss_tf2onnx_cannot_export_is_refused_with_the_reason():
    def opaque(y_true, y_pred):
        return tf.reduce_mean(tf.py_function(lambda a, b: (a - b) ** 2, [y_true, y_pred],
                                             tf.float32))

    with pytest.raises(GraphError, match=r"^tf2onnx cannot export the loss opaque with the "
                                         r"model \(ops \['EagerPyFunc', 'Rank'\] are not ONNX "
                                         r"ops\); "
                                         r"use SparseCategoricalCrossentropy or "
                                         r"MeanSquaredError, or a loss of TensorFlow ops "
                                         r"tf2onnx converts$"):
        kfront.training_model(make_mlp(), loss=opaque, optimizer="sgd:lr=0.1")
    with pytest.raises(GraphError, match=r"^loss 'mean_squared_eror' is not a Keras loss name"):
        kfront.training_model(make_mlp(), loss="mean_squared_eror", optimizer="sgd:lr=0.1")
