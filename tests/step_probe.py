"""Test helper: one training step run in plain onnxruntime, exposing gradients and activations.

The training model goes through ngdist's autodiff pass exactly as in ngdist.compile (the
"local" strategy: no communication); the optimizer node is dropped and the graph's outputs
become the loss, every parameter's gradient (``<param>.grad``, the names the autodiff pass
gives them), the new values of buffers (BatchNorm statistics) and any requested intermediate
value (e.g. a Dropout mask). The step is run once in onnxruntime.
"""
from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.model import get_meta, split_training_model
from ngdist.passes.pipeline import run_passes
from ngdist.runtime.sessions import plans_reuse


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
    opts.enable_mem_reuse = plans_reuse(proto)  # (ngdist's sessions' rule: the same bits)
    serialized = proto.SerializeToString()
    del proto, g, kept, step  # (the weights in one place at a time: a large model fits)
    sess = ort.InferenceSession(serialized, opts, providers=["CPUExecutionProvider"])
    del serialized
    data = [i.name for i in sess.get_inputs() if meta.roles.get(i.name) == "data"]
    names = [o.name for o in sess.get_outputs()]
    out = sess.run(names, {n: np.asarray(batch[n]) for n in data})
    result = dict(zip(names, out))
    for key, value in meta.binding.items():  # new buffer values also under "<name>.new"
        if value in result:
            result.setdefault(f"{key}.new", result[value])
    result["loss"] = result[meta.loss]
    return result


CHUNK = 1 << 22  # entries a reduction takes at a time: the float64 temporaries of a whole
# large tensor (VGG's classifier weight: 102 M entries, 0.8 GB each) would cost more than
# the model


def max_rel_err(a: np.ndarray, b: np.ndarray, floor: float = 1e-12) -> float:
    """max |a - b| / max(max |b|, floor): the error relative to the reference tensor's scale.

    ``floor`` covers tensors whose exact value is zero (e.g. the gradient of a conv bias
    followed by BatchNorm, where the reference itself holds only rounding noise).
    """
    diff = top = 0.0
    for got, ref in chunks(*np.broadcast_arrays(np.asarray(a), np.asarray(b))):
        ref = ref.astype(np.float64)
        diff = np.maximum(diff, np.abs(got - ref).max())  # (NaN stays NaN)
        top = np.maximum(top, np.abs(ref).max())
    return float(diff / max(top, floor))


def chunks(*arrays: np.ndarray):
    """The arrays (of one shape), flattened, ``CHUNK`` entries at a time, side by side."""
    flat = [np.ravel(a) for a in arrays]
    for start in range(0, flat[0].size, CHUNK):
        yield [f[start:start + CHUNK] for f in flat]


def rank_results(proc, n: int) -> tuple[dict, list[dict]]:
    """The ``RESULT {json}`` lines the ranks of a script printed: (rank 0's, all of them)."""
    import json

    results = [json.loads(line.split("RESULT ", 1)[1])
               for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == n, proc.stdout + proc.stderr
    return next(r for r in results if "acc" in r), results


def gradient_errors(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray]
                    ) -> dict[str, float]:
    """Per parameter: max_rel_err of ``got['<p>.grad']`` against ``ref[p]``.

    A reference gradient that is zero in theory (below 1e-9 of the model's largest, e.g. a
    conv bias followed by BatchNorm; use a float64 reference) holds only float32 rounding
    noise on ngdist's side: it is measured against the model's largest gradient instead.
    """
    largest = max(float(np.abs(g).max()) for g in ref.values())
    errors = {}
    for p, g in ref.items():
        mine = got[f"{p}.grad"]
        if np.abs(g).max() > 1e-9 * largest:
            errors[p] = max_rel_err(mine, g)
        else:
            errors[p] = float(np.abs(mine).max() / largest)
    return errors


# --------------------------------------------------------------------------- PyTorch oracle

def dropout_mask_outputs(model: onnx.ModelProto, module) -> dict[str, str]:
    """Module path of each nn.Dropout -> the mask output of its ONNX Dropout node.

    The TorchScript exporter names a submodule's nodes ``/<path with '/'>/<Op>``.
    """
    import torch

    by_name = {n.name: n for n in model.training_info[0].algorithm.node
               if n.op_type == "Dropout"} if model.training_info else {}
    out = {}
    for path, sub in module.named_modules():
        if isinstance(sub, torch.nn.Dropout):
            node = by_name.get("/" + path.replace(".", "/") + "/Dropout")
            if node is None or len(node.output) < 2 or not node.output[1]:
                raise KeyError(f"no Dropout node with a mask output for module '{path}'")
            out[path] = node.output[1]
    return out


def torch_step(module, inputs, labels, loss_fn, masks: Mapping[str, np.ndarray] | None = None,
               float64: bool = False):
    """(loss, {param name: grad}, module copy) from torch autograd on a copy of ``module`` in
    train mode, each nn.Dropout replaced by the given fixed mask (scaled by 1 / (1 - p)).
    ``float64``: the copy and the float inputs in double precision (an exact reference)."""
    import copy

    import torch

    class FixedMask(torch.nn.Module):
        def __init__(self, mask: np.ndarray, p: float) -> None:
            super().__init__()
            self.mask = torch.from_numpy(np.asarray(mask, np.float32))
            self.scale = 1.0 / (1.0 - p)

        def forward(self, x):
            return x * self.mask.to(x.dtype) * self.scale

    ref = copy.deepcopy(module)
    ref.train()
    if float64:
        ref.double()
    for path, mask in (masks or {}).items():
        parent_path, _, leaf = path.rpartition(".")
        parent = ref.get_submodule(parent_path) if parent_path else ref
        setattr(parent, leaf, FixedMask(mask, parent.get_submodule(leaf).p))
    args = [torch.from_numpy(np.asarray(x, np.float64 if float64 and np.asarray(x).dtype.kind
                                        == "f" else None))
            for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    loss = loss_fn(ref(*args), torch.from_numpy(np.asarray(labels)))
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in ref.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, ref


def check_step_graph(model) -> None:
    """A rewritten step graph (``trainer.step_model``, an ir.Model or ModelProto) is valid:
    ``onnx.checker`` with ``full_check`` (strict shape inference) passes, no two named nodes
    share a name (onnxruntime rejects such a graph) and every value is defined once."""
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    names = collections.Counter(n.name for n in proto.graph.node if n.name)
    dup = sorted(k for k, c in names.items() if c > 1)
    assert not dup, f"{len(dup)} node names used more than once, e.g. {dup[:5]}"
    values = collections.Counter(o for n in proto.graph.node for o in n.output if o)
    values.update({i.name for i in proto.graph.input} | {t.name for t in proto.graph.initializer})
    dup = sorted(k for k, c in values.items() if c > 1)
    assert not dup, f"{len(dup)} values defined more than once, e.g. {dup[:5]}"
