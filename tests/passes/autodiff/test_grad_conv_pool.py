"""Convolution and pooling gradient rules against central differences (the harness of
``grad_harness``), and the forms their backward graphs take: Conv/ConvTranspose (groups,
depthwise, strides, dilations, pads, auto_pad, 1-D to 3-D, symbolic sizes) and
MaxPool/AveragePool/GlobalAveragePool/GlobalMaxPool, MaxUnpool, Col2Im."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from grad_harness import (Case, Runner, check_case, check_reuse, grad_model, grads_of,
                          loss_model, op_case)
from grad_harness import case as make_case
from grad_harness import weights_for
from ngdist.errors import GradientError
from ngdist.passes.autodiff import AutodiffPass


def _cases() -> list[Case]:
    cases: list[Case] = []

    def c(cid: str, op: str, make, **kw):  # make(gen) -> list of inputs
        cases.append(make_case(cid, op, make, **kw))

    # --- convolution --------------------------------------------------------------------------
    c("Conv-2d", "Conv", lambda g: [g.n(2, 3, 5, 5), g.n(4, 3, 3, 3)])
    c("Conv-bias-pads", "Conv", lambda g: [g.n(2, 2, 5, 4), g.n(3, 2, 3, 2), g.n(3)],
      pads=[1, 0, 1, 1])
    c("Conv-stride-floor", "Conv", lambda g: [g.n(1, 2, 7, 6), g.n(2, 2, 3, 3)], strides=[2, 2])
    c("Conv-stride-unused-taps", "Conv", lambda g: [g.n(1, 1, 10, 5), g.n(2, 1, 2, 2)],
      strides=[3, 2])
    c("Conv-dilation", "Conv", lambda g: [g.n(1, 2, 7, 7), g.n(2, 2, 3, 2)], dilations=[2, 3],
      strides=[2, 1], pads=[1, 2, 0, 1])
    c("Conv-group", "Conv", lambda g: [g.n(2, 4, 5, 5), g.n(6, 2, 3, 3), g.n(6)], group=2,
      strides=[2, 2], pads=[1, 1, 1, 1])
    c("Conv-depthwise", "Conv", lambda g: [g.n(2, 3, 6, 6), g.n(3, 1, 3, 3), g.n(3)], group=3)
    # the depthwise weight gradient tap by tap: strides that drop rows, dilation, uneven pads
    c("Conv-depthwise-stride-dilation-pads", "Conv",
      lambda g: [g.n(2, 3, 8, 7), g.n(3, 1, 3, 2)], group=3, strides=[2, 3], dilations=[2, 1],
      pads=[1, 0, 2, 1])
    c("Conv-depthwise-same-centre", "Conv", lambda g: [g.n(2, 4, 5, 5), g.n(4, 1, 3, 3)],
      group=4, pads=[1, 1, 1, 1])
    c("Conv-depthwise-1d", "Conv", lambda g: [g.n(2, 3, 9), g.n(3, 1, 3)], group=3, strides=[2])
    c("Conv-depthwise-7x7", "Conv", lambda g: [g.n(2, 2, 5, 5), g.n(2, 1, 7, 7)], group=2,
      pads=[3, 3, 3, 3])
    c("Conv-depthwise-multiplier-2", "Conv", lambda g: [g.n(2, 3, 6, 6), g.n(6, 1, 3, 3)],
      group=3, pads=[1, 1, 1, 1])
    for pad in ("SAME_UPPER", "SAME_LOWER", "VALID"):
        c(f"Conv-{pad}", "Conv", lambda g: [g.n(1, 2, 7, 6), g.n(3, 2, 3, 4)], auto_pad=pad,
          strides=[2, 2])
    c("Conv-1d", "Conv", lambda g: [g.n(2, 3, 9), g.n(4, 3, 3), g.n(4)], strides=[2],
      pads=[1, 2], dilations=[2])
    c("Conv-1d-group", "Conv", lambda g: [g.n(2, 4, 8), g.n(4, 2, 3)], group=2)
    c("Conv-3d", "Conv", lambda g: [g.n(1, 2, 4, 4, 3), g.n(2, 2, 2, 3, 2)], strides=[2, 1, 1])
    c("Conv-stride-dilation-pads", "Conv", lambda g: [g.n(2, 2, 9, 8), g.n(3, 2, 3, 2), g.n(3)],
      strides=[2, 3], dilations=[2, 1], pads=[1, 0, 2, 1])
    c("Conv-1x1", "Conv", lambda g: [g.n(2, 3, 4, 5), g.n(4, 3, 1, 1)])
    # stride 1 on a small map: the data gradient is a Conv of the flipped output gradient
    c("Conv-small-map-flipped-pads-dilation", "Conv",
      lambda g: [g.n(2, 3, 4, 3), g.n(2, 3, 3, 2), g.n(2)], dilations=[1, 2], pads=[2, 0, 1, 2])
    c("Conv-small-map-flipped-depthwise", "Conv",
      lambda g: [g.n(2, 3, 3, 4), g.n(3, 1, 3, 3)], group=3, pads=[1, 2, 0, 1])
    c("Conv-8ch-same", "Conv", lambda g: [g.n(1, 8, 4, 4), g.n(2, 8, 3, 3), g.n(2)],
      pads=[1, 1, 1, 1])
    c("Conv-8ch-stride-dilation-pads", "Conv", lambda g: [g.n(1, 8, 7, 6), g.n(2, 8, 3, 2)],
      strides=[2, 3], dilations=[2, 1], pads=[1, 0, 2, 1])
    c("Conv-8ch-1x1", "Conv", lambda g: [g.n(2, 8, 3, 3), g.n(3, 8, 1, 1)])
    # few output positions, many output channels: the weight gradient is one im2col product
    c("Conv-8ch-columns", "Conv", lambda g: [g.n(2, 8, 3, 3), g.n(16, 8, 3, 3), g.n(16)])
    c("Conv-8ch-columns-stride-pads", "Conv", lambda g: [g.n(2, 8, 4, 4), g.n(64, 8, 3, 2)],
      strides=[2, 2], pads=[1, 0, 1, 1])
    # few output positions, > 128 input channels x taps: the forward Conv is one MatMul
    c("Conv-1d-short-matmul", "Conv", lambda g: [g.n(2, 48, 9), g.n(20, 48, 3), g.n(20)],
      strides=[2], pads=[1, 2], dilations=[2])
    c("Conv-2d-short-matmul", "Conv", lambda g: [g.n(2, 16, 4, 5), g.n(24, 16, 3, 3)],
      strides=[1, 2], pads=[1, 1, 1, 0])
    c("Conv-symbolic-batch", "Conv", lambda g: [g.n(2, 2, 5, 5), g.n(3, 2, 3, 3)],
      strides=[2, 2], symbolic="batch")
    # sizes known only at run time: read with Shape in the backward graph
    c("Conv-symbolic-spatial-stride-pads", "Conv",
      lambda g: [g.n(2, 8, 9, 8), g.n(3, 8, 3, 2), g.n(3)], strides=[2, 3], dilations=[2, 1],
      pads=[1, 0, 2, 1], symbolic="spatial")
    c("Conv-symbolic-all-group", "Conv", lambda g: [g.n(2, 4, 7, 6), g.n(4, 2, 3, 3)],
      kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 0, 0], group=2, symbolic=True)
    c("Conv-symbolic-spatial-group-1d", "Conv", lambda g: [g.n(2, 4, 9), g.n(6, 2, 3)],
      strides=[2], group=2, symbolic="spatial")
    c("ConvTranspose-symbolic-spatial", "ConvTranspose",
      lambda g: [g.n(1, 2, 3, 4), g.n(2, 3, 3, 2), g.n(3)], strides=[2, 3],
      output_padding=[1, 2], pads=[1, 0, 0, 1], symbolic="spatial")
    c("ConvTranspose-2d", "ConvTranspose", lambda g: [g.n(2, 3, 3, 3), g.n(3, 2, 3, 3)])
    c("ConvTranspose-8ch", "ConvTranspose", lambda g: [g.n(1, 2, 3, 3), g.n(2, 8, 2, 2)],
      strides=[2, 2])
    c("ConvTranspose-stride-outpad", "ConvTranspose",
      lambda g: [g.n(1, 2, 3, 4), g.n(2, 3, 3, 2), g.n(3)], strides=[2, 3],
      output_padding=[1, 2], pads=[1, 0, 0, 1])
    c("ConvTranspose-group", "ConvTranspose", lambda g: [g.n(2, 4, 3, 3), g.n(4, 2, 2, 2)],
      group=2, strides=[2, 2])
    c("ConvTranspose-dilation", "ConvTranspose", lambda g: [g.n(1, 2, 3, 3), g.n(2, 2, 2, 2)],
      dilations=[2, 2], strides=[2, 1], output_padding=[1, 0])
    c("ConvTranspose-1d", "ConvTranspose", lambda g: [g.n(2, 2, 5), g.n(2, 3, 3), g.n(3)],
      strides=[3], output_padding=[2], pads=[1, 1])
    # --- pooling ------------------------------------------------------------------------------
    c("MaxPool-2x2", "MaxPool", lambda g: [g.distinct(2, 2, 4, 4)], kernel_shape=[2, 2],
      strides=[2, 2])
    c("MaxPool-overlap-pads", "MaxPool", lambda g: [g.distinct(1, 2, 5, 6)], kernel_shape=[3, 3],
      strides=[2, 2], pads=[1, 1, 1, 1])
    c("MaxPool-ceil", "MaxPool", lambda g: [g.distinct(1, 1, 5, 5)], kernel_shape=[2, 2],
      strides=[2, 2], ceil_mode=1)
    c("MaxPool-dilation", "MaxPool", lambda g: [g.distinct(1, 1, 6, 5)], kernel_shape=[2, 2],
      dilations=[2, 1])
    c("MaxPool-1d", "MaxPool", lambda g: [g.distinct(2, 2, 7)], kernel_shape=[3], strides=[2])
    c("MaxPool-same-upper", "MaxPool", lambda g: [g.distinct(1, 1, 5, 6)], kernel_shape=[3, 3],
      strides=[2, 2], auto_pad="SAME_UPPER")
    c("MaxPool-with-indices", "MaxPool", lambda g: [g.distinct(2, 1, 4, 4)], n_out=2,
      kernel_shape=[2, 2], strides=[1, 1])
    c("MaxPool-symbolic-batch", "MaxPool", lambda g: [g.distinct(2, 2, 4, 4)],
      kernel_shape=[2, 2], strides=[2, 2], symbolic="batch")
    for cip in (0, 1):
        for ceil in (0, 1):
            c(f"AveragePool-pads-cip{cip}-ceil{ceil}", "AveragePool",
              lambda g: [g.n(2, 2, 7, 6)], kernel_shape=[3, 2], strides=[2, 2],
              pads=[1, 1, 1, 0], count_include_pad=cip, ceil_mode=ceil)
    for cip in (0, 1):
        c(f"AveragePool-symbolic-spatial-cip{cip}", "AveragePool", lambda g: [g.n(2, 2, 7, 6)],
          kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 1, 0], count_include_pad=cip,
          symbolic="spatial")
    for cip in (0, 1):  # ceil_mode's last windows reach past the end pad; sizes at run time
        c(f"AveragePool-symbolic-spatial-ceil-cip{cip}", "AveragePool",
          lambda g: [g.n(2, 2, 7, 6)], kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 1, 0],
          count_include_pad=cip, ceil_mode=1, symbolic="spatial")
        c(f"AveragePool-symbolic-spatial-ceil-overhang-cip{cip}", "AveragePool",
          lambda g: [g.n(1, 2, 5, 4)], kernel_shape=[4, 3], strides=[3, 2], pads=[1, 0, 0, 1],
          count_include_pad=cip, ceil_mode=1, symbolic="spatial")
    c("AveragePool-ceil-dilation-symbolic", "AveragePool", lambda g: [g.n(1, 2, 8, 7)],
      kernel_shape=[2, 3], strides=[3, 2], dilations=[2, 1], pads=[0, 1, 1, 0], ceil_mode=1,
      opset=19, symbolic="spatial")
    c("AveragePool-symbolic-spatial-drops-dilation", "AveragePool",
      lambda g: [g.n(1, 2, 8, 9)], kernel_shape=[2, 2], strides=[3, 3], dilations=[1, 2],
      opset=19, symbolic="spatial")
    c("AveragePool-1d", "AveragePool", lambda g: [g.n(2, 2, 7)], kernel_shape=[3], strides=[2],
      pads=[1, 1])
    c("AveragePool-same-lower", "AveragePool", lambda g: [g.n(1, 1, 6, 5)], kernel_shape=[3, 3],
      strides=[2, 2], auto_pad="SAME_LOWER")
    c("AveragePool-dilation", "AveragePool", lambda g: [g.n(1, 1, 6, 6)], kernel_shape=[2, 2],
      dilations=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1, opset=19)
    c("AveragePool-stride-drops", "AveragePool", lambda g: [g.n(1, 2, 8, 8)],
      kernel_shape=[2, 2], strides=[3, 3])
    c("AveragePool-tiles", "AveragePool", lambda g: [g.n(2, 3, 6, 4)], kernel_shape=[3, 2],
      strides=[3, 2])
    c("AveragePool-tiles-1d", "AveragePool", lambda g: [g.n(2, 2, 6)], kernel_shape=[2],
      strides=[2])
    c("GlobalAveragePool-2d", "GlobalAveragePool", lambda g: [g.n(2, 3, 4, 5)])
    c("GlobalAveragePool-1d", "GlobalAveragePool", lambda g: [g.n(2, 3, 4)])
    c("GlobalMaxPool", "GlobalMaxPool", lambda g: [g.distinct(2, 3, 3, 3)])

    # Col2Im (F.fold): columns [N, C * block, L] folded into [N, C, H, W]
    c("Col2Im-2x2-stride1", "Col2Im", lambda g: [g.n(2, 3 * 4, 9), np.array([4, 4]),
                                                  np.array([2, 2])])
    c("Col2Im-stride-dilation-pads", "Col2Im",
      lambda g: [g.n(1, 2 * 6, 6), np.array([5, 6]), np.array([2, 3])], strides=[2, 2],
      dilations=[2, 1], pads=[1, 0, 0, 1])
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case: Case) -> None:
    check_case(case)


@pytest.mark.parametrize("hw, k, s, p, cip, symbolic", [
    ((2, 3), 7, 7, 0, 0, False), ((2, 3), 7, 7, 0, 1, False),  # one window over the whole map
    ((2, 3), 7, 7, 0, 0, True), ((2, 3), 7, 7, 0, 1, True),
    ((7, 6), 3, 2, 1, 0, True), ((7, 6), 3, 2, 1, 1, True),
    ((5, 4), 4, 3, 1, 0, False), ((5, 4), 4, 3, 1, 1, True)])
def test_average_pool_ceil_mode_gradient_matches_torch_float64(hw, k, s, p, cip,
                                                               symbolic) -> None:
    """ceil_mode windows that reach past the input and its end pad (Hugging Face
    EfficientNet's pooler: a kernel of hidden_dim over a 2x2 map), static or read at run time,
    count_include_pad 0/1: ngdist's float32 gradient on onnxruntime against torch autograd in
    float64 (ONNX's reference AveragePool gives NaN for a window over the whole map, and
    onnxruntime has no float64 AveragePool, so the central differences cannot serve)."""
    import torch

    cid = f"AveragePool-torch-{hw}-{k}-{s}-{p}-{cip}-{symbolic}"
    x = np.random.default_rng(5).standard_normal((2, 3, *hw))
    case = make_case(cid, "AveragePool", lambda g: [x], kernel_shape=[k, k], strides=[s, s],
                     pads=[p] * 4, count_include_pad=cip, ceil_mode=1,
                     symbolic="spatial" if symbolic else False)
    xt = torch.tensor(x, requires_grad=True)
    y = torch.nn.functional.avg_pool2d(xt, k, s, p, ceil_mode=True, count_include_pad=bool(cip))
    w = np.random.default_rng(6).standard_normal(tuple(y.shape))
    loss = (y * torch.from_numpy(w)).sum()
    loss.backward()
    lowered = grad_model(case, np.float32, {"w0": w})
    if hw[0] < k and not symbolic:  # one window, static: the scaled value expanded, no
        # transposed window as large as the kernel
        backward = {n.op_type for n in lowered.graph.node if "/grad/" in n.name}
        assert "Expand" in backward and "ConvTranspose" not in backward
    got = Runner(lowered, ort_only=True)({"in0": x.astype(np.float32)})
    assert abs(float(got[0]) - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
    expected = xt.grad.numpy()
    np.testing.assert_allclose(got[1], expected, rtol=1e-5,
                               atol=1e-6 * float(np.abs(expected).max()))


@pytest.mark.parametrize("cid", ["MaxPool-2x2", "MaxPool-with-indices"])
def test_backward_reuses_the_forward_op(cid: str) -> None:
    check_reuse(next(c for c in CASES if c.id == cid))


def test_max_pool_ties_go_to_the_first_maximum() -> None:
    x = np.ones((1, 1, 4, 4))
    grads, w = grads_of(op_case("MaxPool-ties", "MaxPool", [x], kernel_shape=[3, 3],
                              strides=[1, 1]))
    expected = np.zeros((4, 4))
    for i in range(2):
        for j in range(2):
            expected[i, j] += w["w0"][0, 0, i, j]  # window (i, j) starts at (i, j)
    np.testing.assert_array_equal(grads["in0"][0, 0], expected)


def test_max_pool_disjoint_windows_ties_go_to_the_first_maximum_in_float32() -> None:
    """2x2 windows with stride 2 share no element: the float32 backward writes the gradient
    with MaxUnpool (no scatter-add), still to the first maximum of each window."""
    x = np.ones((1, 1, 4, 4))
    x[0, 0, 3, 3] = 2.0  # one window with a unique maximum at its last element
    case = op_case("MaxPool-disjoint-ties", "MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    weights = weights_for(case)
    model = grad_model(case, np.float32, weights)
    assert [n.op_type for n in model.graph.node].count("MaxUnpool") == 1
    assert not [n for n in model.graph.node if n.op_type == "ScatterElements"]
    got = Runner(model, ort_only=True)({"in0": x.astype(np.float32)})[1]
    expected = np.zeros((4, 4))
    w = weights["w0"][0, 0]
    for (i, j), (r, c) in {(0, 0): (0, 0), (0, 1): (0, 2), (1, 0): (2, 0), (1, 1): (3, 3)}.items():
        expected[r, c] = w[i, j]
    np.testing.assert_allclose(got[0, 0], expected, rtol=1e-6)


@pytest.mark.parametrize("cid, spread", [("AveragePool-tiles", "Resize"),
                                         ("AveragePool-tiles-1d", "Resize"),
                                         ("AveragePool-stride-drops", "ConvTranspose"),
                                         ("AveragePool-dilation", "ConvTranspose")])
def test_average_pool_gradient_is_an_upsampling_when_windows_tile(cid: str, spread: str) -> None:
    """float32: windows that tile the input (stride == kernel, no pads, sizes divisible)
    spread the gradient with a nearest Resize, other windows with a ConvTranspose."""
    case = next(c for c in CASES if c.id == cid)
    lowered = grad_model(case, np.float32, weights_for(case))
    backward = {n.op_type for n in lowered.graph.node if n.name.startswith("node0/grad/")}
    assert spread in backward and not backward & ({"Resize", "ConvTranspose"} - {spread})


@pytest.mark.parametrize("cid, by_tap", [("Conv-8ch-same", True),
                                         ("Conv-8ch-stride-dilation-pads", True),
                                         ("Conv-8ch-1x1", True), ("ConvTranspose-8ch", True),
                                         ("Conv-2d", False), ("Conv-group", False)])
def test_conv_weight_gradient_is_one_matmul_per_kernel_tap(cid: str, by_tap: bool) -> None:
    """Group-1 convolutions with at least 8 input channels (of the Conv whose weight gradient
    it is: the output channels of a ConvTranspose): the weight gradient is prod(kernel) matrix
    products over the channels-last input and no second Conv; fewer channels or groups keep
    the single Conv of input and output gradient."""
    case = next(c for c in CASES if c.id == cid)
    lowered = grad_model(case, np.float32, weights_for(case))
    ops = [n.op_type for n in lowered.graph.node if n.name.startswith("node0/grad/")]
    taps = int(np.prod(case.inputs["in1"].shape[2:]))
    # a ConvTranspose's data gradient is a Conv, and so is a stride-1 Conv's on a small map
    data_conv = case.nodes[0].op_type == "ConvTranspose" or "ConvTranspose" not in ops
    if by_tap:
        assert ops.count("MatMul") == taps and ops.count("Conv") == data_conv
    else:
        assert "MatMul" not in ops and ops.count("Conv") == 1 + data_conv


@pytest.mark.parametrize("cid", ["Conv-8ch-columns", "Conv-8ch-columns-stride-pads"])
def test_conv_weight_gradient_on_few_positions_is_one_product(cid: str) -> None:
    """Output positions x 16 <= output channels: the taps' slices are stacked as im2col
    columns and the weight gradient is one MatMul, already in W's layout (no Transpose of it
    and no second Conv)."""
    case = next(c for c in CASES if c.id == cid)
    lowered = grad_model(case, np.float32, weights_for(case))
    nodes = [n for n in lowered.graph.node if n.name.startswith("node0/grad/")]
    ops = [n.op_type for n in nodes]
    data_conv = "ConvTranspose" not in ops
    assert ops.count("MatMul") == 1 and ops.count("Conv") == data_conv
    # no [M, taps, C] -> [M, C, taps] transpose of the weight gradient
    assert not [n for n in nodes if n.op_type == "Transpose"
                and list(n.attribute[0].ints) == [0, 2, 1]]


@pytest.mark.parametrize("cid,grouped", [("Conv-depthwise", False), ("Conv-depthwise-1d", False),
                                         ("Conv-depthwise-7x7", True),
                                         ("Conv-depthwise-multiplier-2", True)])
def test_depthwise_weight_gradient_goes_tap_by_tap_up_to_5x5(cid: str, grouped: bool) -> None:
    """A depthwise Conv's weight gradient is a product and sum per tap up to 25 taps; larger
    kernels and channel multipliers keep the grouped Conv whose kernel is the output
    gradient."""
    case = next(c for c in CASES if c.id == cid)
    lowered = grad_model(case, np.float32, weights_for(case))
    convs = [n for n in lowered.graph.node if n.op_type == "Conv" and "/grad/" in n.name]
    assert bool(convs) == grouped
    assert any(a.name == "group" and a.i > 1 for n in convs for a in n.attribute) == grouped


@pytest.mark.parametrize("static, symbolic", [
    ("Conv-8ch-stride-dilation-pads", "Conv-symbolic-spatial-stride-pads"),
    ("AveragePool-pads-cip0-ceil0", "AveragePool-symbolic-spatial-cip0")])
def test_sizes_are_constants_when_static_and_read_at_run_time_otherwise(static: str,
                                                                       symbolic: str) -> None:
    """Static spatial sizes are baked into the backward nodes (output_padding and crops as
    attributes, the Conv weight gradient taken tap by tap where it qualifies); symbolic ones
    are read at run time: the transposed windows are fitted to Shape(x) by a Pad and a
    Slice."""
    def ops(cid: str) -> list[str]:
        case = next(c for c in CASES if c.id == cid)
        lowered = grad_model(case, np.float32, weights_for(case))
        return [n.op_type for n in lowered.graph.node if n.name.startswith("node0/grad/")]

    fixed, dynamic = ops(static), ops(symbolic)
    # the run-time fit pads by Max(Shape(x) - Shape(window output), 0), then slices
    assert "Max" not in fixed
    assert {"Shape", "Max", "Pad", "Slice"} <= set(dynamic)
    if static.startswith("Conv-8ch"):
        assert "MatMul" in fixed and "MatMul" not in dynamic


def _one_node_gradient(node: onnx.NodeProto, x_dims: list, extra_inits=()) -> None:
    AutodiffPass()(loss_model([node], x_dims, initializers=extra_inits))


@pytest.mark.parametrize("node, dims, message", [
    (helper.make_node("MaxPool", ["x"], ["y"], name="pool1", kernel_shape=[2],
                      auto_pad="SAME_UPPER"),
     [2, 3, "n"], None),
    (helper.make_node("Conv", ["x", "w"], ["y"], name="conv0", auto_pad="SAME_UPPER"),
     [2, 3, "n"], "gradient rule of Conv failed on node 'conv0': Conv with auto_pad=SAME_UPPER "
     "needs static spatial sizes to differentiate (its pads depend on them), got input shape "
     "[2, 3, n]; export the model with explicit pads"),
    (helper.make_node("Transpose", ["x"], ["y"], name="t0"), None,
     "gradient rule of Transpose failed on node 't0': Transpose (without perm) input 'x' has "
     "unknown rank, which this gradient needs; give the model's inputs shapes of known rank, "
     "and compute reshape targets from constants and Shape(x)[0] (a target built at run time "
     "from several sizes can hide the rank from shape inference)"),
])
def test_symbolic_sizes_that_cannot_be_read_at_run_time_are_named(node, dims, message) -> None:
    """What needs a static size (the pads of auto_pad=SAME) or a known rank says so, and what
    to do; MaxPool reads everything at run time."""
    w = numpy_helper.from_array(np.ones([4, 3, 3], np.float32), "w")
    if message is None:
        _one_node_gradient(node, dims, [w])
        return
    with pytest.raises(GradientError) as info:
        _one_node_gradient(node, dims, [w])
    assert str(info.value) == message
