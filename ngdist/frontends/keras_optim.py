"""Translation of Keras optimizers into ngdist optimizers (``ngdist.optim``).

``SGD`` (momentum, Nesterov) and ``Adam`` are ONNX's Momentum and Adam formulas; ``Adadelta``
is torch's, ``Nadam`` torch's NAdam with ``momentum_decay=1``; ``RMSprop``, ``Adagrad`` and
``Adamax`` are Keras' own (``ngdist.optim.KerasRMSprop``...). Every optimizer's
``weight_decay`` is Keras' (decoupled, before the update: ``ngdist.optim.KerasSGD``...;
``Adam``/``AdamW`` with one are ``KerasAdamW``); the variables ``exclude_from_weight_decay``
names form a group with weight decay 0.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ngdist import optim
from ngdist.errors import GraphError


def translate_optimizer(opt: Any, model: Any = None) -> optim.Optimizer:
    """``keras.optimizers.SGD`` / ``Adam`` / ``AdamW`` / ``Adadelta`` / ``Nadam`` /
    ``RMSprop`` / ``Adagrad`` / ``Adamax`` -> the ngdist optimizer with the same update. A
    ``weight_decay`` is Keras' decoupled one (``ngdist.optim.keras_formulas``); the variables
    of ``model`` that ``exclude_from_weight_decay`` names form a group without it (their ONNX
    names are the variables' paths)."""
    name = type(opt).__name__
    cfg = opt.get_config()
    lr = cfg.get("learning_rate")
    if not isinstance(lr, (int, float)):
        raise GraphError(f"{name}: learning-rate schedules are not supported; use a constant "
                         "learning rate and trainer.set_lr()")
    unsupported = [k for k in ("clipnorm", "clipvalue", "global_clipnorm") if cfg.get(k)] + \
        (["use_ema"] if cfg.get("use_ema") else [])
    if unsupported:
        raise GraphError(f"{name}: {unsupported} have no ONNX counterpart; leave them unset "
                         "(ngdist.compile takes clip_grad_norm= and clip_grad_value=)")
    if cfg.get("amsgrad"):
        raise GraphError(f"{name}(amsgrad=True) is not supported")
    out = _translate(opt, cfg, float(lr), float(cfg.get("weight_decay") or 0.0))
    if model is None or not cfg.get("weight_decay"):
        return out
    excluded = [v.path for v in model.trainable_variables if not opt._use_weight_decay(v)]
    return out if not excluded else \
        dataclasses.replace(out, groups=({"params": excluded, "weight_decay": 0.0},))


def _translate(opt: Any, cfg: Mapping[str, Any], lr: float, wd: float) -> optim.Optimizer:
    """The ngdist optimizer of Keras optimizer ``opt`` (``cfg`` its config), weight decay ``wd``
    (Keras' decoupled one: a Keras class of ngdist.optim where it is not 0)."""
    import keras

    o = keras.optimizers
    betas = (float(cfg.get("beta_1", 0.9)), float(cfg.get("beta_2", 0.999)))
    eps = float(cfg.get("epsilon", 1e-7))
    decay = {"weight_decay": wd} if wd else {}
    if isinstance(opt, o.SGD):
        return (optim.KerasSGD if wd else optim.SGD)(
            lr=lr, momentum=float(cfg.get("momentum", 0.0)),
            nesterov=bool(cfg.get("nesterov", False)), **decay)
    if isinstance(opt, o.Adam):  # AdamW is an Adam; with a decay, Keras' AdamW formula
        return optim.KerasAdamW(lr=lr, eps=eps, betas=betas, weight_decay=wd) if wd else \
            optim.Adam(lr=lr, betas=betas, eps=eps)
    if isinstance(opt, o.Adadelta):  # Keras' Adadelta is torch's formula
        return (optim.KerasAdadelta if wd else optim.Adadelta)(
            lr=lr, rho=float(cfg["rho"]), eps=eps, **decay)
    if isinstance(opt, o.Nadam):  # torch's NAdam with 0.96^t: momentum_decay 1
        return optim.KerasNadam(lr=lr, betas=betas, eps=eps, **decay) if wd else \
            optim.NAdam(lr=lr, betas=betas, eps=eps, momentum_decay=1.0)
    # Keras' own formulas (epsilon placed otherwise than torch's)
    if isinstance(opt, o.RMSprop):
        return optim.KerasRMSprop(lr=lr, alpha=float(cfg["rho"]), eps=eps,
                                  momentum=float(cfg["momentum"]),
                                  centered=bool(cfg["centered"]), **decay)
    if isinstance(opt, o.Adagrad):
        return optim.KerasAdagrad(lr=lr, eps=eps, initial_accumulator_value=float(
            cfg["initial_accumulator_value"]), **decay)
    if isinstance(opt, o.Adamax):
        return optim.KerasAdamax(lr=lr, eps=eps, betas=betas, **decay)
    raise GraphError(f"optimizer {type(opt).__name__} has no ngdist counterpart; use "
                     "keras.optimizers.SGD, Adam, AdamW, Adadelta, Nadam, RMSprop, Adagrad, "
                     "Adamax or an ngdist.optim optimizer")
