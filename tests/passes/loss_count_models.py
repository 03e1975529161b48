"""ONNX models for test_loss_count.py (the test and the ranks' script build them from here):
``x @ w`` scored by SoftmaxCrossEntropyLoss(ignore_index=-1) ('ignore'), the same with class
weights ('weights'), LogSoftmax and NegativeLogLikelihoodLoss(ignore_index=-1) ('nll'), or a
masked mean ``sum(l * keep) / sum(keep)`` ('masked'); float64."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import ngdist


def model(kind: str, w0: np.ndarray, class_weights: np.ndarray) -> onnx.ModelProto:
    """float32 or float64 as ``w0`` is."""
    dtype = helper.np_dtype_to_tensor_dtype(w0.dtype)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"])]
    inits = [numpy_helper.from_array(w0, "w")]
    inputs = [helper.make_tensor_value_info("x", dtype, ["n", 6]),
              helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])]
    if kind == "masked":
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, ["n"]))
        inits.append(numpy_helper.from_array(np.array(0, np.int64), "zero"))
        nodes += [helper.make_node("Where", ["keep", "y", "zero"], ["safe"]),
                  helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "safe"], ["terms"],
                                   reduction="none"),
                  helper.make_node("Cast", ["keep"], ["mask"], to=dtype),
                  helper.make_node("Mul", ["terms", "mask"], ["masked"]),
                  helper.make_node("ReduceSum", ["masked"], ["num"], keepdims=0),
                  helper.make_node("ReduceSum", ["mask"], ["den"], keepdims=0),
                  helper.make_node("Div", ["num", "den"], ["loss"], name="masked_mean")]
    elif kind == "nll":  # LogSoftmax then NegativeLogLikelihoodLoss(ignore_index=-1)
        nodes += [helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1),
                  helper.make_node("NegativeLogLikelihoodLoss", ["logp", "y"], ["loss"],
                                   name="nll", reduction="mean", ignore_index=-1)]
    else:
        weights = ["cw"] if kind == "weights" else []
        if weights:
            inits.append(numpy_helper.from_array(class_weights.astype(w0.dtype), "cw"))
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y", *weights],
                                      ["loss"], name="sce", reduction="mean", ignore_index=-1))
    g = helper.make_graph(nodes, "g", inputs,
                          [helper.make_tensor_value_info("loss", dtype, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def make_trainer(kind: str, w0: np.ndarray, class_weights: np.ndarray, **kw: object
                 ) -> ngdist.Trainer:
    return ngdist.compile(model(kind, w0, class_weights), loss=None,
                          optimizer=ngdist.optim.SGD(lr=1.0),
                          frozen=["cw"] if kind == "weights" else None, **kw)


def batch(kind: str, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    return {"x": x, "y": y, "keep": y >= 0} if kind == "masked" else {"x": x, "y": y}
