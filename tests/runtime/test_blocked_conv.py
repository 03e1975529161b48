"""Convolutions on onnxruntime's blocked-channel kernels (runtime/blocked_conv.py, on unless
``NGDIST_CPU_BLOCKED_CONV=0``): what is rewritten (depthwise Convs; dense Convs and stride-1
ConvTransposes whose output outweighs their weight), and that the result equals onnxruntime's
own Conv or ConvTranspose to float32 rounding, alone and in a training step."""
from __future__ import annotations

import platform

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import ngdist
from ngdist.data import load_digits
from ngdist.errors import NgdistError
from ngdist.runtime import blocked_conv
from ngdist.runtime.rewrites import session_rewrites
from ngdist.runtime.sessions import make_session, nchwc_block_size

BLOCK = nchwc_block_size()  # raises where the probe is broken: never a silent 0
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# onnxruntime's x86-64 builds have NCHWc kernels: there, none found is a failure, not a skip
pytestmark = pytest.mark.skipif(BLOCK == 0 and not X86_64,
                                reason=f"no NCHWc kernels on this {platform.machine()} CPU")


def test_onnxruntime_has_nchwc_kernels_on_x86_64():
    if X86_64:
        assert BLOCK in (8, 16), BLOCK
    else:
        assert BLOCK >= 0


def _probe_raising(monkeypatch, exc: Exception) -> None:
    from ngdist.runtime import sessions

    def refuse(*args, **kwargs):
        raise exc

    monkeypatch.setattr(sessions.ort, "InferenceSession", refuse)


def test_a_build_without_the_kernels_has_block_size_0(monkeypatch):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, NotImplemented

    for exc in (Fail("[ONNXRuntimeError] : 1 : FAIL : Fatal error: com.microsoft.nchwc:"
                     "ReorderInput(-1) is not a registered function/op"),
                NotImplemented("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an "
                               "implementation for ReorderInput(1) node with name ''")):
        _probe_raising(monkeypatch, exc)
        assert nchwc_block_size.__wrapped__() == 0


def test_a_broken_probe_is_raised_not_taken_for_a_cpu_without_kernels(monkeypatch):
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    for exc in (Fail("[ONNXRuntimeError] : 1 : FAIL : Load model failed: Unsupported model IR "
                     "version: 99"), MemoryError("out of memory"), ImportError("broken")):
        _probe_raising(monkeypatch, exc)
        with pytest.raises(type(exc)):
            nchwc_block_size.__wrapped__()
    monkeypatch.undo()
    monkeypatch.setattr(blocked_conv, "probe_model", lambda: onnx.ModelProto())  # no graph
    with pytest.raises(Exception, match="(?i)model|graph"):
        nchwc_block_size.__wrapped__()


