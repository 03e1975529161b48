"""PyTorch's ``torch.optim.RMSprop`` and ``Adadelta``, and Keras' ``RMSprop`` and ``Adagrad``
(epsilon inside the square root), on an ONNX ``Adagrad`` node (``ngdist_formula``), formula
for formula.

Attributes: epsilon is eps, norm_coefficient the (L2) weight decay; RMSprop's smoothing
constant is ``ngdist_alpha``, its momentum ``ngdist_momentum`` and ``ngdist_centered=1``
subtracts the squared running mean of the gradient; Adadelta's decay is ``ngdist_rho``.
R is the learning rate; T is read by Keras' Adagrad only (ONNX's decay_factor, 0 from Keras).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext
from ngdist.passes.optimizers.common import (ADADELTA, KERAS_ADAGRAD, KERAS_RMSPROP, RMSPROP,
                                             Scalars, maximized)


def _prelude(ctx: GradContext, k: Scalars, a: Mapping[str, object], x: ir.Value,
             g: ir.Value) -> ir.Value:
    """The gradient after maximize and L2 weight decay."""
    g = maximized(ctx, a, g)
    wd = float(a.get("norm_coefficient") or 0.0)
    return ctx.op("Add", g, ctx.op("Mul", k.exact(wd, x), x)) if wd else g


def _rmsprop(ctx: GradContext, k: Scalars, a: Mapping[str, object], lr: ir.Value, x: ir.Value,
             g: ir.Value, states: Sequence[ir.Value]) -> list[ir.Value]:
    """sq = alpha sq + (1 - alpha) g^2; centered: ga.lerp_(g, 1 - alpha), avg = sqrt(sq - ga^2),
    else sqrt(sq); avg += eps; momentum: buf = momentum buf + g / avg, x -= lr buf; else
    x -= lr g / avg. New x, sq (, buf) (, ga)."""
    alpha, eps = float(a.get("ngdist_alpha", 0.99)), float(a["epsilon"])  # type: ignore
    momentum = a.get("ngdist_momentum", 0.0)  # a float, or the scheduled momentum's value
    centered = bool(a.get("ngdist_centered", 0))
    sq, *rest = states
    buf = rest.pop(0) if isinstance(momentum, ir.Value) or momentum else None
    ga = rest.pop(0) if centered else None
    g = _prelude(ctx, k, a, x, g)
    sq_new = ctx.op("Add", ctx.op("Mul", sq, k.exact(alpha, x)),
                    ctx.op("Mul", ctx.op("Mul", g, g), k.exact(1 - alpha, x)))
    out = [sq_new]
    if ga is not None:
        ga = ctx.op("Add", ga, ctx.op("Mul", ctx.op("Sub", g, ga), k.exact(1 - alpha, x)))
        avg = ctx.op("Sqrt", ctx.op("Sub", sq_new, ctx.op("Mul", ga, ga)))
    else:
        avg = ctx.op("Sqrt", sq_new)
    avg = ctx.op("Add", avg, k.exact(eps, x))
    step = ctx.op("Div", g, avg)
    if isinstance(momentum, ir.Value):  # torch: the buffer only while momentum > 0
        on = k.memo(("rms_on", momentum.name), x, lambda: k.shape(ctx.op(
            "Greater", momentum, ctx.op("CastLike", ctx.const(0.0), momentum)), x))
        buf = ctx.op("Where", on, ctx.op("Add", ctx.op("Mul", buf, k.cast(momentum, x)), step),
                     buf)
        out.append(buf)
        step = ctx.op("Where", on, buf, step)
    elif buf is not None:
        step = ctx.op("Add", ctx.op("Mul", buf, k.exact(float(momentum), x)), step)
        out.append(step)
    if ga is not None:
        out.append(ga)
    return [ctx.op("Sub", x, ctx.op("Mul", step, lr)), *out]


def _adadelta(ctx: GradContext, k: Scalars, a: Mapping[str, object], lr: ir.Value,
              x: ir.Value, g: ir.Value, states: Sequence[ir.Value]) -> list[ir.Value]:
    """sq = rho sq + (1 - rho) g^2; delta = sqrt(acc + eps) / sqrt(sq + eps) g;
    acc = rho acc + (1 - rho) delta^2; x -= lr delta. New x, sq, acc."""
    rho, eps = float(a.get("ngdist_rho", 0.9)), float(a["epsilon"])
    sq, acc = states
    g = _prelude(ctx, k, a, x, g)
    sq_new = ctx.op("Add", ctx.op("Mul", sq, k.exact(rho, x)),
                    ctx.op("Mul", ctx.op("Mul", g, g), k.exact(1 - rho, x)))
    std = ctx.op("Sqrt", ctx.op("Add", sq_new, k.exact(eps, x)))
    delta = ctx.op("Mul", ctx.op("Div", ctx.op("Sqrt", ctx.op("Add", acc, k.exact(eps, x))),
                                 std), g)
    acc_new = ctx.op("Add", ctx.op("Mul", acc, k.exact(rho, x)),
                     ctx.op("Mul", ctx.op("Mul", delta, delta), k.exact(1 - rho, x)))
    return [ctx.op("Sub", x, ctx.op("Mul", delta, lr)), sq_new, acc_new]


def _keras_rmsprop(ctx: GradContext, k: Scalars, a: Mapping[str, object], lr: ir.Value,
                   x: ir.Value, g: ir.Value, states: Sequence[ir.Value]) -> list[ir.Value]:
    """Keras: sq = rho sq + (1 - rho) g^2; centered: ga = rho ga + (1 - rho) g, den = sq - ga^2
    + eps, else sq + eps; inc = lr g / sqrt(den); momentum: m = momentum m + inc, x -= m; else
    x -= inc. New x, sq (, m) (, ga)."""
    rho, eps = float(a.get("ngdist_alpha", 0.9)), float(a["epsilon"])
    momentum = float(a.get("ngdist_momentum", 0.0))
    sq, *rest = states
    m = rest.pop(0) if momentum else None
    ga = rest.pop(0) if a.get("ngdist_centered", 0) else None
    g = _prelude(ctx, k, a, x, g)
    sq_new = ctx.op("Add", ctx.op("Mul", sq, k.exact(rho, x)),
                    ctx.op("Mul", ctx.op("Mul", g, g), k.exact(1 - rho, x)))
    den = sq_new
    if ga is not None:
        ga = ctx.op("Add", ctx.op("Mul", ga, k.exact(rho, x)),
                    ctx.op("Mul", g, k.exact(1 - rho, x)))
        den = ctx.op("Sub", den, ctx.op("Mul", ga, ga))
    step = ctx.op("Div", ctx.op("Mul", g, lr), ctx.op("Sqrt", ctx.op("Add", den, k.exact(eps, x))))
    out = [sq_new]
    if m is not None:
        step = ctx.op("Add", ctx.op("Mul", m, k.exact(momentum, x)), step)
        out.append(step)
    if ga is not None:
        out.append(ga)
    return [ctx.op("Sub", x, step), *out]


def _keras_adagrad(ctx: GradContext, k: Scalars, a: Mapping[str, object], lr: ir.Value,
                   x: ir.Value, g: ir.Value, states: Sequence[ir.Value]) -> list[ir.Value]:
    """Keras: h += g^2; x -= lr g / sqrt(h + eps) (lr already divided by 1 + T decay)."""
    (h,) = states
    g = _prelude(ctx, k, a, x, g)
    h_new = ctx.op("Add", h, ctx.op("Mul", g, g))
    den = ctx.op("Sqrt", ctx.op("Add", h_new, k.exact(float(a["epsilon"]), x)))
    return [ctx.op("Sub", x, ctx.op("Div", ctx.op("Mul", g, lr), den)), h_new]


_ONE = {RMSPROP: _rmsprop, ADADELTA: _adadelta, KERAS_RMSPROP: _keras_rmsprop,
        KERAS_ADAGRAD: _keras_adagrad}


def lower(ctx: GradContext, formula: str, a: Mapping[str, object], r: ir.Value, t: ir.Value,
          xs: Sequence[ir.Value], gs: Sequence[ir.Value], states: Sequence[Sequence[ir.Value]]
          ) -> tuple[list[ir.Value], list[list[ir.Value]]]:
    """New parameters and new states (one list per state kind) of an RMSprop/Adadelta node."""
    k = Scalars(ctx)
    decay = float(a.get("decay_factor") or 0.0)
    new_x: list[ir.Value] = []
    new_s: list[list[ir.Value]] = [[] for _ in states]
    for i, (x, g) in enumerate(zip(xs, gs)):
        lr = k.cast(r, x)
        if decay:  # lr / (1 + T decay), as ONNX's Adagrad
            lr = k.memo(("decayed_lr",), x, lambda: ctx.op("Div", lr, ctx.op(
                "Add", k.exact(1.0, x), ctx.op("Mul", k.cast(t, x), k.exact(decay, x)))))
        x_new, *state_new = _ONE[formula](ctx, k, a, lr, x, g, [kind[i] for kind in states])
        new_x.append(x_new)
        for j, value in enumerate(state_new):
            new_s[j].append(value)
    return new_x, new_s
