"""ONNX frontend: a forward-only ONNX model + loss + optimizer -> a standard training model.

The result is an ``onnx.ModelProto`` whose ``graph`` is the (untouched) inference graph and whose
``training_info[0].algorithm`` is one training step written with ONNX's own
``ai.onnx.preview.training`` ops: the forward nodes, the loss, one ``Gradient`` node and one
optimizer node (``Momentum`` / ``Adam`` / ``Adagrad``). Parameters keep their initializer names.
"""
from __future__ import annotations

import copy
import difflib
import json
import logging
import os
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ngdist import optim
from ngdist.errors import GraphError, OptionError
from ngdist.frontends.cleanup import fold_static_shapes, probe_feeds, squeezing_splits
from ngdist.frontends.constant_ifs import constant_ifs
from ngdist.frontends.optim_nodes import optimizer_nodes
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.copies import copy_fields, large, put_tensor_data, without_tensor_data
from ngdist.ir.model import IR_VERSION, load_proto

logger = logging.getLogger(__name__)

MIN_OPSET = 18
STEP = "ngdist.step"
LOSSES = {"softmax_cross_entropy": "softmax_cross_entropy", "cross_entropy": "softmax_cross_entropy",
          "mse": "mse", "mean_squared_error": "mse"}
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}


def normalize_forward(model: onnx.ModelProto,
                      probes: Sequence[Mapping[str, np.ndarray]] | None = None
                      ) -> onnx.ModelProto:
    """Opset >= 18, symbolic batch dimension on data inputs, shape computations that do not
    depend on the batch folded (``cleanup.fold_static_shapes``), fresh shape inference.
    Worked on a copy whose large tensors hold no data until the end (each copied once).
    ``probes``: the inputs to fold with, at several batch sizes (``cleanup.batch_feeds`` of
    an example batch); default ``cleanup.probe_feeds``, made from the declared types."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        try:  # (a new model: the caller's stays as it is)
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as exc:
            raise GraphError(f"cannot convert the model from opset {opset} to {MIN_OPSET}: "
                             f"{exc}; export it with opset {MIN_OPSET} or newer") from None
    tensors = {t.name: t for t in model.graph.initializer if large(t)}
    model = without_tensor_data(model, tensors.__contains__)
    model.ir_version = IR_VERSION
    init_names = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in init_names or not inp.type.tensor_type.HasField("shape"):
            continue
        dims = inp.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            dims[0].Clear()
            dims[0].dim_param = "batch"
    for out in model.graph.output:
        dims = out.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            dims[0].Clear()
            dims[0].dim_param = "batch"
    del model.graph.value_info[:]
    squeezing_splits(model)
    folded = fold_static_shapes(model, probe_feeds(model) if probes is None else probes,
                                tensors)
    if folded:
        logger.info("%d shape values and Reshape targets folded to constants", folded)
    constant_ifs(model)
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # inference is a help, not a requirement
        logger.warning("shape inference failed on the forward model: %s", exc)
    put_tensor_data(model.graph, {k: tensors[t.name] for k, t in
                                  enumerate(model.graph.initializer) if t.name in tensors})
    return model


def choose_params(model: onnx.ModelProto, params: list[str] | None,
                  frozen: list[str] | None, buffers: Collection[str] = (),
                  statistics: Collection[str] = ()) -> list[str]:
    """The trained initializers: ``params``, or every float initializer except ``buffers``
    (state the forward pass updates) and ``statistics`` (inference-mode BatchNorm inputs)."""
    inits = {t.name: t for t in model.graph.initializer}
    if params is not None:
        unknown = [p for p in params if p not in inits]
        if unknown:
            raise GraphError(f"params {unknown} are not initializers of the model; it has "
                             f"{sorted(inits)[:20]}")
        clash = [p for p in params if p in buffers]
        if clash:
            raise GraphError(f"params {clash} are running statistics of training-mode "
                             "BatchNormalization (buffers the forward pass updates); they "
                             "cannot also be trained")
        chosen = list(params)
    else:
        chosen = [n for n, t in inits.items() if t.data_type in FLOAT_TYPES
                  and n not in buffers and n not in statistics]
    frozen_set = set(frozen or [])
    unknown = frozen_set - set(inits)
    if unknown:
        raise GraphError(f"frozen names {sorted(unknown)} are not initializers of the model")
    chosen = [p for p in chosen if p not in frozen_set]
    bad = [p for p in chosen if inits[p].data_type not in FLOAT_TYPES]
    if bad:
        raise GraphError(f"params {bad} are not floating-point tensors and cannot be trained")
    if not chosen:
        raise GraphError("the model has no trainable parameters (no float initializers left "
                         "after freezing)")
    return chosen


def _loss_nodes(kind: str | None, output: onnx.ValueInfoProto, labels: str
                ) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto], str]:
    """Loss nodes, the labels input, and the loss value name."""
    if kind is None:
        return [], [], output.name
    if kind not in LOSSES:
        close = difflib.get_close_matches(kind, LOSSES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise OptionError(f"unknown loss {kind!r}; {hint}choose one of {sorted(LOSSES)} or "
                          "None (the model's first output is already the loss)")
    kind = LOSSES[kind]
    dims = output.type.tensor_type.shape.dim
    batch = dims[0].dim_param or dims[0].dim_value if dims else "batch"
    if kind == "softmax_cross_entropy":
        lab = helper.make_tensor_value_info(labels, TensorProto.INT64, [batch or "batch"])
        nodes = [helper.make_node("SoftmaxCrossEntropyLoss", [output.name, labels], ["ngdist.loss"],
                                  name="ngdist/loss", reduction="mean")]
    else:
        shape = [d.dim_param or d.dim_value or None for d in dims] if dims else None
        lab = helper.make_tensor_value_info(labels, output.type.tensor_type.elem_type, shape)
        nodes = [helper.make_node("Sub", [output.name, labels], ["ngdist/loss/diff"],
                                  name="ngdist/loss/sub"),
                 helper.make_node("Mul", ["ngdist/loss/diff", "ngdist/loss/diff"],
                                  ["ngdist/loss/sq"], name="ngdist/loss/square"),
                 helper.make_node("ReduceMean", ["ngdist/loss/sq"], ["ngdist.loss"],
                                  name="ngdist/loss/mean", keepdims=0)]
    return nodes, [lab], "ngdist.loss"


def softmax_output(graph: onnx.GraphProto, output: str) -> onnx.NodeProto | None:
    """The Softmax or LogSoftmax node that computes ``output`` (through Identity nodes)."""
    producers = {o: n for n in graph.node for o in n.output}
    node = producers.get(output)
    while node is not None and node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
        node = producers.get(node.input[0])
    if node is None or node.op_type not in ("Softmax", "LogSoftmax") or \
            node.domain not in ("", "ai.onnx"):
        return None
    return node


def _refuse_softmax_output(graph: onnx.GraphProto, output: str, loss: str) -> None:
    """A cross-entropy loss applies its own softmax: an output that already is a Softmax or
    LogSoftmax (through Identity nodes) would be normalised twice and train something else."""
    node = softmax_output(graph, output)
    if node is None:
        return
    raise GraphError(f"the model's output {output!r} is already a {node.op_type} (node "
                     f"{node.name!r}), and loss={loss!r} applies a softmax itself, so training "
                     f"would apply it twice: remove the {node.op_type} from the model so that it "
                     "outputs logits (or pass output= naming the logits), or pass loss=None with "
                     "an explicit loss graph whose first output is the loss")


def _refuse_labels_name(graph: onnx.GraphProto, labels: str, init_names: set[str]) -> None:
    """The labels input is a new name: not an input, initializer, output or node value."""
    if labels in {o.name for o in graph.output}:
        what = "output"
    elif labels in {i.name for i in graph.input} | init_names:
        what = "input"
    elif labels in {o for n in graph.node for o in n.output}:
        what = "value"
    else:
        return
    raise GraphError(f"the labels input {labels!r} has the name of a model {what} "
                     f"({labels!r}); pass labels= another name (ngdist rewrite/train: --labels), "
                     "e.g. labels='labels'")


def batchnorm_statistics(graph: onnx.GraphProto
                         ) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Running mean/variance initializers of BatchNormalization nodes: for training mode,
    name -> (node index, output index of its new value); for inference mode, a list."""
    inits = {t.name for t in graph.initializer}
    running: dict[str, tuple[int, int]] = {}
    fixed: list[str] = []
    for idx, node in enumerate(graph.node):
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or \
                len(node.input) < 5:
            continue
        training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        for k, name in ((1, node.input[3]), (2, node.input[4])):
            if name not in inits:
                continue
            if not training:
                fixed.append(name)
            elif name in running:
                raise GraphError(f"running statistic {name!r} is updated by two "
                                 "BatchNormalization nodes; give each node its own")
            else:
                running[name] = (idx, k)
    return running, fixed


