"""``nn.Embedding``'s options in the PyTorch frontend: what ngdist honours and what it refuses.

* ``padding_idx=p``: torch's gradient of the weight from the lookup is zero in row p, so the
  row changes only through the optimizer's own terms (weight decay). The exporter emits a plain
  Gather; the frontend marks each Gather that reads such a weight with the ``metadata_props``
  entry ``ngdist.padding_idx`` and the autodiff pass zeroes that row of the Gather's own
  gradient contribution (a weight tied to an output layer still gets that layer's gradient in
  the row, as in torch), before any communication or optimizer.
* ``max_norm``: torch renormalises the looked-up rows of the weight in place during forward
  (outside autograd) and the optimizer then steps from the renormalised weight; refused.
* ``scale_grad_by_freq``: each row's gradient divided by its count in the mini-batch; on N ranks
  one process's count is not the global batch's; refused.
* ``sparse=True``: torch's SGD without weight decay computes what it computes for a dense
  gradient, so it is accepted there; every other optimizer is refused, most as torch refuses
  them (Adam, AdamW, RMSprop, ...: "does not support sparse gradients"; SGD with weight
  decay: "add(sparse, dense) is not supported").
"""
from __future__ import annotations

from typing import Any

import onnx

from ngdist import optim
from ngdist.errors import GraphError
from ngdist.passes.autodiff.driver import PADDING_IDX


def _embeddings(module: Any) -> list[tuple[str, Any]]:
    import torch

    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [(name or type(module).__name__, sub) for name, sub in module.named_modules()
            if isinstance(sub, kinds)]


# torch optimizers whose step raises on a sparse gradient (torch 2.13)
_TORCH_REFUSES_SPARSE = {"Adam", "AdamW", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam",
                         "ASGD", "Rprop"}


def _sparse_ok(optimizer: Any) -> str | None:
    """None when an optimizer steps a sparse gradient as a dense one, else why not."""
    import torch

    if isinstance(optimizer, torch.optim.SGD):
        decays = any(g.get("weight_decay") for g in optimizer.param_groups)
        return "torch.optim.SGD with weight_decay fails on a sparse gradient (add(sparse, " \
            "dense) is not supported)" if decays else None
    if isinstance(optimizer, optim.SGD):
        return "ngdist.optim.SGD with weight_decay has no sparse counterpart in torch" \
            if optimizer.weight_decay else None
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Optimizer) and name in _TORCH_REFUSES_SPARSE:
        return f"torch.optim.{name} does not support sparse gradients (torch raises at its " \
            "first step)"
    return f"ngdist takes sparse gradients only with SGD without weight decay, not {name}"


def check_embeddings(module: Any, optimizer: Any) -> None:
    """Refuses the options ngdist cannot match (see the module docstring); ``optimizer`` is
    the optimizer training will use (a torch or an ngdist one)."""
    import torch

    for name, sub in _embeddings(module):
        kind = type(sub).__name__
        if sub.max_norm is not None:
            raise GraphError(
                f"{kind} '{name}' has max_norm={sub.max_norm}: torch renormalises the looked-up "
                "rows of its weight in place during forward, which ngdist does not reproduce; "
                "drop max_norm (or renormalise the weight yourself between steps)")
        if sub.scale_grad_by_freq:
            raise GraphError(
                f"{kind} '{name}' has scale_grad_by_freq=True: ngdist does not scale rows by "
                "their count in the batch (on several ranks that count would be the global "
                "batch's); use scale_grad_by_freq=False")
        if isinstance(sub, torch.nn.EmbeddingBag) and sub.padding_idx is not None:
            raise GraphError(f"EmbeddingBag '{name}' has padding_idx={sub.padding_idx}, which "
                             "ngdist does not honour; use nn.Embedding and a reduction")
        if sub.sparse:
            why = _sparse_ok(optimizer)
            if why is not None:
                raise GraphError(f"{kind} '{name}' has sparse=True and {why}; use "
                                 "sparse=False (ngdist's gradients are dense)")


def mark_padding_rows(module: Any, model: onnx.ModelProto) -> int:
    """Marks every Gather of ``model`` that reads the weight of an ``nn.Embedding`` with
    ``padding_idx`` (by the weight's state_dict names); returns the number of marked nodes."""
    rows: dict[str, tuple[int, str]] = {}  # initializer name -> (padding row, module)
    state = module.state_dict(keep_vars=True)
    inits = {t.name for t in model.graph.initializer}
    for name, sub in _embeddings(module):
        if sub.padding_idx is None or not sub.weight.requires_grad:
            continue
        names = [k for k, v in state.items() if v is sub.weight and k in inits]
        for init in names:  # none: forward does not read the weight, nothing to keep
            earlier = rows.setdefault(init, (sub.padding_idx, name))
            if earlier[0] != sub.padding_idx:
                raise GraphError(f"Embeddings '{earlier[1]}' and '{name}' share a weight but "
                                 f"differ in padding_idx ({earlier[0]}, {sub.padding_idx})")
    marked = 0
    for node in model.graph.node:
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and \
                node.input[0] in rows:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if axis != 0:
                raise GraphError(f"the weight '{node.input[0]}' of Embedding "
                                 f"'{rows[node.input[0]][1]}' is read by Gather '{node.name}' "
                                 f"on axis {axis}; padding_idx needs row lookups (axis 0)")
            entry = node.metadata_props.add()
            entry.key, entry.value = PADDING_IDX, str(rows[node.input[0]][0])
            marked += 1
    unread = sorted(set(rows) - {n.input[0] for n in model.graph.node if n.op_type == "Gather"})
    if unread:
        raise GraphError(f"the embedding weights {unread} have a padding_idx but no Gather of "
                         "the exported graph reads them directly; ngdist cannot keep the "
                         "padding row out of the gradient")
    return marked
