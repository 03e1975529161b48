"""The autodiff pass honours ``metadata_props["ngdist.padding_idx"]`` on an axis-0 Gather (what
the PyTorch frontend writes for ``nn.Embedding(padding_idx=p)``; an ONNX file may carry it too):
that Gather adds nothing to row p of its table's gradient, while other uses of the table still
do. A key on a node it cannot apply to is refused by name."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ngdist
from ngdist.errors import GradientError
from ngdist.passes.autodiff.driver import PADDING_IDX
from step_probe import run_step

V, D = 5, 3


def _forward(mark: str | None, op: str = "Gather") -> onnx.ModelProto:
    """logits = Gather(table, ids) @ table^T summed over tokens: the table is read by the
    lookup and by the output layer, as a tied embedding is."""
    table = numpy_helper.from_array(
        np.arange(V * D, dtype=np.float32).reshape(V, D) / 10, "table")
    lookup = helper.make_node(op, ["table", "ids"], ["h"], name="lookup",
                              **({"axis": 0} if op == "Gather" else {}))
    if mark is not None:
        entry = lookup.metadata_props.add()
        entry.key, entry.value = PADDING_IDX, mark
    nodes = [lookup,
             helper.make_node("ReduceSum", ["h", "axis1"], ["pooled"], keepdims=0),
             helper.make_node("Gemm", ["pooled", "table"], ["logits"], transB=1)]
    axis = numpy_helper.from_array(np.array([1], np.int64), "axis1")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", V])], [table, axis])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _grad(mark: str | None) -> np.ndarray:
    model = ngdist.to_training_model(_forward(mark), loss="softmax_cross_entropy",
                                     optimizer="sgd:lr=0.01")
    ids = np.array([[1, 0, 0, 2], [3, 4, 0, 1]], np.int64)
    return run_step(model, {"ids": ids, "y": np.array([2, 0])})["table.grad"]


def _numpy_grad(skip_row: int | None) -> np.ndarray:
    """The same gradient by hand: d/dtable of softmax cross-entropy of pooled @ table^T."""
    table = np.arange(V * D, dtype=np.float64).reshape(V, D) / 10
    ids, y = np.array([[1, 0, 0, 2], [3, 4, 0, 1]]), np.array([2, 0])
    pooled = table[ids].sum(1)
    logits = pooled @ table.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = p.copy()
    g[np.arange(2), y] -= 1
    g /= 2
    grad = g.T @ pooled  # the output layer's part
    g_pooled = g @ table
    for n in range(2):
        for t in ids[n]:
            if t != skip_row:
                grad[t] += g_pooled[n]
    return grad


def test_marked_gather_leaves_the_padding_row_to_the_other_uses():
    plain, marked = _grad(None), _grad("0")
    np.testing.assert_allclose(plain, _numpy_grad(None), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(marked, _numpy_grad(0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(marked[0], plain[0])
    assert np.any(marked[0])  # the output layer's part of row 0 is kept
    assert np.array_equal(marked[1:], plain[1:])


@pytest.mark.parametrize("mark,op,message", [
    ("7", "Gather", "node 'lookup': ngdist.padding_idx=7 is not a row of its 5-row table"),
    ("0", "GatherElements", "node 'lookup' (GatherElements) carries ngdist.padding_idx, which "
                            "applies to an axis-0 Gather of a table with static row shape"),
])
def test_a_key_that_cannot_apply_is_refused(mark, op, message):
    forward = _forward(mark, op)
    if op == "GatherElements":  # refused while differentiating, before anything runs
        forward.graph.node[0].input[1] = "ids2"
        forward.graph.input.append(
            helper.make_tensor_value_info("ids2", TensorProto.INT64, ["N", D]))
    model = ngdist.to_training_model(forward, loss="softmax_cross_entropy",
                                     optimizer="sgd:lr=0.01")
    with pytest.raises(GradientError) as info:
        ngdist.compile(model, strategy="local")
    assert str(info.value) == message
