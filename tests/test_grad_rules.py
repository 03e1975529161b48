"""The gradient rules of the elementwise, activation, linalg, shape, loss, reduction,
normalization, pointwise, selection and indexing families against central finite differences,
from one table, and the forms their backward graphs take (the harness is ``grad_harness``;
convolution, pooling and the newer families have their tables under tests/passes/autodiff/)."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from grad_harness import (Case, Const, Gen, check_case, check_reuse, grad_model, grads_of,
                          graph_case, mk, op_case, weights_for)
from ngdist.errors import GradientError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.model import IR_VERSION
from ngdist.passes.autodiff import AutodiffPass


def _cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append

    def c(cid: str, op: str, make, **kw):  # make(gen) -> list of inputs
        add(op_case(cid, op, make(Gen(cid)), **kw))

    # --- elementwise, with broadcasting -----------------------------------------------------
    c("Add-same", "Add", lambda g: [g.n(3, 4), g.n(3, 4)])
    c("Add-bcast-trailing", "Add", lambda g: [g.n(2, 3, 4), g.n(4)])
    c("Add-bcast-both", "Add", lambda g: [g.n(3, 1), g.n(1, 4)])
    c("Add-scalar", "Add", lambda g: [g.n(2, 3), g.n()])
    c("Add-symbolic", "Add", lambda g: [g.n(2, 3, 4), g.n(3, 1)], symbolic=True)
    c("Add-const", "Add", lambda g: [g.n(2, 3), Const(g.n(3))])
    c("Sub-bcast", "Sub", lambda g: [g.n(2, 3), g.n(3)])
    c("Sub-both", "Sub", lambda g: [g.n(3, 1), g.n(1, 3)])
    c("Mul-bcast", "Mul", lambda g: [g.n(2, 3, 4), g.n(3, 1)])
    c("Mul-symbolic", "Mul", lambda g: [g.n(2, 1, 4), g.n(3, 1)], symbolic=True)
    c("Mul-self", "Mul", lambda g: [g.n(2, 3)] * 2)
    c("Div-bcast", "Div", lambda g: [g.n(2, 3), g.pos(3)])
    c("Div-both", "Div", lambda g: [g.n(3, 1), g.pos(1, 4)])
    c("Sum-3", "Sum", lambda g: [g.n(2, 3), g.n(3), g.n(1, 3)])
    c("Sum-1", "Sum", lambda g: [g.n(2, 3)])
    c("Neg", "Neg", lambda g: [g.n(2, 3)])
    c("Identity", "Identity", lambda g: [g.n(2, 3)])
    c("Cast-double", "Cast", lambda g: [g.n(2, 3)], to=TensorProto.DOUBLE)
    add(graph_case("Cast-int-path-cut", [
        mk("Cast", ["x"], ["xi"], to=TensorProto.INT64),
        mk("Cast", ["xi"], ["xf"], to=TensorProto.DOUBLE),
        mk("CastLike", ["xf", "x"], ["xl"]),
        mk("Mul", ["x", "xl"], ["y"])], {"x": Gen("cast").pos(2, 3) * 3 + 0.25}))
    # --- activations --------------------------------------------------------------------------
    c("Relu", "Relu", lambda g: [g.away(3, 4)])
    c("Sigmoid", "Sigmoid", lambda g: [g.n(3, 4)])
    c("Tanh", "Tanh", lambda g: [g.n(3, 4)])
    for axis in (-1, 0, 1):
        c(f"Softmax-axis{axis}", "Softmax", lambda g: [g.n(2, 3, 4)], axis=axis)
    for axis in (1, -1):
        c(f"LogSoftmax-axis{axis}", "LogSoftmax", lambda g: [g.n(2, 3, 4)], axis=axis)
    # --- matrix products ----------------------------------------------------------------------
    for ta in (0, 1):
        for tb in (0, 1):
            c(f"Gemm-t{ta}{tb}", "Gemm", lambda g, ta=ta, tb=tb: [
                g.n(*((4, 3) if ta else (3, 4))), g.n(*((5, 4) if tb else (4, 5))), g.n(3, 5)],
              transA=ta, transB=tb, alpha=0.7, beta=1.3)
    c("Gemm-C-row", "Gemm", lambda g: [g.n(3, 4), g.n(5, 4), g.n(5)], transB=1)
    c("Gemm-C-col", "Gemm", lambda g: [g.n(3, 4), g.n(4, 5), g.n(3, 1)])
    c("Gemm-C-scalar", "Gemm", lambda g: [g.n(3, 4), g.n(4, 5), g.n(1)], beta=0.5)
    c("Gemm-noC", "Gemm", lambda g: [g.n(3, 4), g.n(4, 5)])
    for cid, sa, sb in [("2d", (3, 4), (4, 5)), ("batched-left", (2, 3, 4), (4, 5)),
                        ("batched-right", (3, 4), (2, 4, 5)),
                        ("batched-both", (2, 3, 4), (2, 4, 5)),
                        ("bcast-batch", (2, 1, 3, 4), (5, 4, 2)), ("vec-mat", (4,), (2, 4, 5)),
                        ("mat-vec", (2, 3, 4), (4,)), ("vec-vec", (4,), (4,))]:
        c(f"MatMul-{cid}", "MatMul", lambda g, sa=sa, sb=sb: [g.n(*sa), g.n(*sb)])
    c("MatMul-symbolic", "MatMul", lambda g: [g.n(2, 3, 4), g.n(4, 5)], symbolic=True)
    c("MatMul-batched-left-4d", "MatMul", lambda g: [g.n(2, 3, 2, 4), g.n(4, 5)])
    # --- shape ops ----------------------------------------------------------------------------
    c("Reshape", "Reshape", lambda g: [g.n(2, 3, 4), np.array([4, -1])])
    c("Flatten-1", "Flatten", lambda g: [g.n(2, 3, 4)], axis=1)
    c("Flatten-2", "Flatten", lambda g: [g.n(2, 3, 4)], axis=2)
    c("Transpose-perm", "Transpose", lambda g: [g.n(2, 3, 4)], perm=[1, 2, 0])
    c("Transpose-default", "Transpose", lambda g: [g.n(2, 3, 4)])
    # --- losses ------------------------------------------------------------------------------
    labels = np.array([0, 2, 1, 2, 0])
    for red in ("mean", "sum", "none"):
        c(f"SCE-{red}", "SoftmaxCrossEntropyLoss", lambda g: [g.n(5, 3), labels], reduction=red)
    c("SCE-weights", "SoftmaxCrossEntropyLoss", lambda g: [g.n(5, 3), labels, Const(g.pos(3))])
    c("SCE-ignore", "SoftmaxCrossEntropyLoss", lambda g: [g.n(5, 3), labels], ignore_index=2)
    c("SCE-weights-ignore-none", "SoftmaxCrossEntropyLoss",
      lambda g: [g.n(5, 3), labels, Const(g.pos(3))], ignore_index=0, reduction="none")
    c("SCE-spatial", "SoftmaxCrossEntropyLoss",
      lambda g: [g.n(2, 3, 4), np.array([[0, 1, 2, 1], [2, 2, 0, 1]])])
    # --- reductions ---------------------------------------------------------------------------
    for op in ("ReduceSum", "ReduceMean"):
        c(f"{op}-axis1-keep", op, lambda g: [g.n(2, 3, 4), np.array([1])])
        c(f"{op}-neg-drop", op, lambda g: [g.n(2, 3, 4), np.array([-1, 0])], keepdims=0)
        c(f"{op}-all", op, lambda g: [g.n(2, 3, 4)], keepdims=0)
        c(f"{op}-noop", op, lambda g: [g.n(2, 3), np.array([], np.int64)],
          noop_with_empty_axes=1)
    # --- normalization --------------------------------------------------------------------
    stats = lambda g: [Const(g.n(3)), Const(g.pos(3))]  # noqa: E731
    c("BatchNorm-train-4d", "BatchNormalization",
      lambda g: [g.n(4, 3, 2, 2), g.n(3), g.n(3), *stats(g)], n_out=3, training_mode=1)
    c("BatchNorm-train-2d-running-outputs", "BatchNormalization",
      lambda g: [g.n(6, 3), g.n(3), g.n(3), *stats(g)], n_out=3, training_mode=1,
      epsilon=1e-3, momentum=0.8)
    c("BatchNorm-train-symbolic-batch", "BatchNormalization",
      lambda g: [g.n(3, 3, 4), g.n(3), g.n(3), *stats(g)], n_out=3, training_mode=1,
      symbolic="batch")
    c("BatchNorm-inference", "BatchNormalization",
      lambda g: [g.n(3, 3, 4), g.n(3), g.n(3), g.n(3), g.pos(3)], epsilon=1e-2)
    c("LayerNorm-last", "LayerNormalization", lambda g: [g.n(2, 3, 4), g.n(4), g.n(4)])
    c("LayerNorm-axis1-bcast-bias", "LayerNormalization",
      lambda g: [g.n(2, 3, 4), g.n(3, 4), g.n(4)], axis=1)
    c("LayerNorm-no-bias", "LayerNormalization", lambda g: [g.n(2, 3, 4), g.n(3, 4)], axis=-2,
      epsilon=1e-3)
    # onnxruntime's float64 kernel stashes float32 statistics: run float64 on the reference
    c("LayerNorm-stats-in-loss", "LayerNormalization", lambda g: [g.n(3, 5), g.n(5), g.n(5)],
      n_out=3, used=[0, 1, 2], reference=True)
    c("LayerNorm-float32-stats", "LayerNormalization", lambda g: [g.n(3, 5), g.n(5)],
      n_out=3, used=[0])
    train = np.array(True)
    c("Dropout-train", "Dropout", lambda g: [g.n(4, 5), Const(np.array(0.3)), train], seed=5,
      fresh=True)
    c("Dropout-train-mask-output", "Dropout", lambda g: [g.n(4, 5), Const(np.array(0.6)), train],
      n_out=2, seed=11, fresh=True)
    c("Dropout-default-ratio", "Dropout", lambda g: [g.n(4, 5), None, train], seed=2, fresh=True)
    c("Dropout-inference", "Dropout", lambda g: [g.n(4, 5)])
    c("Dropout-training-false", "Dropout", lambda g: [g.n(4, 5), None, np.array(False)])
    # --- transformer pieces: pointwise math -----------------------------------------------
    c("Erf", "Erf", lambda g: [g.n(3, 4)])
    c("Gelu", "Gelu", lambda g: [g.n(3, 4) * 2], opset=20)
    c("Gelu-tanh", "Gelu", lambda g: [g.n(3, 4) * 2], opset=20, approximate="tanh")
    add(graph_case("Gelu-erf-decomposition", [
        mk("Div", ["x", "sqrt2"], ["xs"]), mk("Erf", ["xs"], ["e"]),
        mk("Add", ["e", "one"], ["e1"]), mk("Mul", ["x", "e1"], ["xe"]),
        mk("Mul", ["xe", "half"], ["y"])],
        {"x": Gen("gelu-dec").n(3, 4) * 2},
        {"sqrt2": np.array(np.sqrt(2.0)), "one": np.array(1.0), "half": np.array(0.5)}))
    c("Pow-both", "Pow", lambda g: [g.pos(2, 3), g.n(3)])
    c("Pow-square", "Pow", lambda g: [g.n(2, 3), Const(np.array(2.0))])
    c("Pow-sqrt-bcast", "Pow", lambda g: [g.pos(2, 3), g.n(1) * 0 + 0.5])
    c("Pow-int-exponent", "Pow", lambda g: [g.n(2, 3), np.array(3)])
    c("Sqrt", "Sqrt", lambda g: [g.pos(3, 4)])
    c("Exp", "Exp", lambda g: [g.n(3, 4)])
    c("Log", "Log", lambda g: [g.pos(3, 4)])
    c("Abs", "Abs", lambda g: [g.away(3, 4)])
    c("Reciprocal", "Reciprocal", lambda g: [g.pos(3, 4)])
    c("Neg-bcast-graph", "Neg", lambda g: [g.n(2, 1, 3)])
    c("Clip-both", "Clip", lambda g: [g.distinct(4, 5), Const(np.array(-0.5)),
                                      Const(np.array(0.7))])
    c("Clip-min-only", "Clip", lambda g: [g.distinct(4, 5), Const(np.array(0.1))])
    c("Clip-max-only", "Clip", lambda g: [g.distinct(4, 5), None, Const(np.array(0.3))])
    c("Clip-none", "Clip", lambda g: [g.n(4, 5)])
    c("Clip-bounds-are-inputs", "Clip", lambda g: [g.distinct(4, 5), np.array(-0.3),
                                                   np.array(0.4)])
    c("LeakyRelu", "LeakyRelu", lambda g: [g.away(3, 4)])
    # every piece of the hard activations, away from the kinks (alpha x + beta = 0 or 1)
    hard = np.array([[-4.4, -3.4, -2.0, -0.7], [0.3, 1.1, 2.1, 3.6], [4.5, -1.4, 0.8, 2.7]])
    c("HardSigmoid", "HardSigmoid", lambda g: [hard.copy()])
    c("HardSigmoid-alpha-beta", "HardSigmoid", lambda g: [hard.copy()], alpha=0.3, beta=0.4)
    c("HardSwish", "HardSwish", lambda g: [hard.copy()], opset=18)
    # --- padding --------------------------------------------------------------------------
    c("Pad-constant", "Pad", lambda g: [g.n(2, 3, 4), np.array([0, 1, 2, 1, 0, 3])])
    c("Pad-crop-and-pad", "Pad", lambda g: [g.n(2, 5, 4), np.array([1, -1, 0, 0, -2, 2])])
    c("Pad-value-axes", "Pad", lambda g: [g.n(3, 4), np.array([2, 1]), Const(np.array(0.5)),
                                          np.array([1])])
    c("LeakyRelu-alpha", "LeakyRelu", lambda g: [g.away(3, 4)], alpha=0.2)
    # --- selection ------------------------------------------------------------------------
    c("Where-bcast", "Where", lambda g: [g.n(2, 3, 4) > 0, g.n(4), g.n()])
    c("Where-same", "Where", lambda g: [g.n(3, 4) > 0, g.n(3, 4), g.n(3, 4)])
    for op in ("Max", "Min"):
        c(f"{op}-2", op, lambda g: [g.distinct(3, 4), g.distinct(3, 4) + 0.005])
        c(f"{op}-3-bcast", op, lambda g: [g.distinct(2, 3, 4), g.distinct(4) + 0.003,
                                          g.distinct(3, 1) + 0.007])
        c(f"{op}-1", op, lambda g: [g.n(3, 4)])
    for op in ("ReduceMax", "ReduceMin"):
        c(f"{op}-axis1", op, lambda g: [g.distinct(2, 3, 4), np.array([1])])
        c(f"{op}-drop", op, lambda g: [g.distinct(2, 3, 4), np.array([0, -1])], keepdims=0)
        c(f"{op}-all", op, lambda g: [g.distinct(2, 3, 4)], keepdims=0)
    # --- indexing ---------------------------------------------------------------------------
    c("Gather-embedding", "Gather", lambda g: [g.n(5, 3), np.array([[0, 4, -1], [2, 0, 0]])])
    c("Gather-axis1", "Gather", lambda g: [g.n(2, 4, 3), np.array([3, -4, 1, 3])], axis=1)
    c("Gather-axis-last-2d-idx", "Gather", lambda g: [g.n(2, 4), np.array([[1, 1], [0, 3]])],
      axis=-1)
    c("Gather-scalar", "Gather", lambda g: [g.n(4, 3), np.array(2)])
    c("Gather-int32", "Gather", lambda g: [g.n(4, 3), np.array([1, 1, -1], np.int32)])
    c("GatherElements", "GatherElements",
      lambda g: [g.n(3, 4), np.array([[0, 3, 3], [1, -1, 0], [2, 2, 2]])], axis=1)
    c("Slice-basic", "Slice", lambda g: [g.n(4, 5), np.array([1, 0]), np.array([3, 4])])
    c("Slice-axes-steps", "Slice", lambda g: [g.n(3, 6, 4), np.array([0, 1]), np.array([6, 4]),
                                              np.array([1, 2]), np.array([2, 2])])
    c("Slice-negative-step", "Slice", lambda g: [g.n(4, 6), np.array([-1]), np.array([-7]),
                                                 np.array([1]), np.array([-2])])
    c("Slice-clamped", "Slice", lambda g: [g.n(4, 5), np.array([-100]),
                                           np.array([2 ** 62]), np.array([0])])
    # --- shape ------------------------------------------------------------------------------
    c("Squeeze", "Squeeze", lambda g: [g.n(2, 1, 3, 1), np.array([1, -1])])
    c("Squeeze-all", "Squeeze", lambda g: [g.n(1, 3, 1)])
    c("Unsqueeze", "Unsqueeze", lambda g: [g.n(2, 3), np.array([0, -1])])
    c("Expand", "Expand", lambda g: [g.n(3, 1), np.array([2, 3, 4])])
    c("Expand-smaller-shape", "Expand", lambda g: [g.n(2, 3), np.array([3])])
    c("Concat", "Concat", lambda g: [g.n(2, 1, 3), g.n(2, 4, 3), g.n(2, 2, 3)], axis=1)
    c("Concat-last-symbolic", "Concat", lambda g: [g.n(2, 3), g.n(2, 2)], axis=-1,
      symbolic=True)
    c("Concat-const-part", "Concat", lambda g: [g.n(2, 3), Const(g.n(2, 2))], axis=1)
    c("Split-sizes", "Split", lambda g: [g.n(2, 6), np.array([1, 3, 2])], n_out=3,
      used=[0, 1, 2], axis=1)
    c("Split-num-outputs-one-unused", "Split", lambda g: [g.n(6, 2)], n_out=3, used=[0, 2],
      num_outputs=3)
    # --- constants and shape-only subgraphs: no gradient flows through them -------------------
    add(graph_case("Shape-subgraph", [
        mk("Shape", ["x"], ["sh"]),
        mk("Slice", ["sh", "zero", "one"], ["lead"]),
        mk("Concat", ["lead", "minus1"], ["target"], axis=0),
        mk("Reshape", ["x", "target"], ["flat"]),
        mk("ConstantOfShape", ["target_c"], ["ones"], value=numpy_helper.from_array(
            np.array([2.0]))),
        mk("Cast", ["ones"], ["ones_d"], to=TensorProto.DOUBLE),
        mk("CastLike", ["ones_d", "flat"], ["ones_l"]),
        mk("Mul", ["flat", "ones_l"], ["y"])],
        {"x": Gen("shape-sub").n(2, 3, 2)},
        {"zero": np.array([0]), "one": np.array([1]), "minus1": np.array([-1]),
         "target_c": np.array([2, 6])}))
    add(graph_case("Constant", [
        helper.make_node("Constant", [], ["k"], name="const",
                         value=numpy_helper.from_array(np.array([1.5, -2.0, 0.5]))),
        mk("CastLike", ["k", "x"], ["kl"]),
        mk("Mul", ["x", "kl"], ["y"])], {"x": Gen("const").n(2, 3)}))
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case: Case) -> None:
    check_case(case)


# ----------------------------------------------------------------------------- ties

@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_ties_share_the_gradient(op: str) -> None:
    a = np.array([[1.0, 2.0, 3.0], [4.0, 4.0, -1.0]])
    b = np.array([[1.0, 0.0, 3.0], [4.0, 5.0, -2.0]])  # ties at (0, 0), (0, 2), (1, 0)
    grads, w = grads_of(op_case(f"{op}-ties", op, [a, b]))
    tie = a == b
    wins_a = (a > b) if op == "Max" else (a < b)
    expected_a = w["w0"] * np.where(tie, 0.5, wins_a.astype(float))
    np.testing.assert_allclose(grads["in0"], expected_a, rtol=1e-12)
    np.testing.assert_allclose(grads["in1"], w["w0"] - expected_a, rtol=1e-12)


def test_reduce_max_ties_share_the_gradient() -> None:
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    grads, w = grads_of(op_case("ReduceMax-ties", "ReduceMax", [x, np.array([1])]))
    share = np.array([[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(grads["in0"], share * w["w0"], rtol=1e-12)


@pytest.mark.parametrize("cid", ["MatMul-batched-left", "MatMul-batched-left-4d",
                                 "MatMul-symbolic"])
def test_matmul_weight_gradient_is_one_product_over_all_rows(cid: str) -> None:
    """[..., M, K] @ [K, N]: the gradient of the 2-D operand is one Gemm over the flattened
    rows, with no batched product and no ReduceSum over a [..., K, N] intermediate."""
    case = next(c for c in CASES if c.id == cid)
    lowered = grad_model(case, np.float32, weights_for(case))
    backward = [n.op_type for n in lowered.graph.node if n.name.startswith("node0/grad/")]
    assert backward.count("Gemm") == 1 and "ReduceSum" not in backward


def test_relu_gradient_reads_the_output_so_the_input_dies_at_the_relu() -> None:
    """The Relu's mask is y > 0: no backward node reads its input, which onnxruntime can then
    fuse into the Gemm or Conv that makes it."""
    case = next(c for c in CASES if c.id == "Relu")
    lowered = grad_model(case, np.float32, weights_for(case))
    relu = next(n for n in lowered.graph.node if n.op_type == "Relu")
    readers = [n for n in lowered.graph.node if relu.input[0] in n.input]
    assert readers == [relu]
    assert any(relu.output[0] in n.input for n in lowered.graph.node
               if n.name.startswith("node0/grad/") and n.op_type == "Greater")


@pytest.mark.parametrize("cid", ["Relu", "Sigmoid", "Tanh", "LeakyRelu", "Gelu", "Gelu-tanh",
                                 "Erf", "Sqrt"])
def test_elementwise_constants_have_the_rank_of_the_tensor(cid: str) -> None:
    """Float constants the backward pass combines with a tensor are shaped [1] * its rank:
    onnxruntime's binary ops take a ~50x slower path for a rank-0 operand against a tensor
    whose last dimension is 1."""
    case = next(c for c in CASES if c.id == cid)
    rank = len(next(iter(case.inputs.values())).shape)
    lowered = grad_model(case, np.float32, weights_for(case))
    ranks = [len(numpy_helper.to_array(a.t).shape) for n in lowered.graph.node
             if n.op_type == "Constant" and n.name.startswith("node0/grad/") for a in n.attribute
             if a.name == "value" and a.t.data_type in (TensorProto.FLOAT, TensorProto.DOUBLE)]
    assert ranks and set(ranks) == {rank}


# ----------------------------------------------------------------------------- reuse

# Sigmoid's form (computed once as 1 / (1 + exp(-x))): tests/passes/autodiff/test_grad_sigmoid.py
REUSE = ["BatchNorm-train-4d", "LayerNorm-last", "LayerNorm-float32-stats", "Dropout-train",
         "Dropout-train-mask-output", "Gelu", "Tanh", "Softmax-axis1", "Exp", "Sqrt", "Erf"]


@pytest.mark.parametrize("cid", REUSE)
def test_backward_reuses_the_forward_op(cid: str) -> None:
    check_reuse(next(c for c in CASES if c.id == cid))


# ----------------------------------------------------------------------------- missing rules

def test_missing_rules_are_listed_all_at_once() -> None:
    nodes = [helper.make_node("Det", ["x"], ["d"], name="det0"),
             helper.make_node("Frobnicate", ["x"], ["f"], name="frob0", domain="com.example"),
             helper.make_node("Mul", ["d", "f"], ["m"], name="mul0"),
             helper.make_node("Det", ["x"], ["d2"], name="det1"),
             helper.make_node("Add", ["m", "d2"], ["y"], name="add0"),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="sum0", keepdims=0),
             helper.make_node("Gradient", ["x"], ["x.grad"], name="gradient",
                              domain=PREVIEW_TRAINING, xs=["x"], y="loss")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("x.grad", TensorProto.FLOAT, [2, 3, 3])])
    proto = helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid(PREVIEW_TRAINING, 1),
        helper.make_opsetid("com.example", 1)])
    with pytest.raises(GradientError) as info:
        AutodiffPass()(ir.from_proto(proto))
    assert str(info.value) == (
        "no gradient rule for 3 node(s) on the path to the loss: Det (node 'det1'), "
        "Frobnicate (node 'frob0'), Det (node 'det0'). Ops without a rule: Det, "
        "com.example.Frobnicate. Mark the inputs that feed them as frozen, or register a rule "
        "with ngdist.passes.autodiff.register")
