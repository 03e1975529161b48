"""Keras' optimizers where their update is not torch's (``KerasRMSprop``, ``KerasAdagrad``,
``KerasAdamax``, ``KerasAdamW``), and Keras' ``weight_decay`` on every optimizer.

Keras' weight decay is decoupled and comes before the update: x <- x - x * weight_decay * lr
(keras ``BaseOptimizer._apply_weight_decay``), with the current learning rate. On these
classes ``weight_decay`` is that decay (``KERAS_DECAY_ATTR`` on the node, the lowering applies
it before any formula); ``KerasSGD``, ``KerasAdadelta`` and ``KerasNadam`` are ngdist's
``SGD``, ``Adadelta`` and ``NAdam`` (the formulas Keras' share) with Keras' decay.
"""
from __future__ import annotations

from dataclasses import dataclass

from ngdist.optim.torch_formulas import SGD, Adadelta, Adagrad, Adamax, NAdam, RMSprop
from ngdist.passes.optimizers import KERAS_ADAGRAD, KERAS_ADAMAX, KERAS_ADAMW, KERAS_RMSPROP


class _Keras:
    """What Keras' optimizers share: Keras' weight decay, and no scheduler cycles a momentum."""

    momentum_attr = None
    keras_decay = True


@dataclass(frozen=True)
class KerasRMSprop(_Keras, RMSprop):
    """Keras' ``RMSprop`` (``alpha`` is its rho): epsilon inside the square root,
    sqrt(sq + eps), and the learning rate inside the momentum buffer, m <- momentum m +
    lr g / sqrt(sq + eps); x <- x - m."""

    lr: float = 1e-3
    alpha: float = 0.9
    eps: float = 1e-7
    formula = KERAS_RMSPROP


@dataclass(frozen=True)
class KerasAdagrad(_Keras, Adagrad):
    """Keras' ``Adagrad``: x <- x - lr g / sqrt(h + eps), the sums starting at 0.1."""

    lr: float = 1e-3
    eps: float = 1e-7
    initial_accumulator_value: float = 0.1
    formula = KERAS_ADAGRAD


@dataclass(frozen=True)
class KerasAdamax(_Keras, Adamax):
    """Keras' ``Adamax``: u <- max(b2 u, |g|); x <- x - lr / (1 - b1^t) m / (u + eps)."""

    lr: float = 1e-3
    eps: float = 1e-7
    formula = KERAS_ADAMAX


@dataclass(frozen=True)
class KerasAdamW(_Keras, Adamax):
    """Keras' ``AdamW``: x <- x - x * weight_decay * lr first (decoupled, with the current
    learning rate), then Keras' Adam: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
    x <- x - lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps)."""

    lr: float = 1e-3
    eps: float = 1e-7
    weight_decay: float = 0.004
    formula = KERAS_ADAMW


@dataclass(frozen=True)
class KerasSGD(_Keras, SGD):
    """Keras' ``SGD`` with its ``weight_decay`` (decoupled, before the update)."""


@dataclass(frozen=True)
class KerasAdadelta(_Keras, Adadelta):
    """Keras' ``Adadelta`` (torch's formula) with its ``weight_decay``."""


@dataclass(frozen=True)
class KerasNadam(_Keras, NAdam):
    """Keras' ``Nadam`` (torch's NAdam with ``momentum_decay=1``) with its ``weight_decay``."""

    momentum_decay: float = 1.0
