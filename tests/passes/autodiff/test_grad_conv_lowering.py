"""Forward Convs with few output positions run as one MatMul of im2col columns
(``lowering.lower_short_convs``): which Convs, their gradients against central differences,
and the accuracy of a speech feature encoder's strided Conv1d against torch float64."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from grad_harness import Case, Runner, check_case, grad_model, weights_for
from onnx import helper


def _case(cid: str, x: tuple, w: tuple, bias: bool = False, symbolic: bool | str = False,
          **attrs) -> Case:
    rng = np.random.default_rng(len(cid))
    inputs = {"x": rng.standard_normal(x), "W": rng.standard_normal(w)}
    if bias:
        inputs["B"] = rng.standard_normal(w[0])
    consts = {}
    if symbolic:  # a symbolic batch: W a constant of static shape
        consts["W"] = inputs.pop("W")
    node = helper.make_node("Conv", ["x", "W", *(["B"] if bias else [])], ["y"], name="conv",
                            **attrs)
    return Case(cid, [node], inputs, consts, ["y"], symbolic=symbolic)


LOWERED = [
    _case("1d-bias-pads-dilation", (2, 48, 9), (20, 48, 3), bias=True, strides=[2],
          pads=[1, 2], dilations=[2]),
    _case("2d-stride-pads", (2, 16, 4, 5), (24, 16, 3, 3), strides=[1, 2], pads=[1, 1, 1, 0]),
    _case("1d-symbolic-batch", (3, 48, 8), (20, 48, 3), symbolic="batch", strides=[2]),
]
KEPT = [
    _case("few-channels-x-taps", (2, 3, 9), (4, 3, 3), strides=[2]),  # 9 products a sum
    _case("128-positions", (1, 48, 130), (160, 48, 3)),
    _case("fewer-out-channels-than-positions", (1, 48, 40), (20, 48, 3)),
    _case("grouped", (2, 48, 9), (48, 24, 3), group=2),
]


@pytest.mark.parametrize("case", LOWERED + KEPT, ids=[c.id for c in LOWERED + KEPT])
def test_forward_conv_on_few_positions_is_one_matmul(case: Case) -> None:
    """A group-1 Conv with under 128 output positions, more than 128 input channels x taps
    and more output channels than positions (its batch may be symbolic) runs as one MatMul
    of im2col columns: the node, now a Transpose, keeps its name and output; its gradients
    match central differences. Other Convs stay Convs."""
    graph = grad_model(case, np.float32, weights_for(case)).graph
    (node,) = [n for n in graph.node if n.output[0] == "y"]
    assert (node.op_type, node.name) == ("Transpose" if case in LOWERED else "Conv", "conv")
    if case in LOWERED:
        assert "Conv" not in [n.op_type for n in graph.node if n.name.startswith("conv/")]
        check_case(case)


@pytest.mark.parametrize("length, kernel", [(39, 3), (19, 2), (9, 2)])
def test_strided_conv1d_with_a_short_output_is_as_accurate_as_torch(length, kernel) -> None:
    """A speech feature encoder's Conv1d (512 channels, stride 2, 4 to 19 outputs): float32
    output and gradients against torch float64, rms error at most 1.6x torch float32's
    (onnxruntime's Conv: 2.5-3.9x, its GEMM summing up to 1024 products in sequence)."""
    rng = np.random.default_rng(length)
    x = rng.standard_normal((3, 512, length))
    w = rng.standard_normal((512, 512, kernel)) / np.sqrt(512 * kernel)
    g = rng.standard_normal((3, 512, (length - kernel) // 2 + 1))
    case = Case(f"conv1d-{length}", [helper.make_node("Conv", ["x", "W"], ["y"], strides=[2])],
                {"x": x, "W": w}, {}, ["y"])
    model = grad_model(case, np.float32, {"w0": g})
    model.graph.output.append(onnx.ValueInfoProto(name="y"))
    got = Runner(model, ort_only=True)({"x": x.astype(np.float32), "W": w.astype(np.float32)})
    ref = {}
    for dtype in (torch.float64, torch.float32):
        xt, wt = (torch.tensor(a.astype(np.float32), dtype=dtype, requires_grad=True)
                  for a in (x, w))
        y = torch.nn.functional.conv1d(xt, wt, stride=2)
        (y * torch.tensor(g, dtype=dtype)).sum().backward()
        ref[dtype] = [t.detach().numpy().astype(np.float64) for t in (y, xt.grad, wt.grad)]

    def rms(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))
    for name, mine, t32, t64 in zip(["y", "x.grad", "W.grad"], [got[-1], *got[1:3]],
                                    ref[torch.float32], ref[torch.float64]):
        assert rms(mine, t64) <= 1.6 * rms(t32, t64), (name, rms(mine, t64), rms(t32, t64))
