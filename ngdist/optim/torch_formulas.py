"""PyTorch's optimizers (and ONNX's ``Adam``) as ``ngdist.optim`` describes them: each a frozen
dataclass of its hyper-parameters whose node attributes the lowering pass reads
(``ngdist.passes.optimizers``); see ``ngdist.optim`` for the whole family."""
from __future__ import annotations

from dataclasses import dataclass

from ngdist.errors import OptionError
from ngdist.optim.base import _groups_field, _Optimizer
from ngdist.optim.checks import Group
from ngdist.passes.optimizers import (ADADELTA, ADAMAX, AMSGRAD_ATTR, DECOUPLED_ATTR,
                                      MU_PRODUCT, NADAM, RADAM, RMSPROP, SCHEDULED_ATTR,
                                      TORCH_ADAM, TORCH_ADAMW)


@dataclass(frozen=True)
class SGD(_Optimizer):
    """PyTorch's SGD: g' = g + weight_decay * x; v = g' on the first step, then
    v <- momentum * v + (1 - dampening) * g'; x <- x - lr * v (Nesterov: x <- x - lr *
    (g' + momentum * v))."""

    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0
    maximize: bool = False
    scheduled_momentum: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Momentum"
    momentum_attr = "alpha"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptionError("SGD(nesterov=True): Nesterov momentum requires momentum > 0 "
                              "and dampening 0")

    def _attributes(self) -> dict[str, object]:
        # ONNX Momentum: v <- alpha * v + beta * g' with beta taken as 1 on the first step
        # (T == 0), which is torch's first step buf = g'. Without momentum torch ignores
        # dampening (x <- x - lr * g'), so beta stays 1 there.
        beta = 1.0 - float(self.dampening) if self.momentum else 1.0
        return {"alpha": float(self.momentum), "beta": beta,
                "mode": "nesterov" if self.nesterov else "standard",
                "norm_coefficient": float(self.weight_decay)}


@dataclass(frozen=True)
class Adam(_Optimizer):
    """ONNX Adam: bias-corrected moments; ``weight_decay`` is L2 added to the gradient."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Adam"
    step_offset = 1  # ONNX Adam applies bias correction for T > 0; the first step is T = 1

    def _attributes(self) -> dict[str, object]:
        return {"alpha": float(self.betas[0]), "beta": float(self.betas[1]),
                "epsilon": float(self.eps), "norm_coefficient": float(self.weight_decay),
                "norm_coefficient_post": 0.0}


@dataclass(frozen=True)
class Adagrad(_Optimizer):
    """ONNX Adagrad, which is PyTorch's: lr / (1 + (t - 1) * lr_decay), accumulated squared
    gradients starting at ``initial_accumulator_value``."""

    lr: float = 0.01
    lr_decay: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    maximize: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Adagrad"

    def _attributes(self) -> dict[str, object]:
        return {"decay_factor": float(self.lr_decay), "epsilon": float(self.eps),
                "norm_coefficient": float(self.weight_decay)}

    def state_init(self, suffix: str) -> float:
        return float(self.initial_accumulator_value)


@dataclass(frozen=True)
class TorchAdam(_Optimizer):
    """PyTorch's ``torch.optim.Adam``: g' = g + weight_decay * x;
    m <- b1 m + (1 - b1) g'; v <- b2 v + (1 - b2) g'^2; with t the 1-based step,
    x <- x - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). AMSGrad: v_max <-
    max(v_max, v) (a third state, ``adam_vmax``) replaces v in the update."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    scheduled_momentum: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Adam"
    formula = TORCH_ADAM
    step_offset = 1  # T is torch's step count: 1 on the first step
    momentum_attr = "alpha"

    def _attributes(self) -> dict[str, object]:
        out: dict[str, object] = {
            "alpha": float(self.betas[0]), "beta": float(self.betas[1]),
            "epsilon": float(self.eps), "norm_coefficient": float(self.weight_decay),
            "norm_coefficient_post": 0.0}
        if self.amsgrad:
            out[AMSGRAD_ATTR] = 1
        return out


