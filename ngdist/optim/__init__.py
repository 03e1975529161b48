"""Optimizers, described by their hyper-parameters and emitted as ONNX preview-training ops.

``SGD`` (momentum, dampening, Nesterov, weight decay) becomes
``ai.onnx.preview.training.Momentum``, ``Adam`` becomes ``Adam`` and ``Adagrad`` becomes
``Adagrad``, exactly as the ONNX operator specification defines them;
``passes.optimizers.OptimizerLoweringPass`` later rewrites them as ordinary ops. ``SGD`` is
PyTorch's ``torch.optim.SGD`` (ONNX Momentum with beta = 1 - dampening), ``Adagrad`` is
``torch.optim.Adagrad``; ``Adam`` is ONNX's Adam (epsilon added to sqrt(h), bias correction
folded into the learning rate).

``TorchAdam``, ``AdamW``, ``Adamax``, ``NAdam``, ``RAdam`` (ONNX ``Adam`` nodes), ``RMSprop``
and ``Adadelta`` (ONNX ``Adagrad`` nodes) are PyTorch's optimizers of those names: the node
carries the attribute ``ngdist_formula`` that the lowering pass reads (and ``ngdist_*``
attributes for the hyper-parameters ONNX's op lacks); they survive saving and loading the
training model. Every optimizer takes ``maximize`` (the update ascends) and ``groups``:
parameter groups as torch's ``param_groups``, e.g. ``AdamW(lr=1e-3, weight_decay=0.01,
groups=[{"params": ["fc.bias", "norm.weight"], "weight_decay": 0.0}])``: group i has the
optimizer's hyper-parameters with the group's own values in their place, and the parameters no
group names form one more group, last, with the optimizer's values. Each group is one optimizer
node with its own learning rate input (``ngdist.ir.hyper.lr_name``). ``SGD``, ``TorchAdam``,
``AdamW``, ``Adamax``, ``NAdam``, ``RAdam`` and ``RMSprop`` take ``scheduled_momentum=True``:
the momentum (beta1) is an input of the step too (``ngdist.ir.hyper.momentum_name``), which
the trainer follows from a torch optimizer whose scheduler cycles it (OneCycleLR, CyclicLR).

``KerasSGD``, ``KerasRMSprop``... (optim/keras_formulas.py) are Keras' optimizers, whose
``weight_decay`` is Keras' decoupled decay before the update.

A hyper-parameter of the wrong type (``SGD(lr="0.05")``) or out of torch's range is an
OptionError naming it.
"""
from __future__ import annotations

import logging

from ngdist.errors import OptionError
from ngdist.optim.spec import parse_spec
# torch's formulas (optim/torch_formulas.py); Keras' own and Keras' decoupled weight decay
# (optim/keras_formulas.py)
from ngdist.optim.torch_formulas import (SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, NAdam,
                                         RAdam, RMSprop, TorchAdam)
from ngdist.optim.keras_formulas import (KerasAdadelta, KerasAdagrad, KerasAdamax,
                                         KerasAdamW, KerasNadam, KerasRMSprop, KerasSGD)

logger = logging.getLogger(__name__)

Optimizer = (SGD | Adam | Adagrad | TorchAdam | AdamW | Adamax | NAdam | RAdam | RMSprop |
             Adadelta | KerasRMSprop | KerasAdagrad | KerasAdamax | KerasAdamW | KerasSGD |
             KerasAdadelta | KerasNadam)
# every optimizer class, for isinstance checks
OPTIMIZERS = (SGD, Adam, Adagrad, TorchAdam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adadelta,
              KerasRMSprop, KerasAdagrad, KerasAdamax, KerasAdamW, KerasSGD, KerasAdadelta,
              KerasNadam)
# the CLI's names (``from_spec``)
KINDS = {"sgd": SGD, "adam": Adam, "adagrad": Adagrad, "torch_adam": TorchAdam, "adamw": AdamW,
         "adamax": Adamax, "nadam": NAdam, "radam": RAdam, "rmsprop": RMSprop,
         "adadelta": Adadelta, "keras_rmsprop": KerasRMSprop, "keras_adagrad": KerasAdagrad,
         "keras_adamax": KerasAdamax, "keras_adamw": KerasAdamW, "keras_sgd": KerasSGD,
         "keras_adadelta": KerasAdadelta, "keras_nadam": KerasNadam}


def from_spec(spec: str | Optimizer) -> Optimizer:
    """``"sgd:lr=0.1,momentum=0.9"`` or ``"adam:lr=1e-3,betas=0.9/0.999"`` (the CLI form) ->
    optimizer (``adam`` is ONNX's Adam; ``torch_adam``, ``adamw``, ``adamax``, ``nadam``,
    ``radam``, ``rmsprop``, ``adadelta`` and ``adagrad`` PyTorch's optimizers of those names).
    An unknown optimizer or key, or a value of the wrong type (booleans: 1/0/true/false), is
    an OptionError naming the valid ones."""
    if isinstance(spec, OPTIMIZERS):
        return spec
    if not isinstance(spec, str):
        raise OptionError(f"optimizer={spec!r}: pass an ngdist.optim optimizer (e.g. "
                          f"ngdist.optim.SGD(lr=0.01)) or a spec like 'sgd:lr=0.01', not a "
                          f"{type(spec).__name__}")
    cls, kwargs = parse_spec(spec, "optimizer", KINDS, _ALIASES)
    return cls(**kwargs)  # type: ignore[no-any-return]


def missing_optimizer(what: str, example: str = "") -> OptionError:
    """The error of a model compiled without an optimizer and without a training step of its
    own (``what`` names the model; ``example``: the framework's own optimizer, as a hint)."""
    return OptionError(
        f"{what} has no training step and no optimizer was given: pass optimizer= "
        f"(e.g. optimizer=ngdist.optim.SGD(lr=0.01){example} or a spec like "
        "'adamw:lr=1e-3')")


# other libraries' names for the same hyper-parameters, suggested when misused
_ALIASES = {"learning_rate": "lr", "epsilon": "eps", "beta1": "betas", "beta2": "betas",
            "beta_1": "betas", "beta_2": "betas", "decay": "weight_decay",
            "lr_decay_factor": "lr_decay"}

from ngdist.optim import schedules  # noqa: E402  (ngdist.optim.schedules.warmup_cosine...)
