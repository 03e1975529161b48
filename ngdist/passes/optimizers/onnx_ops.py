"""ONNX's own ``Momentum``, ``Adagrad`` and ``Adam`` (ai.onnx.preview.training), as the operator
specification and ``onnx.reference`` define them; ``ngdist_maximize=1`` negates the gradient
first. ``Momentum`` is torch.optim.SGD with beta = 1 - dampening, ``Adagrad`` is
torch.optim.Adagrad (T is torch's step - 1)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext
from ngdist.passes.optimizers.common import Scalars, maximized


def _adam_lr(ctx: GradContext, k: Scalars, tpos: ir.Value, lr: ir.Value, t: ir.Value,
             al: float, be: float, x: ir.Value) -> ir.Value:
    """lr * sqrt(1 - beta^T) / (1 - alpha^T) from the second step on, lr on the first."""
    tf, one = k.cast(t, x), k.const(1.0, x)
    corr = ctx.op("Div", ctx.op("Sqrt", ctx.op("Sub", one, ctx.op("Pow", k.const(be, x), tf))),
                  ctx.op("Sub", one, ctx.op("Pow", k.const(al, x), tf)))
    return ctx.op("Where", tpos, ctx.op("Mul", lr, corr), lr)


def _one(ctx: GradContext, k: Scalars, op_type: str, a: Mapping[str, object], tpos: ir.Value,
         r: ir.Value, t: ir.Value, x: ir.Value, g: ir.Value, states: Sequence[ir.Value]
         ) -> list[ir.Value]:
    lr = k.cast(r, x)
    nc = a.get("norm_coefficient") or 0.0
    g = maximized(ctx, a, g)
    greg = g if nc == 0 else ctx.op("Add", ctx.op("Mul", k.const(nc, x), x), g)  # type: ignore
    if op_type == "Momentum":
        (v,) = states
        scaled = greg
        if a["beta"] != 1.0:  # beta is 1 on the first step (T == 0), beta after
            scaled = ctx.op("Mul", k.where(tpos, a["beta"], 1.0, x), greg)  # type: ignore
        alpha = a["alpha"]  # a float, or the scheduled momentum's value
        v_new = scaled if isinstance(alpha, float) and alpha == 0.0 else \
            ctx.op("Add", ctx.op("Mul", k.hyper(alpha, x), v), scaled)  # type: ignore
        step = v_new if a["mode"] == "standard" else \
            ctx.op("Add", greg, ctx.op("Mul", k.hyper(alpha, x), v_new))  # type: ignore
        if isinstance(alpha, ir.Value):  # torch.optim.SGD: no buffer on a step of momentum 0
            on = k.memo(("momentum_on", alpha.name), x, lambda: k.shape(ctx.op(
                "Greater", alpha, ctx.op("CastLike", ctx.const(0.0), alpha)), x))
            v_new = ctx.op("Where", on, v_new, v)
            step = ctx.op("Where", on, step, greg)
        return [ctx.op("Sub", x, ctx.op("Mul", lr, step)), v_new]
    if op_type == "Adagrad":
        (h,) = states
        r_ = k.memo(("adagrad_lr",), x, lambda: ctx.op("Div", lr, ctx.op(
            "Add", k.const(1.0, x),
            ctx.op("Mul", k.cast(t, x), k.const(a["decay_factor"], x)))))  # type: ignore
        h_new = ctx.op("Add", h, ctx.op("Mul", greg, greg))
        h_sqrt = ctx.op("Add", ctx.op("Sqrt", h_new), k.const(a["epsilon"], x))  # type: ignore
        return [ctx.op("Sub", x, ctx.op("Div", ctx.op("Mul", r_, greg), h_sqrt)), h_new]
    v, h = states  # Adam
    al, be = float(a["alpha"]), float(a["beta"])  # type: ignore[arg-type]
    v_new = ctx.op("Add", ctx.op("Mul", k.const(al, x), v),
                   ctx.op("Mul", k.const(1 - al, x), greg))
    h_new = ctx.op("Add", ctx.op("Mul", k.const(be, x), h),
                   ctx.op("Mul", k.const(1 - be, x), ctx.op("Mul", greg, greg)))
    h_sqrt = ctx.op("Add", ctx.op("Sqrt", h_new), k.const(a["epsilon"], x))  # type: ignore
    r_adj = k.memo(("adam_lr",), x, lambda: _adam_lr(ctx, k, tpos, lr, t, al, be, x))
    x_new = ctx.op("Sub", x, ctx.op("Mul", r_adj, ctx.op("Div", v_new, h_sqrt)))
    post = a.get("norm_coefficient_post") or 0.0
    if post:
        x_new = ctx.op("Mul", k.const(1 - post, x), x_new)  # type: ignore[operator]
    return [x_new, v_new, h_new]


def lower(ctx: GradContext, op_type: str, a: Mapping[str, object], r: ir.Value, t: ir.Value,
          xs: Sequence[ir.Value], gs: Sequence[ir.Value], states: Sequence[Sequence[ir.Value]]
          ) -> tuple[list[ir.Value], list[list[ir.Value]]]:
    """New parameters and new states (one list per state kind) of an ONNX optimizer node."""
    tpos = ctx.op("Greater", t, ctx.const(0, dtype=np.int64))
    k = Scalars(ctx)
    new_x: list[ir.Value] = []
    new_s: list[list[ir.Value]] = [[] for _ in states]
    for i, (x, g) in enumerate(zip(xs, gs)):
        x_new, *state_new = _one(ctx, k, op_type, a, tpos, r, t, x, g,
                                 [kind[i] for kind in states])
        new_x.append(x_new)
        for j, value in enumerate(state_new):
            new_s[j].append(value)
    return new_x, new_s
