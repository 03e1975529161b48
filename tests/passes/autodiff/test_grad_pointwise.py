"""Pointwise ops against central differences (the harness of ``grad_harness``): the
activations torch and Keras export (Elu, Selu, Celu, Softplus, Softsign, Mish, Swish, PRelu,
ThresholdedRelu, Shrink), trigonometric and hyperbolic functions, Mean and Mod."""
from __future__ import annotations

import numpy as np
import pytest

from grad_harness import Const, case, check_case


def _cases() -> list:
    out = []
    add = out.append
    add(case("Elu", "Elu", lambda g: [g.away(3, 4)]))
    add(case("Elu-alpha", "Elu", lambda g: [g.away(3, 4)], alpha=0.7))
    add(case("Selu", "Selu", lambda g: [g.away(3, 4)]))
    add(case("Selu-alpha-gamma", "Selu", lambda g: [g.away(3, 4)], alpha=1.5, gamma=0.8))
    # ONNX defines Celu for float32 only: float64 on the reference evaluator
    add(case("Celu", "Celu", lambda g: [g.away(3, 4)], alpha=0.6, reference=True))
    add(case("Softplus", "Softplus", lambda g: [g.n(3, 4) * 3]))
    add(case("Softsign", "Softsign", lambda g: [g.away(3, 4) * 2]))
    add(case("Mish", "Mish", lambda g: [g.n(3, 4) * 3]))
    add(case("Swish", "Swish", lambda g: [g.n(3, 4) * 3], opset=24))
    add(case("Swish-alpha", "Swish", lambda g: [g.n(3, 4) * 3], alpha=1.7, opset=24))
    add(case("PRelu-channel-slope", "PRelu", lambda g: [g.away(2, 3, 2, 2), g.n(3, 1, 1)]))
    add(case("PRelu-scalar-slope", "PRelu", lambda g: [g.away(3, 4), g.n(1)]))
    add(case("PRelu-const-slope", "PRelu", lambda g: [g.away(3, 4), Const(g.n(4))]))
    add(case("ThresholdedRelu", "ThresholdedRelu",
             lambda g: [np.array([[-1.0, 0.5, 1.5, 2.0], [0.2, 0.9, 1.1, -3.0]])]))
    add(case("ThresholdedRelu-alpha", "ThresholdedRelu",
             lambda g: [np.array([[-1.0, 0.5, 1.5, 2.0], [0.2, 0.9, 1.1, -3.0]])], alpha=0.4))
    # onnxruntime's float64 Shrink rounds through float32: float64 on the reference evaluator
    add(case("Shrink", "Shrink", lambda g: [np.array([[-1.0, -0.3, 0.2, 0.7],
                                                       [1.4, -0.6, 0.1, 0.55]])], reference=True))
    add(case("Shrink-lambd-bias", "Shrink",
             lambda g: [np.array([[-1.0, -0.3, 0.2, 0.9], [1.4, -0.9, 0.1, 1.25]])],
             lambd=0.8, bias=0.3, reference=True))
    for op in ("Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh"):
        add(case(op, op, lambda g: [g.n(3, 4)]))
    for op in ("Asin", "Acos", "Atanh"):
        add(case(op, op, lambda g: [g.n(3, 4).clip(-2, 2) * 0.4]))
    add(case("Acosh", "Acosh", lambda g: [g.pos(3, 4) + 1.0]))
    add(case("Mean-3-bcast", "Mean", lambda g: [g.n(2, 3), g.n(3), g.n(1, 3)]))
    add(case("Mean-1", "Mean", lambda g: [g.n(2, 3)]))
    # quotients away from the jumps (a / b not within 0.05 of an integer)
    a = np.array([[5.3, -5.3, 2.2, -7.9], [0.45, 3.3, -1.1, 9.6]])
    b = np.array([2.0, 2.0, -1.5, 2.5])
    add(case("Mod-fmod", "Mod", lambda g: [a.copy(), b.copy()], fmod=1))
    add(case("Mod-fmod-const-divisor", "Mod", lambda g: [a.copy(), Const(b.copy())], fmod=1))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)
