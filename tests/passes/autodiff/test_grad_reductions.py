"""Reductions beyond sum, mean, max and min against central differences (the harness of
``grad_harness``): ReduceSumSquare, ReduceL1, ReduceL2 (F.normalize, weight norm),
ReduceLogSum, ReduceLogSumExp, ReduceProd (zeros included)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from grad_harness import (Runner, case, check_case, grad_model, lowering_error, op_case,
                          weights_for)


def _cases() -> list:
    out = []
    for op, make in [("ReduceSumSquare", lambda g: g.n(2, 3, 4)),
                     ("ReduceL1", lambda g: g.away(2, 3, 4)),
                     ("ReduceL2", lambda g: g.n(2, 3, 4)),
                     ("ReduceLogSum", lambda g: g.pos(2, 3, 4)),
                     ("ReduceLogSumExp", lambda g: g.n(2, 3, 4) * 3),
                     ("ReduceProd", lambda g: g.away(2, 3, 4))]:
        out.append(case(f"{op}-axis1-keep", op, lambda g, m=make: [m(g), np.array([1])]))
        out.append(case(f"{op}-neg-drop", op, lambda g, m=make: [m(g), np.array([-1, 0])],
                        keepdims=0))
        out.append(case(f"{op}-all", op, lambda g, m=make: [m(g)], keepdims=0))
    out.append(case("ReduceL2-opset17-attr", "ReduceL2", lambda g: [g.n(3, 5)], axes=[1],
                    opset=17))
    for op in ("ReduceL2", "ReduceLogSumExp", "ReduceProd"):
        out.append(case(f"{op}-symbolic", op, lambda g: [g.away(2, 3, 4), np.array([1])],
                        keepdims=0, symbolic=True))
    zeros = np.array([[0.0, 1.5, -2.0, 0.7], [0.0, 0.0, 1.3, -0.9], [1.1, -0.6, 0.8, 2.0]])
    out.append(op_case("ReduceProd-zeros", "ReduceProd", [zeros, np.array([1])]))
    out.append(op_case("ReduceProd-zeros-axis0", "ReduceProd", [zeros.T.copy(), np.array([0])],
                       keepdims=0))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


def test_reduce_l2_of_a_zero_row_has_zero_gradient() -> None:
    """torch's norm backward is 0 where the norm is 0 (not NaN)."""
    x = np.array([[0.0, 0.0, 0.0], [3.0, 4.0, 0.0]])
    c = op_case("ReduceL2-zero-row", "ReduceL2", [x, np.array([1])])
    w = weights_for(c)
    got = Runner(grad_model(c, np.float64, w))({"in0": x})[1]
    np.testing.assert_array_equal(got[0], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(got[1], w["w0"][1, 0] * x[1] / 5.0, rtol=1e-12)


def test_noop_reduction_of_squares_is_refused_with_the_node() -> None:
    nodes = [helper.make_node("Constant", [], ["axes"], name="axes0",
                              value=helper.make_tensor("v", TensorProto.INT64, [0], [])),
             helper.make_node("ReduceL2", ["x", "axes"], ["y"], name="l2",
                              noop_with_empty_axes=1)]
    assert lowering_error(nodes, [2, 3]) == (
        "gradient rule of ReduceL2 failed on node 'l2': ReduceL2 with empty axes and "
        "noop_with_empty_axes=1 is not differentiated (runtimes differ on what it computes); "
        "give the reduced axes explicitly")