def _wire_buffers(nodes: list[onnx.NodeProto], running: dict[str, tuple[int, int]],
                  explicit: dict[str, str]) -> dict[str, str]:
    """Buffer name -> the step value holding its new value (BatchNorm outputs added if absent)."""
    out = dict(explicit)
    for name, (idx, k) in running.items():
        if name in out:
            continue
        node = nodes[idx]
        while len(node.output) < 3:
            node.output.append("")
        if not node.output[k]:
            node.output[k] = f"{name}.new"
        out[name] = node.output[k]
    return out


def _eval_mode(graph: onnx.GraphProto, running: dict[str, tuple[int, int]]) -> None:
    """The deployable graph normalizes with the running statistics (training_mode=0)."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for idx in sorted({idx for idx, _ in running.values()}):
        node = graph.node[idx]
        if any(o and o in used for o in node.output[1:]):
            logger.warning("BatchNormalization '%s': its running statistics are read by other "
                           "nodes; the inference graph keeps training mode", node.name)
            continue
        del node.output[1:]
        for a in node.attribute:
            if a.name == "training_mode":
                a.i = 0


def build_training_model(forward: onnx.ModelProto | str | os.PathLike, *,
                         optimizer: optim.Optimizer | str,
                         loss: str | None = "softmax_cross_entropy", labels: str = "y",
                         params: list[str] | None = None, frozen: list[str] | None = None,
                         output: str | None = None, buffers: dict[str, str] | None = None,
                         probes: Sequence[Mapping[str, np.ndarray]] | None = None
                         ) -> onnx.ModelProto:
    """Forward model -> training model (TrainingInfoProto with Gradient + optimizer op).

    The running mean/variance of training-mode BatchNormalization nodes become buffers: never
    trained, updated each step from the node's running_mean/running_var outputs through
    ``update_binding``; ``model.graph`` uses them in inference mode. ``buffers`` maps further
    initializers (or a BatchNorm statistic, to override) to the step value that updates them.
    ``probes``: see ``normalize_forward``.
    """
    if not isinstance(forward, onnx.ModelProto):
        forward = load_proto(forward)
    if forward.training_info:
        raise GraphError("the model already holds a training_info; load it with "
                         "ngdist.compile(path) without loss/optimizer, or strip it first")
    opt = optim.from_spec(optimizer)
    model = normalize_forward(forward, probes)
    g = model.graph
    running, fixed_stats = batchnorm_statistics(g)
    explicit = dict(buffers or {})
    unknown = [b for b in explicit if b not in {t.name for t in g.initializer}]
    if unknown:
        raise GraphError(f"buffers {unknown} are not initializers of the model")
    chosen = choose_params(model, params, frozen, {*running, *explicit}, fixed_stats)
    outputs = {o.name: o for o in g.output}
    if not outputs:
        raise GraphError("the model has no outputs; ngdist trains the loss computed from its "
                         "first output (the logits), so the graph must declare one")
    out_name = output or g.output[0].name
    if out_name not in outputs:
        raise GraphError(f"output {out_name!r} is not an output of the model "
                         f"(outputs: {list(outputs)})")
    if isinstance(loss, str) and LOSSES.get(loss) == "softmax_cross_entropy":
        _refuse_softmax_output(g, out_name, loss)
    init_names = {t.name for t in g.initializer}
    data_inputs = [copy.deepcopy(i) for i in g.input if i.name not in init_names]
    if loss is not None:
        _refuse_labels_name(g, labels, init_names)
    loss_nodes, label_inputs, loss_name = _loss_nodes(loss, outputs[out_name], labels)

    inits = {t.name: t for t in g.initializer}
    grads = [f"{p}.grad" for p in chosen]
    nodes = [copy.deepcopy(n) for n in g.node]
    buffer_values = _wire_buffers(nodes, running, explicit)
    _eval_mode(g, running)
    nodes += loss_nodes
    nodes.append(helper.make_node("Gradient", chosen, grads, name="ngdist/gradient",
                                  domain=PREVIEW_TRAINING, xs=chosen, y=loss_name))
    update = optimizer_nodes(opt, chosen, inits, STEP)
    states = [numpy_helper.from_array(np.array(0, np.int64), STEP), *update.initializers]
    nodes += update.nodes
    nodes.append(helper.make_node("Constant", [], ["ngdist/step_one"], name="ngdist/step_one",
                                  value=numpy_helper.from_array(np.array(1, np.int64))))
    nodes.append(helper.make_node("Add", [STEP, "ngdist/step_one"], [f"{STEP}.new"],
                                  name="ngdist/step_inc"))
    alg_outputs = [helper.make_tensor_value_info(loss_name, TensorProto.UNDEFINED, None)]
    alg_outputs += [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
                    for n in [*update.outputs, f"{STEP}.new", *buffer_values.values()]]
    info = model.training_info.add()
    info.algorithm.CopyFrom(helper.make_graph(nodes, "ngdist_step", data_inputs + label_inputs,
                                              alg_outputs))
    info.algorithm.initializer.extend(states)  # copied once (the optimizer state's size)
    del states, update.initializers[:]
    binding = dict(update.binding)
    binding[STEP] = f"{STEP}.new"
    binding.update(buffer_values)
    for k, v in binding.items():
        kv = info.update_binding.add()
        kv.key, kv.value = k, v
    model.opset_import.append(helper.make_opsetid(PREVIEW_TRAINING, 1))
    roles = dict(update.roles)
    roles[STEP] = "state"
    roles.update({b: "buffer" for b in buffer_values})
    helper.set_model_props(model, {"ngdist.roles": json.dumps(roles), "ngdist.loss": loss_name})
    return model


def use_inference_graph(model: onnx.ModelProto, ev: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ``ev``'s graph (the eval-mode export, or the model without the loss a
    frontend exported into the training graph) as its graph, keeping every initializer the
    step reads: a fresh model, built field by field (changed in place, ``model`` would keep
    its old graph's data beside the new one: a protobuf message keeps all it ever held)."""
    g = model.graph
    eval_inits = {t.name for t in ev.graph.initializer}
    inits = {t.name: t for t in g.initializer}
    inputs = {i.name: i for i in g.input}  # keep the symbolic batch axis of the training graph
    out = copy_fields(model, onnx.ModelProto(), ("graph",))
    graph = copy_fields(ev.graph, out.graph, ("initializer", "input"))
    graph.initializer.extend(inits.get(t.name, t) for t in ev.graph.initializer)
    graph.initializer.extend(t for t in g.initializer if t.name not in eval_inits)
    graph.input.extend(inputs.get(i.name, i) for i in ev.graph.input)
    return out
