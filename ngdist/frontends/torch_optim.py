"""Translation of ``torch.optim`` optimizers into ngdist optimizers (``ngdist.optim``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ngdist import optim
from ngdist.errors import GraphError


def _group_hyper(opt: Any, keys: Sequence[str]) -> dict[str, Any]:
    groups = opt.param_groups
    first = {k: groups[0].get(k) for k in keys}
    for g in groups[1:]:
        diff = [k for k in keys if g.get(k) != first[k]]
        if diff:
            raise GraphError(f"{type(opt).__name__} has parameter groups that differ in {diff}; "
                             "ngdist applies one set of hyper-parameters to all parameters")
    return first


def translate_optimizer(opt: Any) -> optim.Optimizer:
    """``torch.optim.SGD`` / ``Adam`` / ``AdamW`` -> the ngdist optimizer with the same math."""
    import torch

    if isinstance(opt, torch.optim.SGD):
        h = _group_hyper(opt, ["lr", "momentum", "dampening", "nesterov", "weight_decay",
                               "maximize"])
        if h["maximize"]:
            raise GraphError("torch.optim.SGD(maximize=True) is not supported")
        return optim.SGD(lr=float(h["lr"]), momentum=float(h["momentum"]),
                         nesterov=bool(h["nesterov"]), weight_decay=float(h["weight_decay"]),
                         dampening=float(h["dampening"] or 0.0))
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        h = _group_hyper(opt, ["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                               "decoupled_weight_decay"])
        decoupled = bool(h.get("decoupled_weight_decay")) or \
            isinstance(opt, torch.optim.AdamW)
        name = "AdamW" if decoupled else "Adam"
        if h["maximize"]:
            raise GraphError(f"torch.optim.{name}(maximize=True) is not supported")
        b1, b2 = (float(b) for b in h["betas"])
        cls = optim.AdamW if decoupled else optim.TorchAdam
        return cls(lr=float(h["lr"]), betas=(b1, b2), eps=float(h["eps"]),
                   weight_decay=float(h["weight_decay"]), amsgrad=bool(h["amsgrad"]))
    raise GraphError(f"optimizer {type(opt).__name__} has no ngdist counterpart; use "
                     "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW or an ngdist.optim "
                     "optimizer")


def _optimizer_params(module: Any, opt: Any) -> list[str]:
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    return [n for n, p in module.named_parameters() if id(p) in ids and p.requires_grad]
