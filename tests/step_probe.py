"""Test helper: one training step run in plain onnxruntime, exposing gradients and activations.

The training model goes through ngdist's autodiff pass exactly as in ngdist.compile (the
"local" strategy: no communication); the optimizer node is dropped and the graph's outputs
become the loss, every parameter's gradient (``<param>.grad``, the names the autodiff pass
gives them), the new values of buffers (BatchNorm statistics) and any requested intermediate
value (e.g. a Dropout mask). The step is run once in onnxruntime.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.model import get_meta, split_training_model
from ngdist.passes.pipeline import run_passes


def run_step(model: onnx.ModelProto, batch: Mapping[str, np.ndarray],
             extra: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """{'loss': loss, '<p>.grad': gradient, '<buffer>.new': new value, extra name: value}."""
    _, step = split_training_model(model)
    meta = get_meta(step)
    step = run_passes(step, "local", lower=False)
    proto = ir.to_proto(step)
    g = proto.graph
    kept = [n for n in g.node if n.domain != PREVIEW_TRAINING]
    del g.node[:]
    g.node.extend(kept)
    produced = {o for n in g.node for o in n.output}
    grads = [f"{p}.grad" for p in meta.names("param")]
    buffers = [meta.binding[b] for b in meta.names("buffer") if meta.binding.get(b) in produced]
    del g.output[:]
    for name in dict.fromkeys([meta.loss, *grads, *buffers, *extra]):
        g.output.append(onnx.helper.make_empty_tensor_value_info(name))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    data = [i.name for i in sess.get_inputs() if meta.roles.get(i.name) == "data"]
    names = [o.name for o in sess.get_outputs()]
    out = sess.run(names, {n: np.asarray(batch[n]) for n in data})
    result = dict(zip(names, out))
    for key, value in meta.binding.items():  # new buffer values also under "<name>.new"
        if value in result:
            result.setdefault(f"{key}.new", result[value])
    result["loss"] = result[meta.loss]
    return result


def max_rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(|b|_max, tiny): relative to the reference's scale."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
