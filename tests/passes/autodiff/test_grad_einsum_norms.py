"""Einsum and the normalizations without saved statistics against central differences (the
harness of ``grad_harness``): Einsum (products, attention, implicit output, ellipsis
broadcasting, labels summed by one operand), InstanceNormalization, GroupNormalization
(opset 18 and 21), LpNormalization."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from grad_harness import Const, Gen, case, check_case, graph_case, lowering_error, mk

# onnxruntime crashes on ellipses of different ranks and refuses an ellipsis that the output
# drops, so the forward ops below avoid both
EINSUM = [("matmul", "ij,jk->ik", [(3, 4), (4, 5)]),
          ("attention", "bhid,bhjd->bhij", [(2, 2, 3, 4), (2, 2, 5, 4)]),
          ("attention-values", "bhij,bhjd->bhid", [(2, 2, 3, 5), (2, 2, 5, 4)]),
          ("implicit", "ij,jk", [(3, 4), (4, 5)]),
          ("transpose", "ij->ji", [(3, 4)]),
          ("sum-all", "ij->", [(3, 4)]),
          ("dot", "i,i->", [(5,), (5,)]),
          ("three", "ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
          ("outer-spaces", "i, j -> ij", [(3,), (4,)]),
          ("summed-by-one", "ijk,k->i", [(2, 3, 4), (4,)]),
          ("ellipsis", "...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
          ("ellipsis-bcast-ones", "...ij,...jk->...ik", [(1, 3, 3, 4), (2, 1, 4, 5)]),
          ("ellipsis-linear", "...ij,jk->...ik", [(2, 3, 4), (4, 5)]),
          ("bilinear", "bi,oij,bj->bo", [(2, 3), (4, 3, 5), (2, 5)])]


def _cases() -> list:
    out = []
    add = out.append
    for cid, eq, shapes in EINSUM:
        add(case(f"Einsum-{cid}", "Einsum", lambda g, s=shapes: [g.n(*d) for d in s],
                 equation=eq))
    add(case("Einsum-const-operand", "Einsum", lambda g: [g.n(3, 4), Const(g.n(4, 5))],
             equation="ij,jk->ik"))
    add(case("InstanceNorm-4d", "InstanceNormalization",
             lambda g: [g.n(2, 3, 3, 4), g.n(3), g.n(3)], epsilon=1e-3))
    add(case("InstanceNorm-1d-const-affine", "InstanceNormalization",
             lambda g: [g.n(2, 4, 5), Const(g.pos(4)), Const(g.n(4))]))
    for cid, shape, groups, channels, opset, extra in [
            ("GroupNorm-21", (2, 6, 2, 3), 3, 6, 21, {"stash_type": TensorProto.DOUBLE}),
            ("GroupNorm-21-one-group-1d", (3, 4, 5), 1, 4, 21,
             {"stash_type": TensorProto.DOUBLE, "epsilon": 1e-3})]:
        add(_group_norm(cid, shape, groups, channels, opset, extra))
    for p in (1, 2):
        add(case(f"LpNorm-p{p}-last", "LpNormalization", lambda g: [g.away(3, 4)], p=p))
        add(case(f"LpNorm-p{p}-axis0", "LpNormalization", lambda g: [g.away(3, 2, 4)], p=p,
                 axis=0))
    return out


def _group_norm(cid, shape, groups, channels, opset, attrs):
    """GroupNormalization, then a CastLike to x's type and a Reshape to its own shape: ONNX's
    shape inference gives the op's output neither (its function body does not infer), and
    the loss's broadcasting gradient needs the rank."""
    g = Gen(cid)
    return graph_case(cid, [mk("GroupNormalization", ["x", "scale", "bias"], ["gn"],
                               num_groups=groups, **attrs),
                            mk("CastLike", ["gn", "x"], ["typed"]),
                            mk("Reshape", ["typed", "shape"], ["y"])],
                      {"x": g.n(*shape), "scale": g.n(channels), "bias": g.n(channels)},
                      {"shape": np.array(shape)}, opset=opset)


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


def test_einsum_diagonal_is_refused_with_the_node() -> None:
    nodes = [helper.make_node("Einsum", ["x"], ["y"], name="diag0", equation="ii->i")]
    assert lowering_error(nodes, [3, 3]) == (
        "gradient rule of Einsum failed on node 'diag0': Einsum operand 0 of 'ii->i' repeats a "
        "label (a diagonal), which is not differentiated; take the diagonal with a mask and a "
        "sum instead")