def conv_model(channels: int, w_shape: list[int], group: int, constant_weight: bool = False,
               op: str = "Conv", batch: int = 2, size: int = 7, bias: bool = False,
               **attrs) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(w_shape).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, size, size])]
    inits = []
    if constant_weight:
        inits.append(numpy_helper.from_array(w, "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape))
    if bias:
        out_channels = w_shape[1] * group if op == "ConvTranspose" else w_shape[0]
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [out_channels]))
    node = helper.make_node(op, ["x", "w", *(["b"] if bias else [])], ["y"], name="conv",
                            group=group, **attrs)
    graph = helper.make_graph([node], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def block_convs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` through the session rewrites at this CPU's block size."""
    return session_rewrites(model, lambda: BLOCK)


def rewritten_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in block_convs(model).graph.node]


def random_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim])
            .astype(np.float32) for v in model.graph.input}


def assert_equals_onnxruntimes_own(model: onnx.ModelProto, atol: float | None = None) -> None:
    """Blocked against plain within ``atol`` (default: 2e-5 of the largest output, for the
    dense sums over hundreds of products)."""
    feeds = random_feeds(model)
    plain = make_session(model, optimize=False).run(None, feeds)[0]
    blocked = make_session(model).run(None, feeds)[0]
    assert blocked.shape == plain.shape
    bound = 2e-5 * np.abs(plain).max() if atol is None else atol
    np.testing.assert_allclose(blocked, plain, rtol=0, atol=bound)


@pytest.mark.parametrize("kernel,attrs", [
    (3, dict(pads=[1, 1, 1, 1])), (3, dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    (5, dict(pads=[2, 1, 0, 2])), (7, dict(pads=[3, 3, 3, 3])),
    (3, dict(pads=[2, 2, 2, 2], dilations=[2, 2]))])
def test_a_depthwise_conv_equals_onnxruntimes_own(monkeypatch, kernel, attrs):
    monkeypatch.setenv(blocked_conv.ENV, "1")
    c = 2 * BLOCK
    model = conv_model(c, [c, 1, kernel, kernel], group=c, **attrs)
    assert rewritten_ops(model) == ["Reshape", "Transpose", "Reshape", "ReorderInput", "Conv",
                                    "ReorderOutput"]
    assert_equals_onnxruntimes_own(model, atol=1e-5)


DENSE_REWRITE = ["Reshape", "Transpose", "Reshape", "ReorderInput", "Conv", "ReorderOutput"]


@pytest.mark.parametrize("kernel,attrs", [
    (3, dict(pads=[1, 1, 1, 1])), (3, dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    (5, dict(pads=[2, 1, 0, 2])), (1, dict()),
    (3, dict(pads=[2, 2, 2, 2], dilations=[2, 2])), (3, dict(auto_pad="SAME_UPPER")),
    (3, dict(auto_pad="SAME_LOWER", strides=[2, 2])), (3, dict(auto_pad="VALID"))])
@pytest.mark.parametrize("bias", [False, True])
def test_a_dense_conv_equals_onnxruntimes_own(monkeypatch, kernel, attrs, bias):
    monkeypatch.setenv(blocked_conv.ENV, "1")
    c = BLOCK
    # 64 images of 12 x 12: the output outweighs the weight, strided or not
    model = conv_model(c, [2 * c, c, kernel, kernel], group=1, batch=64, size=12, bias=bias,
                       **attrs)
    assert rewritten_ops(model) == DENSE_REWRITE
    assert_equals_onnxruntimes_own(model)


@pytest.mark.parametrize("kernel,attrs", [
    (3, dict(pads=[1, 1, 1, 1])), (3, dict()), (3, dict(pads=[2, 1, 0, 2])),
    (5, dict(pads=[2, 2, 2, 2], strides=[1, 1], output_padding=[0, 0])),
    (3, dict(pads=[1, 3, 4, 0], dilations=[2, 2]))])
@pytest.mark.parametrize("bias", [False, True])
def test_a_stride_1_conv_transpose_equals_onnxruntimes_own(monkeypatch, kernel, attrs, bias):
    """ConvTranspose(x, W) as the Conv of x with W flipped and its channels swapped."""
    monkeypatch.setenv(blocked_conv.ENV, "1")
    c = BLOCK
    model = conv_model(2 * c, [2 * c, c, kernel, kernel], group=1, op="ConvTranspose", batch=64,
                       size=12, bias=bias, **attrs)
    assert rewritten_ops(model) == ["Reshape", "Transpose", "Gather", *DENSE_REWRITE[2:]]
    assert_equals_onnxruntimes_own(model)


@pytest.mark.parametrize("case", ["dense-large-weight", "multiplier-2", "unaligned-channels",
                                  "constant-weight", "switched-off", "dense-unaligned",
                                  "transposed-stride-2", "transposed-group-2",
                                  "transposed-output-shape", "transposed-large-weight"])
def test_other_convolutions_stay_as_they_are(monkeypatch, case):
    monkeypatch.setenv(blocked_conv.ENV, "0" if case == "switched-off" else "1")
    c = 2 * BLOCK
    model = {
        # 2 x 7 x 7 outputs of c channels against c * c * 9 weights
        "dense-large-weight": lambda: conv_model(c, [c, c, 3, 3], group=1),
        "dense-unaligned": lambda: conv_model(c + 4, [c, c + 4, 3, 3], group=1, batch=64),
        "transposed-stride-2": lambda: conv_model(c, [c, c, 3, 3], group=1, batch=64,
                                                  op="ConvTranspose", strides=[2, 2]),
        "transposed-group-2": lambda: conv_model(2 * c, [2 * c, c, 3, 3], group=2, batch=64,
                                                 op="ConvTranspose"),
        "transposed-output-shape": lambda: conv_model(c, [c, c, 3, 3], group=1, batch=64,
                                                      op="ConvTranspose", output_shape=[9, 9]),
        "transposed-large-weight": lambda: conv_model(c, [c, c, 3, 3], group=1,
                                                      op="ConvTranspose"),
             "multiplier-2": lambda: conv_model(c, [2 * c, 1, 3, 3], group=c),
             "unaligned-channels": lambda: conv_model(c + 4, [c + 4, 1, 3, 3], group=c + 4),
             "constant-weight": lambda: conv_model(c, [c, 1, 3, 3], group=c,
                                                   constant_weight=True),
             "switched-off": lambda: conv_model(c, [c, 1, 3, 3], group=c)}[case]()
    assert block_convs(model) is model


def _train(monkeypatch, blocked: bool) -> dict[str, np.ndarray]:
    monkeypatch.setenv(blocked_conv.ENV, "1" if blocked else "0")
    kinds: list[str] = []
    call = blocked_conv.BlockConvs.call

    def counting(self, model):  # which convolutions each segment moves
        out = call(self, model)
        kinds.extend(n.op_type for n in out.model.graph if n.domain == blocked_conv.DOMAIN)
        return out

    monkeypatch.setattr(blocked_conv.BlockConvs, "call", counting)
    torch.manual_seed(0)
    c = 2 * BLOCK
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, c, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 3, padding=1, groups=c), torch.nn.ReLU(),
        torch.nn.Conv2d(c, c, 5, stride=2, padding=2, groups=c), torch.nn.Flatten(),
        torch.nn.Linear(c * 16, 10))
    x, y, _, _ = load_digits()
    x = x.reshape(-1, 1, 8, 8).astype(np.float32)
    tr = ngdist.compile(net, torch.from_numpy(x[:2]), loss=torch.nn.CrossEntropyLoss(),
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                        strategy="local", intra_op_threads=1)
    for start in range(0, 96, 32):
        tr.step({"input": x[start:start + 32], "y": y[start:start + 32].astype(np.int64)})
    tr.to_torch()
    # the dense Conv, its data gradient and the two depthwise Convs (the first Conv has one
    # input channel and keeps the generic kernel), each between two reorders
    assert kinds == (["ReorderInput", "Conv", "ReorderOutput"] * 4 if blocked else [])
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def test_training_steps_with_blocked_convs_equal_the_plain_ones(monkeypatch):
    plain, blocked = _train(monkeypatch, False), _train(monkeypatch, True)
    # the blocked kernels ran: they round differently from the plain ones
    assert any(not np.array_equal(blocked[k], plain[k]) for k in plain)
    for k in plain:
        np.testing.assert_allclose(blocked[k], plain[k], rtol=0, atol=1e-5, err_msg=k)


def test_a_switch_value_other_than_0_or_1_is_refused(monkeypatch):
    monkeypatch.setenv(blocked_conv.ENV, "yes")
    with pytest.raises(NgdistError, match=r"NGDIST_CPU_BLOCKED_CONV='yes': set it to 0 to keep "
                                          r"convolutions on onnxruntime's generic kernels"):
        make_session(conv_model(BLOCK, [BLOCK, 1, 3, 3], group=BLOCK))


def test_the_rewrite_is_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv(blocked_conv.ENV, raising=False)
    assert blocked_conv.requested()
    monkeypatch.setenv(blocked_conv.ENV, "0")
    assert not blocked_conv.requested()


def _conv_relu_model(extra_reader: bool) -> onnx.ModelProto:
    """x -> dense Conv -> Relu -> y, the Conv's result also returned when ``extra_reader``."""
    c = BLOCK
    model = conv_model(c, [2 * c, c, 3, 3], group=1, batch=64, size=12, pads=[1, 1, 1, 1])
    g = model.graph
    g.node[0].output[0] = "z"
    g.node.append(helper.make_node("Relu", ["z"], ["y"], name="relu"))
    if extra_reader:
        g.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    return model


def test_a_relu_that_alone_reads_a_blocked_conv_runs_inside_it(monkeypatch):
    monkeypatch.setenv(blocked_conv.ENV, "1")
    model = _conv_relu_model(extra_reader=False)
    out = block_convs(model)
    assert [n.op_type for n in out.graph.node] == DENSE_REWRITE
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert helper.get_attribute_value(
        next(a for a in conv.attribute if a.name == "activation")) == b"Relu"
    assert out.graph.node[-1].output == ["y"]
    assert_equals_onnxruntimes_own(model)


def test_a_conv_result_read_elsewhere_keeps_its_relu(monkeypatch):
    monkeypatch.setenv(blocked_conv.ENV, "1")
    model = _conv_relu_model(extra_reader=True)
    out = block_convs(model)
    assert [n.op_type for n in out.graph.node] == [*DENSE_REWRITE, "Relu"]
    feeds = random_feeds(model)
    plain = make_session(model, optimize=False).run(None, feeds)
    blocked = make_session(model).run(None, feeds)
    for a, b in zip(blocked, plain):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())


def test_a_session_given_bytes_is_blocked_as_one_given_the_proto(monkeypatch):
    monkeypatch.setenv(blocked_conv.ENV, "1")
    model = conv_model(BLOCK, [BLOCK, 1, 3, 3], group=BLOCK)
    made = []
    run = blocked_conv.BlockConvs.call
    monkeypatch.setattr(blocked_conv.BlockConvs, "call",
                        lambda self, m: made.append(run(self, m)) or made[-1])
    feeds = {i.name: np.random.default_rng(0).standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input}
    outs = [make_session(m).run(None, feeds) for m in (model, model.SerializeToString())]
    assert len(made) == 2 and all(r.modified for r in made)
    protos = [ir.to_proto(r.model) for r in made]
    assert protos[0].SerializeToString() == protos[1].SerializeToString()
    assert [n.op_type for n in protos[1].graph.node].count("ReorderInput") == 1
    assert all(np.array_equal(a, b) for a, b in zip(*outs))


def test_a_graph_without_a_convolution_to_block_is_not_converted_to_onnx_ir(monkeypatch):
    """A 1-D Conv (as Mamba's and other causal convolutions export) or one whose channels
    fit no block: the session rewrites see it in the proto and leave the model as it is,
    without the onnx_ir round trip (seconds on a graph of thousands of nodes)."""
    monkeypatch.setenv(blocked_conv.ENV, "1")
    c = 2 * BLOCK
    one_d = conv_model(c, [c, 1, 3], group=c)
    one_d.graph.input[0].type.tensor_type.shape.dim.pop()
    unaligned = conv_model(c + 4, [c + 4, 1, 3, 3], group=c + 4)

    def refuse(*args, **kwargs):
        raise AssertionError("converted to onnx_ir")

    monkeypatch.setattr(ir, "from_proto", refuse)
    for model in (one_d, unaligned):
        assert not blocked_conv.applies(model, BLOCK)
        assert block_convs(model) is model
    assert blocked_conv.applies(conv_model(c, [c, 1, 3, 3], group=c), BLOCK)
