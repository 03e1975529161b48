"""Attention (opset 23) against central differences (the harness of ``grad_harness``; float64
on ONNX's reference evaluator): multi-head and grouped-query, 3-D and 4-D inputs, boolean and
float masks (the float mask differentiated too), causal, explicit scale; refused forms are
named."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from grad_harness import Const, case, check_case, lowering_error

B, S, D = 2, 3, 4


def _attn(cid: str, make, **attrs):
    return case(cid, "Attention", make, opset=23, reference=True, **attrs)


CASES = [
    _attn("Attention-mha", lambda g: [g.n(B, 2, S, D), g.n(B, 2, S, D), g.n(B, 2, S, D)]),
    _attn("Attention-gqa-causal", lambda g: [g.n(B, 4, S, D), g.n(B, 2, S, D),
                                             g.n(B, 2, S, D)], is_causal=1),
    _attn("Attention-cross-scale", lambda g: [g.n(B, 2, 2, D), g.n(B, 2, 5, D),
                                              g.n(B, 2, 5, D)], scale=0.3),
    _attn("Attention-float-mask-trained", lambda g: [g.n(B, 2, S, D), g.n(B, 2, S, D),
                                                     g.n(B, 2, S, D), g.n(2, S, S)]),
    _attn("Attention-bool-mask", lambda g: [
        g.n(B, 2, S, D), g.n(B, 2, S, D), g.n(B, 2, S, D),
        np.array([[True, False, True], [True, True, False], [False, True, True]])]),
    _attn("Attention-3d-gqa", lambda g: [g.n(B, S, 4 * D), g.n(B, S, 2 * D), g.n(B, S, 2 * D)],
          q_num_heads=4, kv_num_heads=2),
    _attn("Attention-const-kv", lambda g: [g.n(B, 2, S, D), Const(g.n(B, 2, S, D)),
                                           g.n(B, 2, S, D)], is_causal=1),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


def test_kv_cache_is_refused_naming_the_node() -> None:
    nodes = [helper.make_node("Attention", ["x", "x", "x", "", "x", "x"], ["y", "pk", "pv"],
                              name="attn0")]
    assert lowering_error(nodes, [1, 1, 2, 4], opset=23) == (
        "gradient rule of Attention failed on node 'attn0': Attention 'attn0' with "
        "past_key/past_value (a KV cache) is not differentiated; export the attention "
        "without them")
