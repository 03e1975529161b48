"""Translation of ``torch.optim`` optimizers into ngdist optimizers (``ngdist.optim``).

Every torch optimizer with an ngdist counterpart (SGD, Adam, AdamW, Adagrad, RMSprop, Adadelta,
Adamax, NAdam, RAdam) translates with all its hyper-parameters, ``maximize`` included; each of
torch's ``param_groups`` becomes an ngdist group with its own values (group i is torch's group
i). ``foreach``, ``fused``, ``capturable`` and ``differentiable`` only choose torch's
implementation and are ignored, as are the keys schedulers add (``initial_lr``, ``max_lr``...).

``lr_source`` reads the learning rate of every group back at each step, so that a
``torch.optim.lr_scheduler`` stepping the torch optimizer is followed; so is the momentum
(RMSprop, SGD) or beta1 (Adam, AdamW, Adamax, NAdam, RAdam) that OneCycleLR or CyclicLR cycles
(``scheduled_momentum``, seen by the ``max_momentum`` those schedulers put in every group). A
scheduler that changes another hyper-parameter is refused when it does.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ngdist import optim
from ngdist.errors import GraphError, OptionError
from ngdist.frontends.optim_nodes import mu_product_name
from ngdist.ir.hyper import lr_name, momentum_name

# torch class name -> the ngdist optimizer with its formula
_CLASSES: dict[str, type] = {
    "SGD": optim.SGD, "Adam": optim.TorchAdam, "AdamW": optim.AdamW, "Adagrad": optim.Adagrad,
    "RMSprop": optim.RMSprop, "Adadelta": optim.Adadelta, "Adamax": optim.Adamax,
    "NAdam": optim.NAdam, "RAdam": optim.RAdam}


def _torch_class(opt: Any) -> str | None:
    import torch

    for name in _CLASSES:
        if isinstance(opt, getattr(torch.optim, name)):
            return "AdamW" if name == "Adam" and isinstance(opt, torch.optim.AdamW) else name
    return None


def _hyper(cls: type, group: Mapping[str, Any], defaults: Mapping[str, Any]
           ) -> dict[str, Any]:
    """The ngdist hyper-parameters of one torch param group (a tensor lr becomes a float).
    torch.optim.Adagrad fills every group's sums with the constructor's
    ``initial_accumulator_value`` (``defaults``), whatever the group says."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in ("groups",) or f.name not in group:
            continue
        value = group[f.name]
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        if f.name == "dampening" and value is None:
            value = 0.0
        if f.name == "betas":
            value = tuple(v.item() if hasattr(v, "item") else v for v in value)
        out[f.name] = value
    if "initial_accumulator_value" in out:
        out["initial_accumulator_value"] = defaults["initial_accumulator_value"]
    return out


def translate_optimizer(opt: Any, module: Any = None) -> optim.Optimizer:
    """A torch optimizer -> the ngdist optimizer with the same math. With several param groups,
    ``module`` names their parameters (each group of the result is torch's group, in order)."""
    name = _torch_class(opt)
    if name is None:
        raise GraphError(f"optimizer {type(opt).__name__} has no ngdist counterpart; use one of "
                         f"torch.optim.{', torch.optim.'.join(_CLASSES)} or an ngdist.optim "
                         "optimizer")
    groups = opt.param_groups
    if name == "Adam" and groups[0].get("decoupled_weight_decay"):
        name = "AdamW"
    cls = _CLASSES[name]
    cycled = {} if not any("max_momentum" in g for g in groups) else \
        {"scheduled_momentum": _cycled_momentum(name, cls)}
    try:
        base = cls(**_hyper(cls, groups[0], opt.defaults), **cycled)
        if len(groups) == 1:
            return base
        if module is None:
            raise GraphError(f"torch.optim.{name} has {len(groups)} param groups: pass the "
                             "module too, translate_optimizer(opt, module), to name their "
                             "parameters")
        names = {id(p): n for n, p in module.named_parameters()}
        return dataclasses.replace(base, groups=tuple(
            {"params": [names[id(p)] for p in g["params"] if id(p) in names and p.requires_grad],
             **_hyper(cls, g, opt.defaults)} for g in groups))
    except OptionError as exc:
        raise OptionError(f"torch.optim.{name}: {exc}") from None


def _cycled_momentum(name: str, cls: type) -> bool:
    """True for an optimizer whose momentum (beta1) a scheduler cycles (OneCycleLR and
    CyclicLR mark its groups with ``max_momentum``) when ngdist follows it, else an error."""
    if "scheduled_momentum" not in {f.name for f in dataclasses.fields(cls)}:
        raise OptionError(f"torch.optim.{name}: a scheduler cycles its momentum "
                          "(cycle_momentum=True), which it has not; pass cycle_momentum=False "
                          "to the scheduler")
    return True


def restrict_groups(opt: optim.Optimizer, trained: Collection[str]) -> optim.Optimizer:
    """``opt`` whose groups name only parameters of ``trained`` (frozen ones, and those the
    export does not read, are not trained)."""
    if not opt.groups:
        return opt
    keep = set(trained)
    return dataclasses.replace(opt, groups=tuple(
        {**g, "params": [p for p in g["params"] if p in keep]} for g in opt.groups))


