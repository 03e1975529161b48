"""Small forward models built directly as ONNX (no framework needed)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ngdist.ir.model import IR_VERSION


def mlp(sizes: tuple[int, ...] = (64, 128, 10), seed: int = 0, activation: str = "Relu",
        dtype: type = np.float32) -> onnx.ModelProto:
    """Forward-only MLP: Gemm layers with ``activation`` between them, input ``x``, output
    ``logits``. Weights use PyTorch's nn.Linear initialisation (uniform +-1/sqrt(fan_in)).
    Parameter names: ``fc{i}.weight`` ([out, in], Gemm transB=1) and ``fc{i}.bias``.
    """
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits = [], []
    prev = "x"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1.0 / np.sqrt(fan_in)
        w = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(dtype)
        b = rng.uniform(-bound, bound, (fan_out,)).astype(dtype)
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"),
                  numpy_helper.from_array(b, f"fc{i}.bias")]
        out = "logits" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"fc{i}.weight", f"fc{i}.bias"],
                                      [out if i == len(sizes) - 2 else f"z{i}"],
                                      name=f"fc{i}", transB=1))
        if i < len(sizes) - 2:
            nodes.append(helper.make_node(activation, [f"z{i}"], [out], name=f"act{i}"))
        prev = out
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", elem, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("logits", elem, ["batch", sizes[-1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=IR_VERSION, producer_name="ngdist.zoo")


def _torch_uniform(rng: np.random.Generator, dtype: type):
    """``uniform(name, shape, fan_in)``: an initializer drawn as PyTorch's default layers do,
    uniform in +-1/sqrt(fan_in)."""
    def uniform(name: str, shape: tuple[int, ...], fan_in: int) -> onnx.TensorProto:
        bound = 1.0 / np.sqrt(fan_in)
        return numpy_helper.from_array(rng.uniform(-bound, bound, shape).astype(dtype), name)

    return uniform


def cnn(channels: tuple[int, int] = (32, 32), classes: int = 10, image: int = 8, seed: int = 0,
        dtype: type = np.float32) -> onnx.ModelProto:
    """Forward-only LeNet-style CNN for ``N x 1 x image x image`` inputs ``x`` -> ``logits``:
    Conv3x3 - BatchNormalization (training mode) - Relu - MaxPool2x2 - Conv3x3 - Relu -
    Flatten - Gemm. Weights use PyTorch's default initialisation (uniform +-1/sqrt(fan_in));
    BatchNorm starts at scale 1, bias 0, running mean 0, running variance 1, momentum 0.9
    (ONNX's convention: running = 0.9 running + 0.1 batch). Names follow PyTorch:
    ``conv1.weight``, ``bn1.running_mean``, ``fc.bias``...
    """
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    c1, c2 = channels
    flat = c2 * (image // 2) ** 2

    uniform = _torch_uniform(rng, dtype)

    inits = [uniform("conv1.weight", (c1, 1, 3, 3), 9), uniform("conv1.bias", (c1,), 9),
             numpy_helper.from_array(np.ones(c1, dtype), "bn1.weight"),
             numpy_helper.from_array(np.zeros(c1, dtype), "bn1.bias"),
             numpy_helper.from_array(np.zeros(c1, dtype), "bn1.running_mean"),
             numpy_helper.from_array(np.ones(c1, dtype), "bn1.running_var"),
             uniform("conv2.weight", (c2, c1, 3, 3), 9 * c1), uniform("conv2.bias", (c2,), 9 * c1),
             uniform("fc.weight", (classes, flat), flat), uniform("fc.bias", (classes,), flat),
             numpy_helper.from_array(np.array([-1, flat], np.int64), "flat_shape")]
    nodes = [
        helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["c1"], name="conv1",
                         pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn1.weight", "bn1.bias",
                                                "bn1.running_mean", "bn1.running_var"],
                         ["b1", "bn1.running_mean.out", "bn1.running_var.out"], name="bn1",
                         training_mode=1, momentum=0.9, epsilon=1e-5),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], name="conv2",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Reshape", ["r2", "flat_shape"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", elem, ["batch", 1, image, image])],
        [helper.make_tensor_value_info("logits", elem, ["batch", classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=IR_VERSION, producer_name="ngdist.zoo")


def digits_cnn(channels: tuple[int, int] = (32, 64), hidden: int = 128, classes: int = 10,
               image: int = 8, seed: int = 0, dtype: type = np.float32) -> onnx.ModelProto:
    """Forward-only CNN for ``N x 1 x image x image`` inputs ``x`` -> ``logits``, without
    normalisation: Conv3x3(32) - Relu - Conv3x3(64) - Relu - MaxPool2x2 - Flatten -
    Gemm(128) - Relu - Gemm(classes) (convolutions padded to keep the image size). The same
    layers as ``nn.Sequential(Conv2d(1, 32, 3, padding=1), ReLU(), Conv2d(32, 64, 3,
    padding=1), ReLU(), MaxPool2d(2), Flatten(), Linear(64 * 16, 128), ReLU(), Linear(128,
    10))``, with PyTorch's default initialisation (uniform +-1/sqrt(fan_in)). Parameter names:
    ``conv1.weight``, ``conv2.bias``, ``fc1.weight``, ``fc2.bias``...
    """
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    c1, c2 = channels
    flat = c2 * (image // 2) ** 2

    uniform = _torch_uniform(rng, dtype)

    inits = [uniform("conv1.weight", (c1, 1, 3, 3), 9), uniform("conv1.bias", (c1,), 9),
             uniform("conv2.weight", (c2, c1, 3, 3), 9 * c1), uniform("conv2.bias", (c2,), 9 * c1),
             uniform("fc1.weight", (hidden, flat), flat), uniform("fc1.bias", (hidden,), flat),
             uniform("fc2.weight", (classes, hidden), hidden),
             uniform("fc2.bias", (classes,), hidden),
             numpy_helper.from_array(np.array([-1, flat], np.int64), "flat_shape")]
    nodes = [
        helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["c1"], name="conv1",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "conv2.weight", "conv2.bias"], ["c2"], name="conv2",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Reshape", ["p2", "flat_shape"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc1.weight", "fc1.bias"], ["z1"], name="fc1", transB=1),
        helper.make_node("Relu", ["z1"], ["h1"], name="relu3"),
        helper.make_node("Gemm", ["h1", "fc2.weight", "fc2.bias"], ["logits"], name="fc2",
                         transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info("x", elem, ["batch", 1, image, image])],
        [helper.make_tensor_value_info("logits", elem, ["batch", classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=IR_VERSION, producer_name="ngdist.zoo")


def chain(n: int, features: int = 64, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """Forward-only model of one Gemm (``w`` [classes, features], ``b``) followed by a chain of
    ``n`` activations (Relu and Tanh alternating, names ``act{i}``), all on the loss path: a
    model whose size is its node count, for measuring how the compiler scales."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h0"], name="fc", transB=1)]
    for i in range(n):
        nodes.append(helper.make_node("Tanh" if i % 2 else "Relu", [f"h{i}"], [f"h{i + 1}"],
                                      name=f"act{i}"))
    inits = [numpy_helper.from_array(
                 rng.uniform(-0.1, 0.1, (classes, features)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(classes, np.float32), "b")]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                       ["batch", features])],
        [helper.make_tensor_value_info(f"h{n}", onnx.TensorProto.FLOAT, ["batch", classes])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=IR_VERSION, producer_name="ngdist.zoo")
