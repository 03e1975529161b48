"""SplitToSequence + SequenceAt (torch.chunk / torch.split in an unoptimized dynamo export)
against central differences (the harness of ``grad_harness``)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from grad_harness import Gen, check_case, graph_case, mk


def _split_case(cid: str, shape, split, picks, axis: int, keepdims: int = 1):
    nodes, ins = [], ["x"]
    if split is not None:
        nodes.append(helper.make_node("Constant", [], ["split"], name="const_split",
                                      value=numpy_helper.from_array(np.asarray(split,
                                                                               np.int64))))
        ins.append("split")
    nodes.append(mk("SplitToSequence", ins, ["seq"], axis=axis, keepdims=keepdims))
    outs = []
    for k, pos in enumerate(picks):
        nodes.append(helper.make_node("Constant", [], [f"p{k}"], name=f"const_p{k}",
                                      value=numpy_helper.from_array(np.array(pos, np.int64))))
        nodes.append(mk("SequenceAt", ["seq", f"p{k}"], [f"piece{k}"]))
        outs.append(f"piece{k}")
    return graph_case(cid, nodes, {"x": Gen(cid).n(*shape)}, outputs=outs)


CASES = [
    _split_case("Split-chunks-last-axis", (2, 6), np.array(2), [0, 2, 1], axis=-1),
    # the short last chunk alone: ONNX's inference gives every element of a sequence one
    # shape, which onnxruntime then enforces on parts of different sizes
    _split_case("Split-chunks-uneven-last", (3, 5), np.array(2), [2], axis=1),
    _split_case("Split-sizes-axis0", (6, 2), [2, 4], [1, 0, 1], axis=0),
    _split_case("Split-ones-no-keepdims", (2, 3, 2), None, [2, 0], axis=1, keepdims=0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)
