"""The loss of a Keras model: one of ngdist's loss nodes, or exported with the model.

``SparseCategoricalCrossentropy`` and ``MeanSquaredError`` (objects or names) become ngdist's
``softmax_cross_entropy`` and ``mse`` nodes. Any other Keras loss (``CategoricalCrossentropy``,
``Huber``, ``KLDivergence``..., or its name) and any function of ``(y_true, y_pred)`` is
``EXPORTED``: tf2onnx converts ``loss(labels, model(x, training=False))`` as one graph whose
output is ``LOSS_OUTPUT`` (keras.py ``export(loss=...)``), so the training step computes
exactly what Keras computes, reduction included. The labels input of an exported loss is
shaped like the model's output and of its type, or, for a sparse loss (its name says
``sparse``), integer class indices: the output's shape without its last axis.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnx

from ngdist.errors import GraphError

LOSS_OUTPUT = "ngdist.loss"  # the exported loss graph's one output
EXPORTED = "exported"  # translate_loss's kind for a loss exported with the model
_BUILTIN = {"SparseCategoricalCrossentropy": "softmax_cross_entropy",
            "sparse_categorical_crossentropy": "softmax_cross_entropy",
            "MeanSquaredError": "mse", "mean_squared_error": "mse", "mse": "mse",
            "softmax_cross_entropy": "softmax_cross_entropy",
            "cross_entropy": "cross_entropy"}


def describe(loss: Any) -> str:
    """A loss's name for messages."""
    return loss if isinstance(loss, str) else getattr(loss, "__name__", type(loss).__name__)


def _softmax_logits(proto: onnx.ModelProto, output: str) -> str | None:
    producer = next((n for n in proto.graph.node if output in n.output), None)
    if producer is None or producer.op_type != "Softmax":
        return None
    return producer.input[0]


def translate_loss(loss: Any, proto: onnx.ModelProto, output: str) -> tuple[str | None, str]:
    """(ngdist loss name or ``EXPORTED``, the value it applies to): Keras loss object, name or
    function."""
    import keras

    if loss is None:
        return None, output
    config: dict[str, Any] = {}
    if isinstance(loss, keras.losses.Loss):
        config = loss.get_config()
        name = type(loss).__name__
    elif isinstance(loss, str):
        name = loss
    elif callable(loss):
        return EXPORTED, output
    else:
        raise GraphError(f"loss {loss!r} is not a Keras loss, a loss name or a function of "
                         "(y_true, y_pred)")
    kind = _BUILTIN.get(name)
    if kind is None or config.get("ignore_class") is not None:
        if isinstance(loss, str):
            _keras_loss(loss)  # an unknown name is refused here
        return EXPORTED, output
    if kind != "softmax_cross_entropy" or config.get("from_logits", False) or \
            name == "softmax_cross_entropy":
        return kind, output
    logits = _softmax_logits(proto, output)
    if logits is None:
        raise GraphError("SparseCategoricalCrossentropy(from_logits=False) needs a model "
                         "whose output is a Softmax; make the model output logits and use "
                         "from_logits=True")
    return "softmax_cross_entropy", logits


def _keras_loss(name: str) -> Callable[..., Any]:
    import keras

    try:
        return keras.losses.get(name)  # type: ignore[no-any-return]
    except ValueError:
        raise GraphError(f"loss {name!r} is not a Keras loss name; pass a keras.losses "
                         "object or a function of (y_true, y_pred)") from None


def loss_function(loss: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    """The function tf2onnx converts: inputs, then labels -> the loss of the model's output,
    averaged as ``model.compile`` averages a function's per-sample losses (a Loss object's
    scalar is left as it is)."""
    import tensorflow as tf

    fn = _keras_loss(loss) if isinstance(loss, str) else loss

    def compute(*xs: Any) -> Any:
        return tf.reduce_mean(fn(xs[-1], forward(*xs[:-1])))

    return compute


def label_spec(loss: Any, forward: Callable[..., Any], specs: Sequence[Any], labels: str
               ) -> Any:
    """The ``tf.TensorSpec`` of the labels input of an exported loss (module docstring)."""
    import tensorflow as tf

    out = forward(*[tf.zeros((1, *s.shape[1:]), s.dtype) for s in specs])
    if isinstance(out, (list, tuple)):
        raise GraphError("an exported Keras loss needs a model with one output; this one "
                         f"has {len(out)}")
    shape = tuple(out.shape)[1:]
    if "sparse" in describe(loss).lower():
        return tf.TensorSpec((None, *shape[:-1]), tf.int64, name=labels)
    return tf.TensorSpec((None, *shape), out.dtype, name=labels)


def share_batch_axis(graph: onnx.GraphProto, first_input: str, labels: str) -> None:
    """The labels' first axis named as the first input's: one batch size (tf2onnx names each
    unknown axis apart)."""
    dims = {i.name: i.type.tensor_type.shape.dim for i in graph.input}
    if first_input in dims and labels in dims and dims[first_input] and dims[labels]:
        dims[labels][0].CopyFrom(dims[first_input][0])


def not_exported(loss: Any, why: str) -> GraphError:
    """The error of a loss tf2onnx does not turn into ONNX ops."""
    return GraphError(f"tf2onnx cannot export the loss {describe(loss)} with the model ({why}); "
                      "use SparseCategoricalCrossentropy or MeanSquaredError, or a loss of "
                      "TensorFlow ops tf2onnx converts")


def check_ops(loss: Any, proto: onnx.ModelProto) -> None:
    """A GraphError when the exported loss graph holds ops ONNX does not define (tf2onnx keeps
    what it cannot convert, e.g. a ``tf.py_function``, as a custom op)."""
    unknown = sorted({n.op_type for n in proto.graph.node
                      if not onnx.defs.has(n.op_type, n.domain)})
    if unknown:
        raise not_exported(loss, f"ops {unknown} are not ONNX ops")
