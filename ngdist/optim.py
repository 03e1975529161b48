"""Optimizers, described by their hyper-parameters and emitted as ONNX preview-training ops.

``SGD`` (momentum, dampening, Nesterov, weight decay) becomes
``ai.onnx.preview.training.Momentum``, ``Adam`` becomes ``Adam`` and ``Adagrad`` becomes
``Adagrad``, exactly as the ONNX operator specification defines them;
``passes.optimizers.OptimizerLoweringPass`` later rewrites them as ordinary ops. ``SGD`` is
PyTorch's ``torch.optim.SGD`` (ONNX Momentum with beta = 1 - dampening); ``Adam`` is ONNX's Adam
(epsilon added to sqrt(h), bias correction folded into the learning rate).

``TorchAdam`` and ``AdamW`` are PyTorch's ``torch.optim.Adam`` and ``torch.optim.AdamW``
(epsilon added after the second-moment bias correction; AdamW's decay decoupled from the
gradient). They are ONNX ``Adam`` nodes carrying the attribute ``ngdist_formula``
(``"torch_adam"`` / ``"torch_adamw"``; AMSGrad adds ``ngdist_amsgrad=1`` and a third state),
which the lowering pass reads; the attributes survive saving and loading the training model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# the Adam attribute that selects PyTorch's formula, and its values
from ngdist.passes.optimizers import AMSGRAD_ATTR, FORMULA_ATTR, TORCH_ADAM, TORCH_ADAMW




@dataclass(frozen=True)
class SGD:
    """PyTorch's SGD: g' = g + weight_decay * x; v = g' on the first step, then
    v <- momentum * v + (1 - dampening) * g'; x <- x - lr * v (Nesterov: x <- x - lr *
    (g' + momentum * v))."""

    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0

    op_type = "Momentum"
    state_suffixes = ("momentum",)

    def attributes(self) -> dict[str, object]:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening 0")
        # ONNX Momentum: v <- alpha * v + beta * g' with beta taken as 1 on the first step
        # (T == 0), which is torch's first step buf = g'. Without momentum torch ignores
        # dampening (x <- x - lr * g'), so beta stays 1 there.
        beta = 1.0 - float(self.dampening) if self.momentum else 1.0
        return {"alpha": float(self.momentum), "beta": beta,
                "mode": "nesterov" if self.nesterov else "standard",
                "norm_coefficient": float(self.weight_decay)}

    step_offset = 0  # ONNX Momentum treats T == 0 as the first step


@dataclass(frozen=True)
class Adam:
    """ONNX Adam: bias-corrected moments; ``weight_decay`` is L2 added to the gradient."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    op_type = "Adam"
    state_suffixes = ("adam_m", "adam_v")

    def attributes(self) -> dict[str, object]:
        return {"alpha": float(self.betas[0]), "beta": float(self.betas[1]),
                "epsilon": float(self.eps), "norm_coefficient": float(self.weight_decay),
                "norm_coefficient_post": 0.0}

    step_offset = 1  # ONNX Adam applies bias correction for T > 0; the first step is T = 1


@dataclass(frozen=True)
class Adagrad:
    """ONNX Adagrad: lr / (1 + T * decay), accumulated squared gradients."""

    lr: float = 0.01
    lr_decay: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0

    op_type = "Adagrad"
    state_suffixes = ("adagrad_h",)

    def attributes(self) -> dict[str, object]:
        return {"decay_factor": float(self.lr_decay), "epsilon": float(self.eps),
                "norm_coefficient": float(self.weight_decay)}

    step_offset = 0


@dataclass(frozen=True)
class TorchAdam:
    """PyTorch's ``torch.optim.Adam``: g' = g + weight_decay * x;
    m <- b1 m + (1 - b1) g'; v <- b2 v + (1 - b2) g'^2; with t the 1-based step,
    x <- x - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). AMSGrad: v_max <-
    max(v_max, v) (a third state, ``adam_vmax``) replaces v in the update."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    op_type = "Adam"
    formula = TORCH_ADAM

    @property
    def state_suffixes(self) -> tuple[str, ...]:
        return ("adam_m", "adam_v", "adam_vmax") if self.amsgrad else ("adam_m", "adam_v")

    def attributes(self) -> dict[str, object]:
        out: dict[str, object] = {
            "alpha": float(self.betas[0]), "beta": float(self.betas[1]),
            "epsilon": float(self.eps), "norm_coefficient": float(self.weight_decay),
            "norm_coefficient_post": 0.0, FORMULA_ATTR: self.formula}
        if self.amsgrad:
            out[AMSGRAD_ATTR] = 1
        return out

    step_offset = 1  # T is torch's step count: 1 on the first step