@dataclass(frozen=True)
class AdamW(TorchAdam):
    """PyTorch's ``torch.optim.AdamW``: x <- x * (1 - lr * weight_decay) first
    (decoupled decay, with the current learning rate), then TorchAdam's update without L2.
    In the graph, ``norm_coefficient`` of the marked Adam node holds the decoupled decay."""

    weight_decay: float = 0.01
    formula = TORCH_ADAMW


@dataclass(frozen=True)
class Adamax(_Optimizer):
    """PyTorch's ``torch.optim.Adamax``: g' = g + weight_decay * x; m <- lerp(m, g', 1 - b1);
    u <- max(b2 u, |g'| + eps); x <- x - lr / (1 - b1^t) * m / u."""

    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    scheduled_momentum: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Adam"
    formula = ADAMAX
    step_offset = 1
    momentum_attr = "alpha"

    def _attributes(self) -> dict[str, object]:
        return {"alpha": float(self.betas[0]), "beta": float(self.betas[1]),
                "epsilon": float(self.eps), "norm_coefficient": float(self.weight_decay)}


@dataclass(frozen=True)
class NAdam(Adamax):
    """PyTorch's ``torch.optim.NAdam``: Nesterov momentum with the schedule
    mu_t = b1 (1 - 0.5 * 0.96^(t * momentum_decay)); weight decay L2, or decoupled as AdamW's
    with ``decoupled_weight_decay``."""

    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False
    formula = NADAM

    def _attributes(self) -> dict[str, object]:
        return {**super()._attributes(), "ngdist_momentum_decay": float(self.momentum_decay),
                DECOUPLED_ATTR: int(self.decoupled_weight_decay)}

    def attributes(self) -> dict[str, object]:
        """With a scheduled beta1, the node also reads torch's ``mu_product`` (the product of
        every step's mu, each from that step's beta1) as its last input, ``MU_PRODUCT``."""
        out = super().attributes()
        if self.scheduled():
            out[SCHEDULED_ATTR] = [*out[SCHEDULED_ATTR], MU_PRODUCT]  # type: ignore[misc]
        return out


@dataclass(frozen=True)
class RAdam(Adamax):
    """PyTorch's ``torch.optim.RAdam``: Adam whose adaptive step is rectified once the
    variance estimate is tractable (rho_t > 5), plain momentum SGD before; weight decay L2,
    or decoupled with ``decoupled_weight_decay``."""

    lr: float = 1e-3
    decoupled_weight_decay: bool = False
    formula = RADAM

    def _attributes(self) -> dict[str, object]:
        return {**super()._attributes(), DECOUPLED_ATTR: int(self.decoupled_weight_decay)}


@dataclass(frozen=True)
class RMSprop(_Optimizer):
    """PyTorch's ``torch.optim.RMSprop``: sq <- alpha sq + (1 - alpha) g'^2; ``centered``
    subtracts the squared running mean of g'; with ``momentum`` a buffer
    b <- momentum b + g' / (sqrt(sq) + eps) steps, else g' / (sqrt(sq) + eps) does."""

    lr: float = 0.01
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False
    scheduled_momentum: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Adagrad"
    formula = RMSPROP
    momentum_attr = "ngdist_momentum"

    def _attributes(self) -> dict[str, object]:
        return {"decay_factor": 0.0, "epsilon": float(self.eps),
                "norm_coefficient": float(self.weight_decay), "ngdist_alpha": float(self.alpha),
                "ngdist_momentum": float(self.momentum), "ngdist_centered": int(self.centered)}


@dataclass(frozen=True)
class Adadelta(_Optimizer):
    """PyTorch's ``torch.optim.Adadelta``: sq <- rho sq + (1 - rho) g'^2;
    delta = sqrt(acc + eps) / sqrt(sq + eps) g'; acc <- rho acc + (1 - rho) delta^2;
    x <- x - lr delta."""

    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False
    groups: tuple[Group, ...] = _groups_field()

    op_type = "Adagrad"
    formula = ADADELTA

    def _attributes(self) -> dict[str, object]:
        return {"decay_factor": 0.0, "epsilon": float(self.eps),
                "norm_coefficient": float(self.weight_decay), "ngdist_rho": float(self.rho)}
