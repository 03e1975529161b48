"""Keras / TensorFlow frontend: Keras model -> standard ONNX training model -> ngdist trainer.

Export goes through ``tf2onnx.convert.from_function`` (``from_keras`` fails on Keras 3) on
``model(x, training=False)`` at opset <= 18. tf2onnx freezes variables into constants and
renames, transposes (Conv kernels HWIO -> OIHW), fuses (BiasAdd into Conv) or drops them (an
all-zero bias is optimised away). To find every variable again, the frontend gives each float
variable unique random values for the duration of the export, then looks for each initializer
among the variables up to a transpose and/or reshape, puts the true values back (in ONNX
layout) and names the initializer after the variable's path (``sequential/dense/kernel``).
``trainer.to_keras(model)`` applies the inverse transforms and assigns the trained values.

Supported: layers whose training-mode and inference-mode computations coincide (Dense,
Conv, pooling, activations, Flatten/Reshape, Embedding, LayerNormalization, ...). Dropout
exports as a no-op (a warning says so). A *trainable* BatchNormalization is refused: tf2onnx
folds gamma, beta and the moving statistics into new constants, so gamma and beta have no
counterpart left in the graph (a frozen one, ``trainable=False``, is fine).

Losses: ``SparseCategoricalCrossentropy`` (``from_logits=True``, or ``False`` on a model whose
output is a Softmax: the Softmax's input becomes the logits for training, the inference graph
keeps the probabilities) and ``MeanSquaredError`` are ngdist's own loss nodes; any other Keras
loss or function of ``(y_true, y_pred)`` is exported with the model (keras_loss.py).
Optimizers: ``keras.optimizers.SGD``
(momentum, Nesterov) and ``Adam`` map exactly onto ONNX Momentum and Adam (Keras' Adam, like
ONNX's, adds epsilon after the bias correction is folded into the learning rate);
``Adadelta`` is torch's formula, ``Nadam`` torch's NAdam with ``momentum_decay=1``, and
``RMSprop``, ``Adagrad``, ``Adamax`` have formulas of their own (``ngdist.optim.KerasRMSprop``,
``KerasAdagrad``, ``KerasAdamax``: epsilon where Keras puts it); ``Adam``/``AdamW`` with
Keras' decoupled ``weight_decay`` are ``KerasAdamW``, whose variables excluded from the decay
(``exclude_from_weight_decay``) form a parameter group without it. Weight decay on other
optimizers, gradient clipping, EMA, AMSGrad and learning-rate schedules are refused.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ngdist import optim
from ngdist.errors import ArgumentError, GraphError
from ngdist.frontends import keras_loss
from ngdist.frontends.renames import rename_graph
from ngdist.frontends.keras_loss import translate_loss  # noqa: F401  (the frontend's API)
from ngdist.frontends.keras_optim import translate_optimizer
from ngdist.ir.writeback import WriteBack

logger = logging.getLogger(__name__)

OPSET = 18
_UNSET: Any = object()
_GENERATED = re.compile(r"__\d+")  # tf2onnx's numbered names: Transpose__36, const_axes__28


def _tf() -> tuple[Any, Any, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import keras
        import tensorflow as tf
        import tf2onnx
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the Keras frontend needs tensorflow and tf2onnx: "
                          "pip install 'ngdist[tensorflow]'") from exc
    return tf, keras, tf2onnx


def is_module(obj: Any) -> bool:
    """True for a Keras model or layer, without importing TensorFlow."""
    return any(c.__name__ in ("Layer", "Model") and c.__module__.split(".")[0] in ("keras",
                                                                                   "tf_keras")
               for c in type(obj).__mro__)


@dataclass
class VariableLink:
    """How an ONNX initializer holds a Keras variable: onnx = reshape(transpose(var, perm))."""

    path: str
    perm: tuple[int, ...]
    shape: tuple[int, ...]
    trainable: bool

    def to_onnx(self, value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.transpose(value, self.perm)).reshape(self.shape)

    def to_keras(self, value: np.ndarray, var_shape: tuple[int, ...]) -> np.ndarray:
        transposed = tuple(var_shape[p] for p in self.perm)
        return np.transpose(value.reshape(transposed), np.argsort(self.perm))


@dataclass
class KerasExport:
    model: onnx.ModelProto
    input_names: list[str]
    output_names: list[str]
    links: dict[str, VariableLink] = field(default_factory=dict)  # onnx name -> variable


# --------------------------------------------------------------------------- export

def _input_specs(model: Any, example_inputs: Any, names: Sequence[str] | None) -> list[Any]:
    tf, _, _ = _tf()
    if example_inputs is not None:
        items = example_inputs if isinstance(example_inputs, (tuple, list)) else [example_inputs]
        shapes = [(None, *np.shape(x)[1:]) for x in items]
        dtypes = [tf.as_dtype(np.asarray(x).dtype) for x in items]
    else:
        try:
            inputs = model.inputs
        except (AttributeError, ValueError):
            inputs = None
        if not inputs:
            raise ArgumentError("the Keras model has no defined inputs; pass example_inputs "
                             "(one example batch)")
        shapes = [(None, *tuple(x.shape)[1:]) for x in inputs]
        dtypes = [tf.as_dtype(x.dtype) for x in inputs]
    if names is None:
        names = ["x"] if len(shapes) == 1 else [f"x{i}" for i in range(len(shapes))]
    if len(names) != len(shapes):
        raise ArgumentError(f"{len(names)} input names for {len(shapes)} model inputs")
    return [tf.TensorSpec(s, d, name=n) for s, d, n in zip(shapes, dtypes, names)]


def _match(arr: np.ndarray, marked: dict[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    hits = []
    for path, v in marked.items():
        if v.size != arr.size or v.dtype != arr.dtype:
            continue
        for perm in itertools.permutations(range(v.ndim)):
            if np.array_equal(np.transpose(v, perm).reshape(arr.shape), arr):
                hits.append((path, perm))
                break
    return hits


def _check_layers(model: Any, keras: Any) -> None:
    """Refuses trainable BatchNormalization layers (tf2onnx folds them); warns of Dropout."""
    trainable_bn = [layer.name for layer in _layers(model)
                    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]
    if trainable_bn:
        raise GraphError(f"trainable Keras BatchNormalization layers {trainable_bn} cannot be "
                         "trained through tf2onnx (it folds gamma, beta and the moving "
                         "statistics into new constants); set layer.trainable = False, remove "
                         "them, or use the PyTorch frontend")
    if any(isinstance(layer, keras.layers.Dropout) for layer in _layers(model)):
        logger.warning("Keras Dropout layers export as no-ops: ngdist trains this model "
                       "without dropout")


def _convert_marked(tf2onnx: Any, fn: Any, specs: list[Any], opset: int, variables: list[Any],
                    original: list[np.ndarray], loss: Any
                    ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``fn`` converted by tf2onnx while every float variable holds a value of its own
    (nothing is folded away as 0/1, and each initializer matches one variable); the values
    are put back after. Returns the proto and variable path -> the value it held."""
    rng = np.random.default_rng(20240607)
    marked = {}
    try:
        for v in variables:
            val = (rng.standard_normal(v.shape) + 3.0).astype(original[0].dtype)
            v.assign(val)
            marked[v.path] = val
        try:
            proto, _ = tf2onnx.convert.from_function(fn, input_signature=specs, opset=opset)
        except Exception as exc:  # noqa: BLE001 - tf2onnx raises anything; say what failed
            if loss is None:
                raise
            raise keras_loss.not_exported(loss, f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        for v, val in zip(variables, original):
            v.assign(val)
    return proto, marked


def _link_variables(exp: KerasExport, variables: list[Any], original: list[np.ndarray],
                    marked: dict[str, np.ndarray]) -> None:
    """Links each float initializer to the variable whose marked value it holds (possibly
    transposed) and gives it that variable's real value."""
    by_path = {v.path: (v, val) for v, val in zip(variables, original)}
    for t in exp.model.graph.initializer:
        arr = numpy_helper.to_array(t)
        if arr.dtype.kind != "f":
            continue
        hits = _match(arr, marked)
        if len(hits) > 1:
            raise GraphError(f"initializer {t.name!r} matches several variables "
                             f"{[h[0] for h in hits]}")
        if hits:
            path, perm = hits[0]
            var, value = by_path[path]
            exp.links[t.name] = VariableLink(path, perm, tuple(arr.shape), bool(var.trainable))
            t.CopyFrom(numpy_helper.from_array(exp.links[t.name].to_onnx(value), t.name))


def export(model: Any, example_inputs: Any = None, *, input_names: Sequence[str] | None = None,
           opset: int = OPSET, loss: Any = None, labels: str = "y") -> KerasExport:
    """Converts ``model(x, training=False)`` and links every initializer to its variable.
    With ``loss`` (a Keras loss or a function of ``(y_true, y_pred)``), the graph is that
    loss of the model's output against an input named ``labels``, its one output
    ``keras_loss.LOSS_OUTPUT`` (frontends/keras_loss.py)."""
    tf, keras, tf2onnx = _tf()
    if opset > OPSET:
        raise ArgumentError(f"tf2onnx supports opset <= {OPSET} here; got {opset}")
    _check_layers(model, keras)
    specs = _input_specs(model, example_inputs, input_names)
    n_in = len(specs)

    def forward(*xs: Any) -> Any:
        return model(xs[0] if n_in == 1 else list(xs[:n_in]), training=False)

    if loss is not None:
        specs.append(keras_loss.label_spec(loss, forward, specs, labels))
    variables = [v for v in model.variables if np.dtype(v.dtype).kind == "f"]
    original = [v.numpy() for v in variables]
    fn = tf.function(forward if loss is None else keras_loss.loss_function(loss, forward))
    proto, marked = _convert_marked(tf2onnx, fn, specs, opset, variables, original, loss)
    if loss is not None:
        keras_loss.check_ops(loss, proto)
    exp = KerasExport(proto, [s.name for s in specs], [])
    _link_variables(exp, variables, original, marked)
    _check_links(model, exp, marked)
    rename_graph(proto.graph, {old: link.path for old, link in exp.links.items()})
    exp.links = {link.path: link for link in exp.links.values()}
    # the loss graph's constants are its own (the deployed graph's const/N are other values)
    _canonical_names(proto.graph, set(exp.links), "" if loss is None else "ngdist.loss/")
    outs = [o.name for o in proto.graph.output]
    exp.output_names = ["output"] if len(outs) == 1 else [f"output{i}" for i in range(len(outs))]
    if loss is not None:
        exp.input_names = exp.input_names[:n_in]
        exp.output_names = [keras_loss.LOSS_OUTPUT]
        keras_loss.share_batch_axis(proto.graph, exp.input_names[0], labels)
    rename_graph(proto.graph, dict(zip(outs, exp.output_names)))
    logger.info("exported Keras model %s: %d nodes, %d linked variables", model.name,
                len(proto.graph.node), len(exp.links))
    return exp


def _canonical_names(graph: onnx.GraphProto, keep: set[str], prefix: str = "") -> None:
    """Makes the names tf2onnx generates independent of the process.

    tf2onnx merges equal constants under whichever name a hash-ordered set yields first and
    numbers generated nodes (``Transpose__36``) in an order that varies between processes,
    but every rank must hold the same graph. Constants are renamed by first use
    (``const/0``, ...) and ordered that way; generated value and node names get their
    numbers from their position in the graph.
    """
    inits = {t.name: t for t in graph.initializer}
    order: list[str] = []
    for node in graph.node:
        order.extend(i for i in node.input if i in inits and i not in order)
    order += [n for n in sorted(inits) if n not in order]
    renames = {n: f"{prefix}const/{i}" for i, n in enumerate(n for n in order if n not in keep)}
    fixed = {o.name for o in graph.output} | {i.name for i in graph.input} | keep
    counter = itertools.count()
    for node in graph.node:
        for out in node.output:
            if out and out not in fixed and _GENERATED.search(out):
                renames[out] = _GENERATED.sub("", out.split(":")[0]) + f"__g{next(counter)}"
        if _GENERATED.search(node.name):
            node.name = _GENERATED.sub("", node.name) + f"__g{next(counter)}"
    rename_graph(graph, renames)
    ordered = [inits[n] for n in order]
    del graph.initializer[:]
    graph.initializer.extend(ordered)
    del graph.value_info[:]  # re-inferred by the ONNX frontend


def _layers(model: Any) -> list[Any]:
    out, stack = [], [model]
    while stack:
        layer = stack.pop()
        out.append(layer)
        stack.extend(getattr(layer, "layers", []) or [])
    return out


def _check_links(model: Any, exp: KerasExport, marked: dict[str, np.ndarray]) -> None:
    counts: dict[str, int] = {}
    for link in exp.links.values():
        counts[link.path] = counts.get(link.path, 0) + 1
    twice = [p for p, c in counts.items() if c > 1 and
             any(lk.trainable for lk in exp.links.values() if lk.path == p)]
    if twice:
        raise GraphError(f"tf2onnx emitted several copies of the trainable variables {twice}; "
                         "ngdist cannot keep the copies equal while training")
    missing = [v.path for v in model.trainable_variables
               if np.dtype(v.dtype).kind == "f" and v.path not in counts]
    if missing:
        raise GraphError(f"trainable variables {missing} have no counterpart in the exported "
                         "ONNX graph (tf2onnx folded them into other constants, or the model "
                         "does not use them); freeze them (trainable=False) to train the rest")


# --------------------------------------------------------------------------- translation

# --------------------------------------------------------------------------- training model

def training_model(model: Any, example_inputs: Any = None, *, loss: Any = _UNSET,
                   labels: str = "y", optimizer: Any = _UNSET,
                   input_names: Sequence[str] | None = None,
                   frozen: Sequence[str] | None = None) -> tuple[onnx.ModelProto, KerasExport]:
    """The standard ONNX training model of a Keras model (its compiled loss/optimizer if unset)."""
    from ngdist.frontends.onnx import build_training_model, use_inference_graph

    if loss is _UNSET:
        loss = getattr(model, "loss", None) or "sparse_categorical_crossentropy"
    if optimizer is _UNSET:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is _UNSET or optimizer is None:
        raise optim.missing_optimizer(
            f"Keras model {model.name!r}", ", a Keras optimizer such as "
            "keras.optimizers.SGD(0.01) (here or in model.compile),")
    exp = export(model, example_inputs, input_names=input_names)
    proto = exp.model
    kind, target = keras_loss.translate_loss(loss, proto, exp.output_names[0])
    if isinstance(optimizer, (str, *optim.OPTIMIZERS)):
        opt = optim.from_spec(optimizer)
    else:
        opt = translate_optimizer(optimizer, model)
    frozen_set = set(frozen or [])
    params = [n for n, lk in exp.links.items() if lk.trainable and n not in frozen_set]
    if kind is keras_loss.EXPORTED:  # the loss goes into the training graph through tf2onnx
        train = export(model, example_inputs, input_names=input_names, loss=loss,
                       labels=labels)
        result = build_training_model(train.model, loss=None, labels=labels, optimizer=opt,
                                      params=params, output=keras_loss.LOSS_OUTPUT)
        result = use_inference_graph(result, proto)
        return result, exp
    extra = target != exp.output_names[0]
    if extra:  # train on the Softmax's input; the deployed graph keeps the probabilities
        proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(target))
    result = build_training_model(proto, loss=kind, labels=labels, optimizer=opt,
                                  params=params, output=target)
    if extra:
        for graph in (proto.graph, result.graph):
            keep = [o for o in graph.output if o.name != target]
            del graph.output[:]
            graph.output.extend(keep)
    return result, exp