@dataclass(frozen=True)
class AdamW(TorchAdam):
    """PyTorch's ``torch.optim.AdamW``: x <- x * (1 - lr * weight_decay) first
    (decoupled decay, with the current learning rate), then TorchAdam's update without L2.
    In the graph, ``norm_coefficient`` of the marked Adam node holds the decoupled decay."""

    weight_decay: float = 0.01
    formula = TORCH_ADAMW


Optimizer = SGD | Adam | Adagrad | TorchAdam | AdamW
# every optimizer class, for isinstance checks
OPTIMIZERS = (SGD, Adam, Adagrad, TorchAdam, AdamW)


def from_spec(spec: str | Optimizer) -> Optimizer:
    """``"sgd:lr=0.1,momentum=0.9"`` or ``"adam:lr=1e-3,betas=0.9/0.999"`` (the CLI form) ->
    optimizer (``adam`` is ONNX's Adam, ``torch_adam`` and ``adamw`` PyTorch's Adam and AdamW).
    An unknown optimizer or key, or a value that is not a number (``nesterov``:
    1/0/true/false), is an OptionError naming the valid ones."""
    from ngdist.passes.options import OptionError, unknown_option

    if not isinstance(spec, str):
        return spec
    name, _, rest = spec.partition(":")
    kinds = {"sgd": SGD, "adam": Adam, "adagrad": Adagrad, "torch_adam": TorchAdam,
             "adamw": AdamW}
    kind = name.strip().lower()
    if kind not in kinds:
        raise OptionError(f"unknown optimizer {name!r} in {spec!r}; choose one of "
                          f"{sorted(kinds)}")
    cls = kinds[kind]
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, object] = {}
    for item in filter(None, (i.strip() for i in rest.split(","))):
        key, eq, value = (p.strip() for p in item.partition("="))
        if key not in valid:
            alias = _ALIASES.get(key.lower())
            raise unknown_option(key, f"optimizer {kind!r} in {spec!r}", valid, noun="key",
                                 guess=alias if alias in valid else None,
                                 listed_as=f"Valid keys of {kind}")
        if not eq or not value:
            raise OptionError(f"optimizer spec {spec!r}: {key!r} has no value; write "
                              f"{key}=VALUE")
        try:
            if key in ("nesterov", "amsgrad"):
                if value.lower() not in _BOOLS:
                    raise ValueError(value)
                kwargs[key] = _BOOLS[value.lower()]
            elif key == "betas":
                kwargs[key] = tuple(float(v) for v in value.split("/"))
                if len(kwargs[key]) != 2:  # type: ignore[arg-type]
                    raise ValueError(value)
            else:
                kwargs[key] = float(value)
        except ValueError:
            expected = {"nesterov": "1, 0, true or false", "amsgrad": "1, 0, true or false",
                        "betas": "two numbers as BETA1/BETA2"}.get(key, "a number")
            raise OptionError(f"optimizer spec {spec!r}: {key}={value!r} is not "
                              f"{expected}") from None
    return cls(**kwargs)


# other libraries' names for the same hyper-parameters, suggested when misused
_ALIASES = {"learning_rate": "lr", "epsilon": "eps", "beta1": "betas", "beta2": "betas",
            "beta_1": "betas", "beta_2": "betas", "decay": "weight_decay",
            "lr_decay_factor": "lr_decay"}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
