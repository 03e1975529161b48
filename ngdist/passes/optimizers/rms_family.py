"""PyTorch's ``torch.optim.RMSprop`` and ``Adadelta`` on an ONNX ``Adagrad`` node
(``ngdist_formula``), single-tensor path, formula for formula.

Attributes: epsilon is eps, norm_coefficient the (L2) weight decay; RMSprop's smoothing
constant is ``ngdist_alpha``, its momentum ``ngdist_momentum`` and ``ngdist_centered=1``
subtracts the squared running mean of the gradient; Adadelta's decay is ``ngdist_rho``.
R is the learning rate; T is not read.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext
from ngdist.passes.optimizers.common import ADADELTA, RMSPROP, Scalars, decimal, maximized


def _prelude(ctx: GradContext, k: Scalars, a: Mapping[str, object], x: ir.Value,
             g: ir.Value) -> ir.Value:
    """The gradient after maximize and L2 weight decay."""
    g = maximized(ctx, a, g)
    wd = decimal(a.get("norm_coefficient") or 0.0)
    return ctx.op("Add", g, ctx.op("Mul", k.exact(wd, x), x)) if wd else g


def _rmsprop(ctx: GradContext, k: Scalars, a: Mapping[str, object], lr: ir.Value, x: ir.Value,
             g: ir.Value, states: Sequence[ir.Value]) -> list[ir.Value]:
    """sq = alpha sq + (1 - alpha) g^2; centered: ga.lerp_(g, 1 - alpha), avg = sqrt(sq - ga^2),
    else sqrt(sq); avg += eps; momentum: buf = momentum buf + g / avg, x -= lr buf; else
    x -= lr g / avg. New x, sq (, buf) (, ga)."""
    alpha, eps = decimal(a.get("ngdist_alpha", 0.99)), decimal(a["epsilon"])
    momentum = decimal(a.get("ngdist_momentum", 0.0))
    centered = bool(a.get("ngdist_centered", 0))
    sq, *rest = states
    buf = rest.pop(0) if momentum else None
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
    if buf is not None:
        step = ctx.op("Add", ctx.op("Mul", buf, k.exact(momentum, x)), step)
        out.append(step)
    if ga is not None:
        out.append(ga)
    return [ctx.op("Sub", x, ctx.op("Mul", step, lr)), *out]


def _adadelta(ctx: GradContext, k: Scalars, a: Mapping[str, object], lr: ir.Value,
              x: ir.Value, g: ir.Value, states: Sequence[ir.Value]) -> list[ir.Value]:
    """sq = rho sq + (1 - rho) g^2; delta = sqrt(acc + eps) / sqrt(sq + eps) g;
    acc = rho acc + (1 - rho) delta^2; x -= lr delta. New x, sq, acc."""
    rho, eps = decimal(a.get("ngdist_rho", 0.9)), decimal(a["epsilon"])
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


_ONE = {RMSPROP: _rmsprop, ADADELTA: _adadelta}


def lower(ctx: GradContext, formula: str, a: Mapping[str, object], r: ir.Value, t: ir.Value,
          xs: Sequence[ir.Value], gs: Sequence[ir.Value], states: Sequence[Sequence[ir.Value]]
          ) -> tuple[list[ir.Value], list[list[ir.Value]]]:
    """New parameters and new states (one list per state kind) of an RMSprop/Adadelta node."""
    del t  # neither formula reads the step count
    k = Scalars(ctx)
    new_x: list[ir.Value] = []
    new_s: list[list[ir.Value]] = [[] for _ in states]
    for i, (x, g) in enumerate(zip(xs, gs)):
        x_new, *state_new = _ONE[formula](ctx, k, a, k.cast(r, x), x, g,
                                          [kind[i] for kind in states])
        new_x.append(x_new)
        for j, value in enumerate(state_new):
            new_s[j].append(value)
    return new_x, new_s
