"""The torch module's state around export: the state_dict names an exported graph's
initializers take, distinct marker values that identify renamed initializers, a snapshot of
every parameter and buffer restored in place after the tracing forwards, and the BatchNorm
settings ONNX cannot express."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ngdist.errors import GraphError
from ngdist.frontends import torch_loss
from ngdist.frontends.renames import rename_graph
from ngdist.frontends.torch_buffers import same_bytes


def rename_initializers(model: onnx.ModelProto, state: dict[str, np.ndarray]) -> None:
    """Give every initializer that holds a state_dict tensor under another name that name.

    With constant folding off the exporter keeps state_dict names; an exporter that renames
    (``onnx::MatMul_12``) is matched by exact value and shape, refusing ambiguous matches.
    """
    g = model.graph
    taken = {t.name for t in g.initializer if t.name in state}
    renames: dict[str, str] = {}
    for t in g.initializer:
        if t.name in state or torch_loss.is_loss_initializer(t.name):
            continue
        arr = numpy_helper.to_array(t)
        if arr.dtype.kind != "f":
            continue
        hits = [k for k, v in state.items() if k not in taken and v.shape == arr.shape
                and v.dtype == arr.dtype and np.array_equal(v, arr)]
        if len(hits) == 1:
            renames[t.name] = hits[0]
            taken.add(hits[0])
        elif len(hits) > 1:
            raise GraphError(f"the exported initializer {t.name!r} equals several state_dict "
                             f"entries {hits}; cannot tell which one it is")
    rename_graph(g, renames)


def mark_unique(module: Any) -> dict[str, np.ndarray]:
    """Fills every float parameter and buffer with distinct values in [0.5, 1.5); returns
    views of them (valid until the module's values change again)."""
    import torch

    rng = np.random.default_rng(0)
    tensors = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                # drawn in float32: float64 draws cost twice the memory and time (1 GB and
                # 10 s for VGG-11's 132 M values) and are rounded to float32 or less anyway
                values = rng.random(tuple(t.shape), dtype=np.float32)
                values += np.float32(0.5)
                t.copy_(torch.from_numpy(values).to(t.dtype))
    return {k: t.detach().cpu().numpy() for k, t in tensors.items() if t.is_floating_point()}


def snapshot(module: Any, buffers_only: bool = False) -> dict[str, tuple[Any, Any]]:
    """state_dict name -> (the tensor object, a copy of its value), for ``_restore``; of the
    buffers alone (what a forward moves) where ``buffers_only``."""
    import torch

    skip = {n for n, _ in module.named_parameters()} if buffers_only else set()
    return {k: (v, v.detach().clone()) for k, v in module.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and k not in skip}


def restore(module: Any, snapshot: dict[str, tuple[Any, Any]]) -> None:
    """Puts every parameter and buffer back as ``_snapshot`` found it: the same tensor objects
    (a module that rebound one gets the original back) holding the same values.

    Values are copied in place, not through ``load_state_dict``: that would run the modules'
    ``_load_from_state_dict`` hooks without the state dict's ``_metadata`` (module versions),
    and torchvision's MNASNet, for one, refuses a state dict without its version. A tensor
    that holds its value already is left alone: its ``_version`` then still says whether a
    forward wrote it (frontends/torch_buffers.py).
    """
    import torch

    current = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, (tensor, value) in snapshot.items():
            if not same_bytes(tensor, value):
                tensor.copy_(value)
            if current.get(name) is not tensor:
                owner, _, leaf = name.rpartition(".")
                sub = module.get_submodule(owner) if owner else module
                table = sub._parameters if leaf in sub._parameters else sub._buffers
                table[leaf] = tensor


def check_batchnorm(module: Any) -> None:
    import torch

    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            if sub.momentum is None and sub.track_running_stats:
                raise GraphError(f"BatchNorm '{name}' has momentum=None (cumulative moving "
                                 "average), which ONNX BatchNormalization cannot express; "
                                 "give it a momentum (e.g. 0.1)")
