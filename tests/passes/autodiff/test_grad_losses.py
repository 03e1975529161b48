"""NegativeLogLikelihoodLoss (what nn.NLLLoss exports) against central differences (the harness
of ``grad_harness``): reductions, class weights, ignore_index, spatial labels."""
from __future__ import annotations

import numpy as np
import pytest

from grad_harness import Const, case, check_case

LABELS = np.array([0, 2, 1, 2, 0])


def _cases() -> list:
    out = []
    for red in ("mean", "sum", "none"):
        out.append(case(f"NLL-{red}", "NegativeLogLikelihoodLoss",
                        lambda g: [g.n(5, 3), LABELS], reduction=red))
    out.append(case("NLL-weights", "NegativeLogLikelihoodLoss",
                    lambda g: [g.n(5, 3), LABELS, Const(g.pos(3))]))
    out.append(case("NLL-ignore", "NegativeLogLikelihoodLoss", lambda g: [g.n(5, 3), LABELS],
                    ignore_index=2))
    out.append(case("NLL-weights-ignore-sum", "NegativeLogLikelihoodLoss",
                    lambda g: [g.n(5, 3), LABELS, Const(g.pos(3))], ignore_index=0,
                    reduction="sum"))
    out.append(case("NLL-spatial-weights", "NegativeLogLikelihoodLoss",
                    lambda g: [g.n(2, 3, 4), np.array([[0, 1, 2, 1], [2, 2, 0, 1]]),
                               Const(g.pos(3))]))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)
