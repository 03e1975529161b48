"""Translation of Keras optimizers into ngdist optimizers (``ngdist.optim``).

``SGD`` (momentum, Nesterov) and ``Adam`` are ONNX's Momentum and Adam formulas; ``Adadelta``
is torch's, ``Nadam`` torch's NAdam with ``momentum_decay=1``; ``RMSprop``, ``Adagrad`` and
``Adamax`` are Keras' own (``ngdist.optim.KerasRMSprop``...). ``Adam``/``AdamW`` with a
``weight_decay`` are ``KerasAdamW`` (Keras' decay is decoupled and comes before the update);
the variables ``exclude_from_weight_decay`` names form a group with weight decay 0.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ngdist import optim
from ngdist.errors import GraphError


def translate_optimizer(opt: Any, model: Any = None) -> optim.Optimizer:
    """``keras.optimizers.SGD`` / ``Adam`` / ``AdamW`` / ``Adadelta`` / ``Nadam`` /
    ``RMSprop`` / ``Adagrad`` / ``Adamax`` -> the ngdist optimizer with the same update. The
    weight decay of ``Adam``/``AdamW`` is Keras' decoupled one (``ngdist.optim.KerasAdamW``);
    the variables of ``model`` that ``exclude_from_weight_decay`` names form a group without
    it (their ONNX names are the variables' paths)."""
    import keras

    name = type(opt).__name__
    cfg = opt.get_config()
    lr = cfg.get("learning_rate")
    if not isinstance(lr, (int, float)):
        raise GraphError(f"{name}: learning-rate schedules are not supported; use a constant "
                         "learning rate and trainer.set_lr()")
    decoupled = isinstance(opt, keras.optimizers.Adam) and bool(cfg.get("weight_decay"))
    unsupported = [k for k in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm")
                   if cfg.get(k) and not (decoupled and k == "weight_decay")] + \
        (["use_ema"] if cfg.get("use_ema") else [])
    if unsupported:
        raise GraphError(f"{name}: {unsupported} have no ONNX counterpart (Keras' weight decay "
                         "is decoupled; ngdist takes it on Adam and AdamW); leave them unset")
    if decoupled:
        return _keras_adamw(opt, cfg, model)
    if isinstance(opt, keras.optimizers.SGD):
        return optim.SGD(lr=float(lr), momentum=float(cfg.get("momentum", 0.0)),
                         nesterov=bool(cfg.get("nesterov", False)))
    if isinstance(opt, keras.optimizers.Adam):
        if cfg.get("amsgrad"):
            raise GraphError("Adam(amsgrad=True) is not supported")
        return optim.Adam(lr=float(lr), betas=(float(cfg["beta_1"]), float(cfg["beta_2"])),
                          eps=float(cfg["epsilon"]))
    if isinstance(opt, keras.optimizers.Adadelta):  # Keras' Adadelta is torch's formula
        return optim.Adadelta(lr=float(lr), rho=float(cfg["rho"]), eps=float(cfg["epsilon"]))
    if isinstance(opt, keras.optimizers.Nadam):  # torch's NAdam with 0.96^t: momentum_decay 1
        return optim.NAdam(lr=float(lr), betas=(float(cfg["beta_1"]), float(cfg["beta_2"])),
                           eps=float(cfg["epsilon"]), momentum_decay=1.0)
    # Keras' own formulas (epsilon placed otherwise than torch's)
    if isinstance(opt, keras.optimizers.RMSprop):
        return optim.KerasRMSprop(lr=float(lr), alpha=float(cfg["rho"]),
                                  eps=float(cfg["epsilon"]), momentum=float(cfg["momentum"]),
                                  centered=bool(cfg["centered"]))
    if isinstance(opt, keras.optimizers.Adagrad):
        return optim.KerasAdagrad(lr=float(lr), eps=float(cfg["epsilon"]),
                                  initial_accumulator_value=float(
                                      cfg["initial_accumulator_value"]))
    if isinstance(opt, keras.optimizers.Adamax):
        return optim.KerasAdamax(lr=float(lr), eps=float(cfg["epsilon"]),
                                 betas=(float(cfg["beta_1"]), float(cfg["beta_2"])))
    raise GraphError(f"optimizer {name} has no ngdist counterpart; use keras.optimizers.SGD, "
                     "Adam, Adadelta, Nadam, RMSprop, Adagrad, Adamax or an ngdist.optim "
                     "optimizer")


def _keras_adamw(opt: Any, cfg: Mapping[str, Any], model: Any) -> optim.Optimizer:
    """Keras' Adam/AdamW with its weight decay, the excluded variables a group without it."""
    if cfg.get("amsgrad"):
        raise GraphError(f"{type(opt).__name__}(amsgrad=True) is not supported")
    out = optim.KerasAdamW(lr=float(cfg["learning_rate"]), eps=float(cfg["epsilon"]),
                           betas=(float(cfg["beta_1"]), float(cfg["beta_2"])),
                           weight_decay=float(cfg["weight_decay"]))
    if model is None:
        return out
    excluded = [v.path for v in model.trainable_variables if not opt._use_weight_decay(v)]
    return out if not excluded else \
        dataclasses.replace(out, groups=({"params": excluded, "weight_decay": 0.0},))