# --------------------------------------------------------------------------- write-back

def to_keras(values: Mapping[str, np.ndarray], model: Any, exp: KerasExport) -> Any:
    """Assigns trained ``values`` (a trainer's state_dict) to the Keras variables they came
    from, undoing the export's transposes and reshapes."""
    variables = {v.path: v for v in model.variables}
    for name, link in exp.links.items():
        if name in values and link.path in variables:
            var = variables[link.path]
            var.assign(link.to_keras(values[name], tuple(var.shape)).astype(var.dtype))
    return model


def build(model: Any, example_inputs: Any = None, *, loss: Any = _UNSET, labels: str = "y",
          optimizer: Any = _UNSET, input_names: Sequence[str] | None = None,
          output_names: Sequence[str] | None = None, frozen: Sequence[str] | None = None
          ) -> tuple[onnx.ModelProto, WriteBack]:
    """Export a Keras model: its training model and the write-back ``trainer.to_keras`` calls.

    ``to_keras(model=None)`` writes the trained weights back (into ``model``, by default the
    one compiled). ``output_names`` is for torch modules; a Keras model names its outputs.
    """
    if output_names is not None:
        raise GraphError("output_names= is for torch modules; tf2onnx names a Keras model's "
                         "outputs itself")
    proto, exp = training_model(model, example_inputs, loss=loss, labels=labels,
                                optimizer=optimizer, input_names=input_names, frozen=frozen)

    def write(values: Mapping[str, np.ndarray], steps_done: int, /, target: Any = None) -> Any:
        return to_keras(values, model if target is None else target, exp)

    return proto, WriteBack("keras", write, exp)