def _optimizer_params(module: Any, opt: Any) -> list[str]:
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    return [n for n, p in module.named_parameters() if id(p) in ids and p.requires_grad]


def lr_source(opt: Any, compiled: optim.Optimizer) -> Callable[[], dict[str, float]]:
    """A function giving {step value: its value now} of the torch optimizer ``opt``: every
    group's learning rate (``lr_name``), and its momentum or beta1 (``momentum_name``) when
    ``compiled`` has ``scheduled_momentum``; it raises an OptionError when another
    hyper-parameter of a group differs from the ``compiled`` one (a scheduler ngdist would
    not follow)."""
    cls = type(compiled)
    cycled = bool(getattr(compiled, "scheduled_momentum", False))
    base = {f.name: getattr(compiled, f.name) for f in dataclasses.fields(cls)
            if f.name not in ("groups", "lr", "scheduled_momentum")}
    fixed = [_fixed(dict(base, **{k: v for k, v in g.items() if k not in ("params", "lr")}),
                    cycled) for g in compiled.groups] or [_fixed(base, cycled)]

    def read() -> dict[str, float]:
        # ngdist steps in the torch optimizer's place: a scheduler's check that step() ran
        # before scheduler.step() (a warning that the first value is skipped) reads this flag
        opt._opt_called = True
        groups = opt.param_groups
        if len(groups) != len(fixed):
            raise OptionError(f"the torch optimizer now has {len(groups)} param groups, and was "
                              f"compiled with {len(fixed)}; add_param_group after "
                              "ngdist.compile is not followed: compile again")
        out = {}
        for i, (g, want) in enumerate(zip(groups, fixed)):
            given = _hyper(cls, g, opt.defaults)
            now = _fixed(given, cycled)
            changed = sorted(k for k in want if k in now and now[k] != want[k])
            if changed:
                raise OptionError(
                    f"param group {i} of the torch optimizer changed {changed} since "
                    f"ngdist.compile ({', '.join(f'{k}: {want[k]} -> {now[k]}' for k in changed)})"
                    "; ngdist follows a scheduler's learning rate, and the momentum (beta1) "
                    "that OneCycleLR or CyclicLR cycles when the scheduler is made before "
                    "ngdist.compile")
            out[lr_name(i)] = float(given["lr"])
            if cycled:
                out[momentum_name(i)] = float(given["betas"][0] if "betas" in given
                                              else given["momentum"])
        return out

    return read


def _fixed(values: dict[str, Any], cycled: bool) -> dict[str, Any]:
    """The hyper-parameters that must not change during training: all but lr, and but the
    momentum (beta1) when a scheduler cycles it."""
    if not cycled:
        return values
    out = {k: v for k, v in values.items() if k != "momentum"}
    if "betas" in out:
        out["betas"] = out["betas"][1:]
    return out


# ngdist state kind (``<param>.<kind>``) -> the torch optimizer's state key
_STATE_KEYS = {"momentum": "momentum_buffer", "adam_m": "exp_avg", "adam_v": "exp_avg_sq",
               "adam_vmax": "max_exp_avg_sq", "adagrad_h": "sum", "rmsprop_sq": "square_avg",
               "rmsprop_mom": "momentum_buffer", "rmsprop_gavg": "grad_avg",
               "adadelta_sq": "square_avg", "adadelta_acc": "acc_delta", "adamax_m": "exp_avg",
               "adamax_u": "exp_inf", "nadam_m": "exp_avg", "nadam_v": "exp_avg_sq",
               "radam_m": "exp_avg", "radam_v": "exp_avg_sq"}


def write_optimizer_state(values: Mapping[str, Any], steps: int, params: Mapping[str, Any],
                          opt: Any) -> None:
    """The trained optimizer state into the torch optimizer ``opt``'s ``state``: for each
    (ONNX name -> torch parameter) of ``params``, its states in ``values`` under torch's keys,
    with torch's ``step`` (and NAdam's ``mu_product``) after ``steps`` steps."""
    import torch

    name = _torch_class(opt)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for onnx_name, p in params.items():
        group = group_of.get(id(p))
        if group is None:
            continue
        state = opt.state[p]
        kinds = [k for k in _STATE_KEYS if f"{onnx_name}.{k}" in values]
        for kind in kinds:
            if kind == "momentum" and not group["momentum"]:
                continue  # torch's SGD keeps no buffer without momentum
            state[_STATE_KEYS[kind]] = torch.from_numpy(values[f"{onnx_name}.{kind}"].copy())
        if kinds and name != "SGD":
            state["step"] = torch.tensor(float(steps))
        if kinds and name == "NAdam":
            state["mu_product"] = torch.tensor(_mu_product(values, opt, group, steps))


def _mu_product(values: Mapping[str, Any], opt: Any, group: Mapping[str, Any], steps: int
                ) -> float:
    """NAdam's mu_product after ``steps`` steps: the step's state under a scheduled beta1,
    else the product of every step's mu from the group's beta1."""
    index = next(i for i, g in enumerate(opt.param_groups) if g is group)
    if mu_product_name(index) in values:
        return float(values[mu_product_name(index)])
    b1, decay, product = group["betas"][0], group["momentum_decay"], 1.0
    for i in range(1, steps + 1):
        product *= b1 * (1.0 - 0.5 * 0.96 ** (i * decay))
    return product
