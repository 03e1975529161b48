"""Small forward models built directly as ONNX (no framework needed)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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
