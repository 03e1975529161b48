"""Optimizers, described by their hyper-parameters and emitted as ONNX preview-training ops.

``SGD`` (momentum, Nesterov, weight decay) becomes ``ai.onnx.preview.training.Momentum``,
``Adam`` becomes ``Adam`` and ``Adagrad`` becomes ``Adagrad``, exactly as the ONNX operator
specification defines them; ``passes.optimizers.OptimizerLoweringPass`` later rewrites them as
ordinary ops. Semantics follow PyTorch's ``torch.optim.SGD`` (dampening 0) and ONNX's Adam
(epsilon added to sqrt(h), bias correction folded into the learning rate).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SGD:
    """x <- x - lr * v, v <- momentum * v + (g + weight_decay * x); Nesterov optional."""

    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    op_type = "Momentum"
    state_suffixes = ("momentum",)

    def attributes(self) -> dict[str, object]:
        if self.nesterov and self.momentum <= 0:
            raise ValueError("Nesterov momentum requires momentum > 0")
        return {"alpha": float(self.momentum), "beta": 1.0,
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


Optimizer = SGD | Adam | Adagrad


def from_spec(spec: str | Optimizer) -> Optimizer:
    """``"sgd:lr=0.1,momentum=0.9"`` or ``"adam:lr=1e-3"`` (the CLI form) -> optimizer."""
    if not isinstance(spec, str):
        return spec
    name, _, rest = spec.partition(":")
    kinds = {"sgd": SGD, "adam": Adam, "adagrad": Adagrad}
    if name.lower() not in kinds:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(kinds)}")
    kwargs: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "nesterov":
            kwargs[key] = value.lower() in ("1", "true", "yes")
        elif key == "betas":
            kwargs[key] = tuple(float(v) for v in value.split("/"))
        else:
            kwargs[key] = float(value)
    return kinds[name.lower()](**kwargs)
