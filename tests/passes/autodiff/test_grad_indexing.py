"""Indexing, scatter, selection and layout ops against central differences (the harness of
``grad_harness``): GatherND, ScatterElements (data and updates; every reduction) and ScatterND
(reduction none and add), TopK values, CumSum (exclusive, reverse), Trilu, Tile, DepthToSpace, SpaceToDepth,
ReverseSequence, CenterCropPad, MaxUnpool, Compress."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from grad_harness import Const, case, check_case, lowering_error

ROWS = np.array([[1, 0, 2, -1], [0, 2, 1, -3]])  # distinct rows within each column
SAME_ROWS = np.array([[1, 1, 2, 0], [1, 0, 2, 0], [0, 1, 2, -3]])  # repeated within columns
PAIRS = np.array([[[0, 1], [2, 3]], [[1, 0], [0, 1]]])  # GatherND: index pairs into [3, 4, 2]


def _cases() -> list:
    out = []
    add = out.append
    add(case("GatherND-pairs", "GatherND", lambda g: [g.n(3, 4, 2), PAIRS]))
    add(case("GatherND-rows-repeated", "GatherND",
             lambda g: [g.n(3, 4), np.array([[2], [0], [2]])]))
    add(case("GatherND-full", "GatherND", lambda g: [g.n(3, 4), np.array([[0, 1], [2, 3],
                                                                          [0, 1]])]))
    for red in ("none", "add"):
        add(case(f"ScatterElements-axis0-{red}", "ScatterElements",
                 lambda g: [g.n(3, 4), ROWS, g.n(2, 4)], axis=0, reduction=red))
        add(case(f"ScatterElements-axis-last-{red}", "ScatterElements",
                 lambda g: [g.n(2, 5), np.array([[4, 0], [-1, 2]]), g.n(2, 2)], axis=-1,
                 reduction=red))
        add(case(f"ScatterND-rows-{red}", "ScatterND",
                 lambda g: [g.n(4, 3), np.array([[3], [1]]), g.n(2, 3)], reduction=red))
        add(case(f"ScatterND-elements-{red}", "ScatterND",
                 lambda g: [g.n(3, 4), np.array([[0, 1], [2, 3], [1, 1]]), g.n(3)],
                 reduction=red))
    add(case("ScatterElements-add-repeated", "ScatterElements",
             lambda g: [g.n(3, 2), np.array([[1, 1], [1, 0], [1, 1]]), g.n(3, 2)],
             reduction="add"))
    add(case("ScatterND-add-repeated", "ScatterND",
             lambda g: [g.n(3, 2), np.array([[1], [1], [0]]), g.n(3, 2)], reduction="add"))
    for red in ("mul", "max", "min"):  # no ties: data and updates 0.05 apart at least
        add(case(f"ScatterElements-repeated-{red}", "ScatterElements",
                 lambda g: [g.distinct(3, 4), SAME_ROWS, g.distinct(3, 4) + 0.05],
                 reduction=red))
        add(case(f"ScatterElements-axis-last-{red}", "ScatterElements",
                 lambda g: [g.distinct(2, 5), np.array([[4, 0, 4], [-1, 2, 2]]),
                            g.distinct(2, 3) + 0.05], axis=-1, reduction=red))
    add(case("ScatterElements-mul-zeros", "ScatterElements",  # a zero alone, two together
             lambda g: [np.array([[0.0, 1.5], [-0.5, 2.0]]), np.array([[0, 1], [0, 1], [1, 1]]),
                        np.array([[0.7, 0.0], [1.3, 0.0], [0.0, -0.9]])], reduction="mul"))
    add(case("ScatterElements-const-data", "ScatterElements",
             lambda g: [Const(g.n(3, 4)), ROWS, g.n(2, 4)]))
    add(case("TopK-last", "TopK", lambda g: [g.distinct(3, 5), np.array([2])], n_out=2))
    add(case("TopK-axis0-smallest", "TopK", lambda g: [g.distinct(4, 3), np.array([3])],
             n_out=2, axis=0, largest=0))
    add(case("TopK-indices-used", "TopK", lambda g: [g.distinct(2, 6), np.array([4])],
             n_out=2, used=[0], sorted=0))
    for excl in (0, 1):
        for rev in (0, 1):
            add(case(f"CumSum-excl{excl}-rev{rev}", "CumSum",
                     lambda g: [g.n(3, 4), np.array(1)], exclusive=excl, reverse=rev))
    add(case("CumSum-axis-neg", "CumSum", lambda g: [g.n(2, 3, 4), np.array(-3)]))
    add(case("Trilu-upper", "Trilu", lambda g: [g.n(2, 3, 4)]))
    add(case("Trilu-lower-k", "Trilu", lambda g: [g.n(4, 4), np.array(-1)], upper=0))
    add(case("Trilu-upper-k", "Trilu", lambda g: [g.n(3, 5), np.array(2)]))
    add(case("Tile", "Tile", lambda g: [g.n(2, 3), np.array([2, 3])]))
    add(case("Tile-3d-ones", "Tile", lambda g: [g.n(2, 1, 3), np.array([1, 4, 1])]))
    add(case("Tile-symbolic", "Tile", lambda g: [g.n(2, 3), np.array([3, 2])], symbolic=True))
    for mode in ("DCR", "CRD"):
        add(case(f"DepthToSpace-{mode}", "DepthToSpace", lambda g: [g.n(2, 8, 2, 3)],
                 blocksize=2, mode=mode))
    add(case("DepthToSpace-symbolic-batch", "DepthToSpace", lambda g: [g.n(2, 9, 2, 2)],
             blocksize=3, mode="CRD", symbolic="batch"))
    add(case("SpaceToDepth", "SpaceToDepth", lambda g: [g.n(2, 3, 4, 6)], blocksize=2))
    add(case("ReverseSequence", "ReverseSequence", lambda g: [g.n(4, 3, 2), np.array([4, 1, 3])],
             batch_axis=1, time_axis=0))
    add(case("ReverseSequence-batch0", "ReverseSequence",
             lambda g: [g.n(2, 5), np.array([2, 5])], batch_axis=0, time_axis=1))
    add(case("CenterCropPad-crop-and-pad", "CenterCropPad",
             lambda g: [g.n(5, 4, 3), np.array([2, 7])], axes=[0, 1]))
    add(case("CenterCropPad-all-axes", "CenterCropPad", lambda g: [g.n(3, 6), np.array([6, 3])]))
    add(case("Compress-axis1", "Compress",
             lambda g: [g.n(2, 5, 3), np.array([True, False, True, True])], axis=1))
    add(case("Compress-flat", "Compress", lambda g: [g.n(2, 3), np.array([0, 1, 1, 0, 1],
                                                                          bool)]))
    add(case("Compress-axis-neg-symbolic", "Compress",
             lambda g: [g.n(3, 4), np.array([False, True, True])], axis=-2, symbolic=True))
    add(case("MaxUnpool", "MaxUnpool",
             lambda g: [g.n(1, 2, 2, 2), np.array([[[[0, 3], [9, 14]], [[17, 22], [24, 31]]]])],
             kernel_shape=[2, 2], strides=[2, 2]))
    # every dimension symbolic (read at run time)
    add(case("ScatterElements-symbolic", "ScatterElements",
             lambda g: [g.n(3, 4), ROWS, g.n(2, 4)], axis=0, symbolic=True))
    add(case("ScatterND-symbolic", "ScatterND",
             lambda g: [g.n(4, 3), np.array([[3], [1]]), g.n(2, 3)], symbolic=True))
    add(case("GatherND-symbolic", "GatherND", lambda g: [g.n(3, 4, 2), PAIRS], symbolic=True))
    add(case("TopK-symbolic", "TopK", lambda g: [g.distinct(3, 5), np.array([2])], n_out=2,
             symbolic=True))
    add(case("CumSum-symbolic", "CumSum", lambda g: [g.n(3, 4), np.array(1)], reverse=1,
             symbolic=True))
    add(case("Trilu-symbolic", "Trilu", lambda g: [g.n(3, 4)], symbolic=True))
    add(case("SpaceToDepth-symbolic", "SpaceToDepth", lambda g: [g.n(2, 3, 4, 6)], blocksize=2,
             symbolic=True))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


@pytest.mark.parametrize("op, attrs, message", [
    ("ScatterND", {"reduction": "mul"}, "gradient rule of ScatterND failed on node "
     "'scatter0': ScatterND with reduction='mul' is not differentiated (only 'none' and "
     "'add')"),
    ("GatherND", {"batch_dims": 1}, "gradient rule of GatherND failed on node 'scatter0': "
     "GatherND with batch_dims=1 is not differentiated (only 0); index with batch_dims=0 "
     "(prepend the batch positions to the indices)"),
])
def test_unsupported_forms_are_refused_with_op_node_and_form(op, attrs, message) -> None:
    ins = ["x", "idx", "x"] if op == "ScatterND" else ["x", "idx"]
    idx = helper.make_tensor("idx", TensorProto.INT64, [2, 1], [0, 1])
    nodes = [helper.make_node(op, ins, ["y"], name="scatter0", **attrs)]
    assert lowering_error(nodes, [2, 1], initializers=[idx]) == message
