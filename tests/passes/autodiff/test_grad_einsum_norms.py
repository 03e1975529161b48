"""Einsum and the normalizations without saved statistics against central differences (the
harness of ``grad_harness``): Einsum (products, attention, implicit output, ellipsis
broadcasting, labels summed by one operand), InstanceNormalization, GroupNormalization
(opset 21), RMSNormalization, MeanVarianceNormalization, LRN, LpNormalization."""
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
    for cid, shape, groups, attrs in [
            ("GroupNorm-21", (2, 6, 2, 3), 3, {}),
            ("GroupNorm-21-one-group-1d", (3, 4, 5), 1, {"epsilon": 1e-3})]:
        g = Gen(cid)
        add(_shaped(cid, "GroupNormalization", {"x": g.n(*shape), "scale": g.n(shape[1]),
                                                "bias": g.n(shape[1])}, opset=21,
                    num_groups=groups, stash_type=TensorProto.DOUBLE, **attrs))
    add(case("RMSNorm-last", "RMSNormalization", lambda g: [g.n(2, 3, 4), g.n(4)], opset=23,
             stash_type=TensorProto.DOUBLE))
    add(case("RMSNorm-axis1-bcast-scale", "RMSNormalization", lambda g: [g.n(2, 3, 4), g.n(1, 4)],
             axis=1, epsilon=1e-3, opset=23, stash_type=TensorProto.DOUBLE))
    # ONNX's float64 MeanVarianceNormalization adds a float32 epsilon and fails to run
    add(_shaped("MVN-default-axes", "MeanVarianceNormalization",
                {"x": Gen("MVN").n(2, 3, 2, 3)}, reference=True))
    add(case("MVN-last-axis", "MeanVarianceNormalization", lambda g: [g.n(3, 5)], axes=[1],
             reference=True))
    for size in (3, 5):  # onnxruntime's LRN takes odd sizes only
        add(case(f"LRN-size{size}", "LRN", lambda g: [g.n(2, 5, 2, 3)], size=size, alpha=0.3,
                 beta=0.75, bias=1.5))
    # every dimension symbolic (read at run time)
    add(case("Einsum-attention-symbolic", "Einsum", lambda g: [g.n(2, 3, 4), g.n(2, 5, 4)],
             equation="bid,bjd->bij", symbolic=True))
    add(case("Einsum-ellipsis-linear-symbolic", "Einsum", lambda g: [g.n(2, 3, 4), g.n(4, 5)],
             equation="...ij,jk->...ik", symbolic=True))
    add(case("InstanceNorm-symbolic", "InstanceNormalization",
             lambda g: [g.n(2, 3, 4), g.n(3), g.n(3)], symbolic=True))
    add(case("RMSNorm-symbolic", "RMSNormalization", lambda g: [g.n(2, 3, 4), g.n(4)],
             opset=23, stash_type=TensorProto.DOUBLE, symbolic=True))
    add(case("LRN-symbolic", "LRN", lambda g: [g.n(2, 4, 3, 2)], size=3, symbolic=True))
    add(case("LpNorm-symbolic", "LpNormalization", lambda g: [g.away(3, 4)], symbolic=True))
    for p in (1, 2):
        add(case(f"LpNorm-p{p}-last", "LpNormalization", lambda g: [g.away(3, 4)], p=p))
        add(case(f"LpNorm-p{p}-axis0", "LpNormalization", lambda g: [g.away(3, 2, 4)], p=p,
                 axis=0))
    return out


def _shaped(cid, op, inputs: dict, opset: int = 18, reference: bool = False, **attrs):
    """``op`` on ``inputs`` (the first is x), then a CastLike to x's type and a Reshape to x's
    shape: ONNX's shape inference gives the output of GroupNormalization (and of float64
    MeanVarianceNormalization) neither (their function bodies do not infer), and the loss's
    broadcasting gradient needs the rank."""
    names = list(inputs)
    built = graph_case(cid, [mk(op, names, ["out"], **attrs),
                             mk("CastLike", ["out", names[0]], ["typed"]),
                             mk("Reshape", ["typed", "shape"], ["y"])],
                       inputs, {"shape": np.array(inputs[names[0]].shape)}, opset=opset)
    built.reference = reference
    return built


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
