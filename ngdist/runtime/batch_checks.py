"""Checks of a batch against the model before a training step runs: every input with one row
per sample along axis 0 (or a whole number of rows per sample: per-token rows), labels of
softmax_cross_entropy that are class ids in range (their number of classes from the step
graph, or from shape inference with the batch's shapes), shapes that fit the model's inputs.
Each failure is an InputError that says what to change."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from ngdist.errors import InputError

logger = logging.getLogger(__name__)

def shape_str(dims) -> str:
    return "[" + ", ".join(d.dim_param or str(d.dim_value) if (d.dim_param or d.HasField("dim_value"))
                           else "?" for d in dims) + "]"


def leaf_sizes(batch: Any, prefix: str = "") -> dict[str, int]:
    """Axis-0 size of every array of a (nested) batch, by a readable name ('x', '[1]')."""
    if isinstance(batch, Mapping):
        out: dict[str, int] = {}
        for k, v in batch.items():
            out.update(leaf_sizes(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(batch, (tuple, list)):
        out = {}
        for i, v in enumerate(batch):
            out.update(leaf_sizes(v, f"{prefix}[{i}]"))
        return out
    shape = np.shape(batch)
    return {prefix or "batch": shape[0]} if shape else {}


def _differ(what: str, sizes: Mapping[str, int], a: str, b: str) -> InputError:
    first, second = (a, b) if list(sizes).index(a) < list(sizes).index(b) else (b, a)
    return InputError(f"{what}'s inputs differ in size along axis 0: '{first}' has "
                      f"{sizes[first]} samples, '{second}' has {sizes[second]}; every input of "
                      "a batch needs one row per sample")


def check_same_size(sizes: Mapping[str, int], what: str) -> None:
    """Every array holds the same number of rows (one per sample)."""
    items = list(sizes.items())
    for name, n in items[1:]:
        if n != items[0][1]:
            raise _differ(what, sizes, items[0][0], name)


def batch_samples(sizes: Mapping[str, int], what: str) -> int:
    """The number of samples of a batch whose arrays have ``sizes`` rows: the smallest size.
    Every other size is a whole multiple of it: k rows per sample (per-token rows, e.g. the
    flattened labels ``ids[:, 1:].reshape(-1)`` of a language model), in sample order."""
    if not sizes:
        return 1
    smallest = min(sizes, key=sizes.__getitem__)
    n = sizes[smallest]
    for name, rows in sizes.items():
        if rows % n if n else rows:
            raise _differ(what, sizes, smallest, name)
    return n


def sample_rows(rows: int, samples: int, lo: int, hi: int) -> slice:
    """The rows of samples ``lo:hi`` in an array of ``rows`` rows for ``samples`` samples
    (``rows // samples`` consecutive rows per sample)."""
    k = rows // samples if samples else 1
    return slice(k * lo, k * hi)


def label_checks(graph: onnx.GraphProto, data_inputs: Mapping[str, Any],
                  inference: onnx.ModelProto) -> dict[str, tuple[str, int | None, int | None]]:
    """Data input holding the labels of a SoftmaxCrossEntropyLoss -> (its scores, its
    ignore_index, the number of classes when the step graph or the model knows it: axis 1 of
    the scores, the last dimension of an (N, C) output)."""
    producers = {o: n for n in graph.node for o in n.output}
    shapes = {v.name: v.type.tensor_type for v in
              [*graph.value_info, *graph.output, *graph.input, *inference.graph.output,
               *inference.graph.value_info]}
    checks: dict[str, tuple[str, int | None, int | None]] = {}
    for node in graph.node:
        if node.op_type != "SoftmaxCrossEntropyLoss" or len(node.input) < 2:
            continue
        name = node.input[1]
        while name not in data_inputs and name in producers and \
                producers[name].op_type in ("Identity", "Cast", "Reshape", "Squeeze", "Flatten"):
            name = producers[name].input[0]
        if name not in data_inputs:
            continue
        ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
        tt = shapes.get(node.input[0])
        dims = tt.shape.dim if tt is not None and tt.HasField("shape") else []
        classes = dims[1].dim_value if len(dims) > 1 and dims[1].HasField("dim_value") else None
        checks[name] = (node.input[0], ignore, classes or None)
    return checks


def check_label_values(name: str, raw: np.ndarray, arr: np.ndarray | None, scores: str,
                        ignore_index: int | None, classes: int | None) -> None:
    """Labels of softmax_cross_entropy are class ids: integers in [0, classes), or the loss's
    ignore_index. ``arr is None``: only the values before the cast (integer-valued)."""
    what = f"labels '{name}' of softmax_cross_entropy"
    if arr is None:
        if raw.dtype.kind in "fc" and raw.size:
            bad = ~np.isfinite(raw) | (raw != np.round(raw))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InputError(f"{what} must be integer class ids; value {raw.flat[i].item()} "
                                 f"(flat index {i}) is not: pass the class index of each "
                                 "sample (e.g. y.astype(np.int64)), not one-hot vectors or "
                                 "probabilities")
        return
    if not arr.size:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo >= 0 and (classes is None or hi < classes):
        return
    valid = arr >= 0 if classes is None else (arr >= 0) & (arr < classes)
    if ignore_index is not None:
        valid |= arr == ignore_index
    if valid.all():
        return
    i = int(np.flatnonzero(~valid)[0])
    v = int(arr.flat[i])
    allowed = f"in [0, {classes})" if classes is not None else "0 or more"
    ignore = (f"the loss ignores only {ignore_index}" if ignore_index is not None
              else "the loss has no ignore_index")
    if v < 0:
        raise InputError(f"{what} hold {v} (flat index {i}); class ids must be {allowed} and "
                         f"{ignore}: fix the labels, or give the loss an ignore_index for "
                         "samples to skip")
    raise InputError(f"{what} hold {v} (flat index {i}), but the model's output '{scores}' has "
                     f"{classes} classes: class ids must be {allowed}; fix the labels or give "
                     f"the model {v + 1} or more outputs")


def infer_classes(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]],
                   scores: Mapping[str, str]) -> dict[str, int | None]:
    """labels -> axis 1 of their scores, by shape inference of ``model``'s graph with concrete
    input shapes; float initializers become shaped inputs (their values are not needed)."""
    g = model.graph
    graph = onnx.GraphProto(name=g.name)
    graph.node.extend(g.node)
    inits = {t.name for t in g.initializer}
    for inp in g.input:
        if inp.name in inits:
            continue
        shape = shapes.get(inp.name)
        graph.input.append(onnx.helper.make_tensor_value_info(
            inp.name, inp.type.tensor_type.elem_type, list(shape) if shape is not None else None))
    for t in g.initializer:
        if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):  # shapes, axes
            graph.initializer.append(t)
        else:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    graph.output.extend(g.output)
    probe = onnx.helper.make_model(graph, opset_imports=model.opset_import,
                                   ir_version=model.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True).graph
    except Exception as exc:  # the check is a help: without the classes it checks less
        logger.debug("shape inference for the label check failed: %s", exc)
        return {}
    known = {v.name: v.type.tensor_type for v in [*inferred.value_info, *inferred.output]}
    out: dict[str, int | None] = {}
    for labels, name in scores.items():
        tt = known.get(name)
        dims = tt.shape.dim if tt is not None and tt.HasField("shape") else []
        out[labels] = (dims[1].dim_value or None) if len(dims) > 1 and \
            dims[1].HasField("dim_value") else None
    return out


def np_type(info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))
