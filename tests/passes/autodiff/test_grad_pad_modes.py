"""Pad's reflect, edge and wrap modes against central differences (the harness of
``grad_harness``; then float32 on onnxruntime): each mode on one and two axes, one-sided pads,
pads as large as the mode allows, the axes input; and
against torch's ``F.pad`` gradients in float64; the forms without a rule refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from grad_harness import case, check_case, lowering_error


def _pad(mode: str, shape, pads, axes=None, opset: int = 18):
    cid = f"Pad-{mode}-{'x'.join(map(str, shape))}-{'_'.join(map(str, pads))}" + \
        (f"-axes{'_'.join(map(str, axes))}" if axes else "") + f"-op{opset}"
    extra = [None, np.array(axes)] if axes else []
    return case(cid, "Pad", lambda g: [g.n(*shape), np.array(pads), *extra], mode=mode,
                opset=opset)


CASES = [
    _pad("reflect", (2, 3, 5), [0, 0, 2, 0, 0, 1]),
    _pad("reflect", (1, 2, 4, 5), [0, 0, 3, 1, 0, 0, 2, 4]),  # pads up to extent - 1
    _pad("reflect", (1, 2, 4, 5), [0, 0, 0, 2, 0, 0, 1, 0]),  # one-sided on each axis
    _pad("reflect", (2, 4, 5), [1, 2, 3, 0], axes=[1, -1]),
    _pad("edge", (2, 3, 5), [0, 1, 3, 0, 2, 2]),
    _pad("edge", (1, 1, 1, 4), [0, 0, 2, 1, 0, 0, 3, 0]),  # an extent of 1
    _pad("wrap", (2, 3, 5), [0, 2, 5, 0, 3, 1], opset=19),  # a pad of the whole extent
    _pad("wrap", (3, 4), [1, 2], axes=[0], opset=19),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_pad_mode_gradient_matches_central_differences(c) -> None:
    check_case(c)


@pytest.mark.parametrize("mode,torch_mode", [("reflect", "reflect"), ("edge", "replicate"),
                                             ("wrap", "circular")])
def test_pad_mode_gradient_is_torchs(mode: str, torch_mode: str) -> None:
    """The same gradient as torch's F.pad in float64, weighted by a random output gradient."""
    import torch

    from grad_harness import grads_of

    c = _pad(mode, (2, 3, 4, 5), [0, 0, 2, 3, 0, 0, 1, 2], opset=19)
    got, weights = grads_of(c)
    x = torch.from_numpy(c.inputs["in0"]).requires_grad_()
    y = torch.nn.functional.pad(x, (3, 2, 2, 1), mode=torch_mode)
    (y * torch.from_numpy(weights["w0"])).sum().backward()
    np.testing.assert_allclose(got["in0"], x.grad.numpy(), rtol=1e-12, atol=1e-12)


def _pad_nodes(pads, mode: str):
    value = numpy_helper.from_array(np.array(pads, np.int64))
    return [helper.make_node("Constant", [], ["pads"], name="pads0", value=value),
            helper.make_node("Pad", ["x", "pads"], ["y"], name="pad0", mode=mode)]


def test_a_reflect_pad_that_crops_or_has_a_run_time_extent_names_the_mode_and_the_node() -> None:
    assert lowering_error(_pad_nodes([0, -1, 0, 1], "reflect"), [2, 3]) == (
        "gradient rule of Pad failed on node 'pad0': Pad mode 'reflect' along axis 1 (extent 3, "
        "pads -1, 1) has no gradient rule: it needs a static extent and pads from 0 to the "
        "extent - 1; pad a static extent")
    assert lowering_error(_pad_nodes([0, 1, 0, 0], "edge"), [2, "w"]) == (
        "gradient rule of Pad failed on node 'pad0': Pad mode 'edge' along axis 1 (extent None, "
        "pads 1, 0) has no gradient rule: it needs a static extent and pads from 0 up; pad a "
        "static extent")
