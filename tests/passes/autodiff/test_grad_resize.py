"""Resize (what F.interpolate exports) against central differences (the harness of
``grad_harness``): nearest, linear and cubic, every coordinate transformation, antialias, roi,
scales and sizes, 1-D to 3-D, sizes and extents known only at run time; the forms without a
gradient are refused by name."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from grad_harness import (Gen, Runner, _model, check_case, grad_model, graph_case,
                          loss_model, lowering_error, weights_for)
from ngdist.passes.autodiff import AutodiffPass


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"const_{name}",
                            value=numpy_helper.from_array(np.asarray(value), name))


def resize_case(cid: str, shape, *, scales=None, sizes=None, roi=None, opset: int = 19,
                symbolic: bool | str = False, x: str = "x", **attrs):
    nodes, ins = [], [x, "", "", ""]
    for k, (name, value, dtype) in enumerate([("roi", roi, np.float32),
                                              ("scales", scales, np.float32),
                                              ("sizes", sizes, np.int64)], start=1):
        if value is not None:
            nodes.append(_const(name, np.asarray(value, dtype)))
            ins[k] = name
    while ins[-1] == "":
        ins.pop()
    nodes.append(helper.make_node("Resize", ins, ["y"], name="node0", **attrs))
    built = graph_case(cid, nodes, {x: Gen(cid).n(*shape)}, opset=opset)
    built.symbolic = symbolic
    return built


CASES = [
    resize_case("Resize-linear-half-pixel-x2", (1, 2, 3, 4), scales=[1, 1, 2, 2],
                mode="linear"),
    resize_case("Resize-bilinear-align-corners-sizes", (2, 1, 3, 4), sizes=[2, 1, 5, 7],
                mode="linear", coordinate_transformation_mode="align_corners"),
    resize_case("Resize-linear-pytorch-half-pixel-down", (1, 2, 5, 6), scales=[1, 1, 0.75, 0.5],
                mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    resize_case("Resize-linear-antialias-down", (1, 1, 6, 8), scales=[1, 1, 0.5, 0.5],
                mode="linear", antialias=1),
    resize_case("Resize-nearest-asymmetric-floor", (1, 2, 3, 3), scales=[1, 1, 2, 2],
                mode="nearest", coordinate_transformation_mode="asymmetric",
                nearest_mode="floor"),
    resize_case("Resize-nearest-round-prefer-floor-1.5", (1, 1, 4, 4), scales=[1, 1, 1.5, 1.5],
                mode="nearest"),
    resize_case("Resize-nearest-down-sizes", (1, 1, 6, 5), sizes=[1, 1, 3, 2], mode="nearest",
                nearest_mode="ceil"),
    resize_case("Resize-cubic-torch-bicubic", (1, 1, 4, 4), scales=[1, 1, 2, 2], mode="cubic",
                cubic_coeff_a=-0.75, coordinate_transformation_mode="pytorch_half_pixel"),
    resize_case("Resize-cubic-exclude-outside-align", (1, 2, 3, 5), sizes=[1, 2, 6, 4],
                mode="cubic", exclude_outside=1, coordinate_transformation_mode="align_corners"),
    resize_case("Resize-cubic-antialias-down", (1, 1, 8, 6), scales=[1, 1, 0.5, 0.75],
                mode="cubic", antialias=1),
    resize_case("Resize-tf-crop-and-resize", (1, 1, 4, 5),
                roi=[0, 0, 0.2, 0.1, 1, 1, 0.9, 1.2], sizes=[1, 1, 3, 4], mode="linear",
                coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.0),
    resize_case("Resize-axes-middle-1d", (2, 3, 4), sizes=[5], axes=[1], mode="linear"),
    resize_case("Resize-trilinear", (1, 2, 3, 2, 3), scales=[1, 1, 2, 1.5, 2], mode="linear",
                coordinate_transformation_mode="align_corners"),
    resize_case("Resize-1d-linear", (2, 2, 5), scales=[1, 1, 1.6], mode="linear"),
    resize_case("Resize-symbolic-batch", (2, 2, 3, 3), scales=[1, 1, 2, 1.5], mode="cubic",
                symbolic="batch"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


def test_nearest_upsampling_gradient_sums_each_block() -> None:
    """Nearest x2: each input element gets the sum of the output gradient over its 2x2 block
    (the oracle independent of ONNX's reference Resize, which builds the rule's matrices)."""
    case = CASES[4]
    w = weights_for(case)
    got = Runner(grad_model(case, np.float64, w))({"x": case.inputs["x"]})[1]
    expected = w["w0"].reshape(1, 2, 3, 2, 3, 2).sum(axis=(3, 5))
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def runtime_nodes(x: str, extent: str, **attrs) -> list[onnx.NodeProto]:
    """A Resize of ``x`` whose output sizes are computed at run time from its own shape: N and
    C kept, the spatial extents changed by ``extent`` ("Add 2,3" adds 2 and 3 to H and W), as
    F.interpolate(size=t.shape[2:]) exports under a symbolic shape."""
    op, amounts = extent.split()
    return [_const("amounts", np.asarray([int(a) for a in amounts.split(",")], np.int64)),
            helper.make_node("Shape", [x], ["nc"], name="shape_nc", end=2),
            helper.make_node("Shape", [x], ["hw"], name="shape_hw", start=2),
            helper.make_node(op, ["hw", "amounts"], ["hw2"], name="extent"),
            helper.make_node("Concat", ["nc", "hw2"], ["sizes"], name="sizes", axis=0),
            helper.make_node("Resize", [x, "", "", "sizes"], ["y"], name="node0", **attrs)]


def runtime_case(cid: str, shape, extent: str, *, symbolic: str = "spatial", **attrs):
    built = graph_case(cid, runtime_nodes("in0", extent, **attrs), {"in0": Gen(cid).n(*shape)},
                       opset=19)
    built.symbolic = symbolic
    return built


RUNTIME_CASES = [
    # timm's csatv2: F.interpolate(attn, size=x.shape[2:], mode="bilinear", align_corners=True)
    runtime_case("Resize-runtime-sizes-bilinear-align-corners", (2, 1, 3, 4), "Add 2,3",
                 mode="linear", coordinate_transformation_mode="align_corners"),
    runtime_case("Resize-runtime-sizes-cubic-antialias-down", (1, 2, 6, 8), "Sub 3,2",
                 mode="cubic", antialias=1),
    runtime_case("Resize-runtime-sizes-nearest-batch-symbolic", (2, 2, 3, 3), "Mul 2,1",
                 symbolic="batch", mode="nearest"),
    resize_case("Resize-runtime-extent-constant-scales", (1, 2, 3, 4), scales=[1, 1, 2, 1.5],
                mode="linear", symbolic="spatial", x="in0"),
]


@pytest.mark.parametrize("case", RUNTIME_CASES, ids=[c.id for c in RUNTIME_CASES])
def test_run_time_sizes_match_central_differences(case) -> None:
    """Output sizes (or input extents) known only at run time: each axis's matrix is the
    runtime's Resize of an identity, the gradient that of the op trained (float64 against
    central differences, float32 on onnxruntime against float64)."""
    check_case(case)


def test_crop_with_a_run_time_roi_is_refused_naming_op_node_and_mode() -> None:
    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape0"),
             helper.make_node("Cast", ["shape"], ["roi"], name="roi0", to=onnx.TensorProto.FLOAT),
             helper.make_node("Resize", ["x", "roi", "", "shape"], ["y"], name="up0",
                              mode="linear", coordinate_transformation_mode="tf_crop_and_resize")]
    assert lowering_error(nodes, ["n", 1, "h", 4], opset=19) == (
        "gradient rule of Resize failed on node 'up0': Resize (mode 'linear') with "
        "tf_crop_and_resize needs a constant roi to differentiate")


@pytest.mark.parametrize("y_dims, resized", [
    (None, 4),  # shape inference gave up: every axis gets a matrix (identity where kept)
    (["n", 2, "h2", "w2"], 2),  # N the input's symbol, C the same constant: not resized
        (["m", 2, "h2", "w2"], 3),  # another symbol: N may change
])
def test_run_time_sizes_skip_the_axes_shape_inference_proves_unchanged(y_dims, resized) -> None:
    model = loss_model(runtime_nodes("x", "Mul 2,1", mode="linear"), ["n", 2, 3, 3], opset=19)
    y = next(n for n in model.graph if n.name == "node0").outputs[0]
    y.shape = None if y_dims is None else ir.Shape(y_dims)
    AutodiffPass()(model)
    assert sum(n.op_type == "Resize" and "/grad/" in n.name for n in model.graph) == resized


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reference_resize_is_onnxruntimes(case) -> None:
    """The rule's matrices come from ONNX's reference Resize; training runs onnxruntime's:
    both give the same forward values (float32), so the gradient is that of the op trained."""
    x = case.inputs["x"]
    ref = Runner(_model(case, np.float64, ["y"]), reference=True)({"x": x})[0]
    ort32 = Runner(_model(case, np.float32, ["y"]), ort_only=True)({"x": x.astype(np.float32)})[0]
    np.testing.assert_allclose(ort32, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cid, block", [("Resize-nearest-asymmetric-floor", True),
                                        ("Resize-nearest-round-prefer-floor-1.5", False),
                                        ("Resize-linear-half-pixel-x2", False)])
def test_nearest_integer_upsampling_sums_blocks_without_a_product(cid: str, block: bool) -> None:
    """Nearest upsampling by a whole factor repeats each input: its gradient sums blocks
    (Reshape, ReduceSum), cheaper than the per-axis product other modes take."""
    case = next(c for c in CASES if c.id == cid)
    lowered = grad_model(case, np.float32, weights_for(case))
    ops = [n.op_type for n in lowered.graph.node if n.name.startswith("node0/grad/")]
    assert ("MatMul" not in ops) == block
    assert ("ReduceSum" in ops) == block


def test_interpolate_to_a_run_time_size_trains_as_torch_does() -> None:
    """F.interpolate(size=a.shape[2:]) of a torch module (the size a Shape of the batch-
    dynamic export, as in timm's csatv2) through ngdist.compile's segments and one SGD step:
    the parameters equal torch's own step in float64 (1e-6)."""
    torch = pytest.importorskip("torch")  # an extra of the suite's install: never skipped there
    import torch.nn.functional as F
    from torch import nn

    import ngdist

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c, self.d = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, 2, padding=1)
            self.h = nn.Linear(4, 3)

        def forward(self, x):
            a = self.c(x)
            up = F.interpolate(self.d(a), size=a.shape[2:], mode="bilinear", align_corners=True)
            return self.h((a + up).mean((2, 3)))

    torch.manual_seed(0)
    net, x, y = Net(), torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    ref = Net().double()
    ref.load_state_dict(net.state_dict())
    trainer = ngdist.compile(net, (x,), loss=nn.CrossEntropyLoss(), strategy="local",
                             optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    trainer.step({"x": x.numpy(), "y": y.numpy()})
    nn.CrossEntropyLoss()(ref(x.double()), y).backward()
    with torch.no_grad():
        want = {k: (p - 0.1 * p.grad).numpy() for k, p in ref.named_parameters()}
    got = trainer.parameters()
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-6, err_msg=k)
