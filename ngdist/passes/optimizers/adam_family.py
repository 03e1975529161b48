"""PyTorch's Adam family on an ONNX ``Adam`` node (``ngdist_formula``): ``torch.optim.Adam``,
``AdamW``, ``Adamax``, ``NAdam`` and ``RAdam``, single-tensor path, formula for formula.

T is torch's 1-based step count. The scalars torch computes in Python floats from the
learning rate and the step (bias corrections, NAdam's momentum schedule, RAdam's rectification)
are computed once per node in float64 and cast to each parameter's type. Attributes: alpha and
beta are beta1 and beta2, epsilon is eps, norm_coefficient the weight decay (decoupled, as in
AdamW, for ``torch_adamw`` and for NAdam/RAdam with ``ngdist_decoupled=1``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext
from ngdist.passes.optimizers.common import (ADAMAX, DECOUPLED_ATTR, KERAS_ADAMAX,
                                             KERAS_ADAMW, MU_PRODUCT, NADAM,
                                             RADAM, TORCH_ADAM, TORCH_ADAMW, Float64, Scalars,
                                             maximized, scalar_like)

Values = dict[str, ir.Value]


def _hyper(a: Mapping[str, object]) -> tuple[Any, float, float, float]:
    """beta1, beta2, eps, weight decay as the user gave them (``node_attrs``; beta1: the graph
    value of a scheduled one)."""
    b1 = a["alpha"] if isinstance(a["alpha"], ir.Value) else float(a["alpha"])  # type: ignore
    return (b1, float(a["beta"]), float(a["epsilon"]),  # type: ignore[arg-type]
            float(a.get("norm_coefficient") or 0.0))  # type: ignore[arg-type]


def _decoupled(formula: str, a: Mapping[str, object]) -> bool:
    # (a keras_adamw node's norm_coefficient: Keras' decay as files before
    # ngdist_keras_weight_decay held it)
    return formula in (TORCH_ADAMW, KERAS_ADAMW) or bool(a.get(DECOUPLED_ATTR))


def _scalars(f: Float64, formula: str, a: Mapping[str, object]) -> Values:
    b1, b2, _, wd = _hyper(a)
    one = f.c(1.0)
    out: Values = {}
    if wd and _decoupled(formula, a):  # param.mul_(1 - lr * weight_decay)
        out["decay"] = f.op("Sub", one, f.op("Mul", f.lr, f.c(wd)))
    bc1, bc2 = f.one_minus_pow(b1, f.t), f.one_minus_pow(b2, f.t)
    if isinstance(b1, ir.Value):  # scheduled: m = b1 m + (1 - b1) g from this step's b1
        out["b1"] = f.scalar(b1)
        out["one_minus_b1"] = f.op("Sub", one, out["b1"])
        out["v_coef"] = f.op("Div", f.c(1 - b2), out["one_minus_b1"])
    if formula in (TORCH_ADAM, TORCH_ADAMW):
        tpos = f.op("Greater", f.t, f.c(0.0))  # T <= 0: no bias correction
        out["step_size"] = f.op("Div", f.lr, f.op("Where", tpos, bc1, one))
        out["bc2_sqrt"] = f.op("Where", tpos, f.op("Sqrt", bc2), one)
    elif formula in (ADAMAX, KERAS_ADAMAX):
        out["clr"] = f.op("Div", f.lr, bc1)
    elif formula == KERAS_ADAMW:  # alpha = lr * sqrt(1 - b2^t) / (1 - b1^t)
        out["alpha"] = f.op("Div", f.op("Mul", f.lr, f.op("Sqrt", bc2)), bc1)
    elif formula == NADAM:
        decay = float(a.get("ngdist_momentum_decay", 4e-3))  # type: ignore[arg-type]
        out.update(_nadam_scalars(f, b1, decay, bc2, a.get(MU_PRODUCT)))  # type: ignore
    else:  # RADAM
        out.update(_radam_scalars(f, b2, bc1, bc2))
    return out


def _nadam_mu(f: Float64, b1: float | ir.Value, decay: float, step: ir.Value) -> ir.Value:
    """beta1 * (1 - 0.5 * 0.96^(step * momentum_decay)), elementwise over ``step``."""
    return f.op("Mul", f.scalar(b1), f.op("Sub", f.c(1.0), f.op("Mul", f.c(0.5), f.op(
        "Pow", f.c(0.96), f.op("Mul", step, f.c(decay))))))


def _nadam_product(f: Float64, b1: float, decay: float) -> ir.Value:
    """mu_1 ... mu_t of a constant beta1, taken over the first min(t, cap) steps: mu_i <= beta1,
    so past ``cap`` it is below 2^-60 and 1 - it is 1 in float64 (torch's own running product
    ends in the same 1)."""
    last = f.t
    if 0.0 <= b1 < 1.0:
        cap = 1 if b1 == 0.0 else math.ceil(-60 * math.log(2) / math.log(b1))
        last = f.op("Min", f.t, f.c(float(cap)))
    steps = f.op("Range", f.c(1.0), f.op("Add", last, f.c(1.0)), f.c(1.0))
    return f.ctx.op("ReduceProd", _nadam_mu(f, b1, decay, steps), keepdims=0)


def _nadam_scalars(f: Float64, b1: float | ir.Value, decay: float, bc2: ir.Value,
                   product: ir.Value | None) -> Values:
    """torch's mu, mu_next (both from this step's beta1) and mu_product = mu_1 ... mu_t: the
    node's input ``MU_PRODUCT`` when beta1 is scheduled, else computed from the step."""
    mu = _nadam_mu(f, b1, decay, f.t)
    mu_next = _nadam_mu(f, b1, decay, f.op("Add", f.t, f.c(1.0)))
    if product is None:
        product = _nadam_product(f, b1, decay)  # type: ignore[arg-type]
    else:
        product = f.scalar(product)
    one, neg_lr = f.c(1.0), f.op("Neg", f.lr)
    return {"bc2": bc2,
            "grad_coef": f.op("Div", f.op("Mul", neg_lr, f.op("Sub", one, mu)),
                              f.op("Sub", one, product)),
            "avg_coef": f.op("Div", f.op("Mul", neg_lr, mu_next),
                             f.op("Sub", one, f.op("Mul", product, mu_next)))}


def _radam_scalars(f: Float64, b2: float, bc1: ir.Value, bc2: ir.Value) -> Values:
    """rho_t > 5: x -= lr / bc1 * sqrt(bc2) * rect * m / (sqrt(v) + eps); else x -= lr / bc1 *
    m ("adaptive" is the first factor, "plain" the second; the other one is 0)."""
    rho_inf = 2 / (1 - b2) - 1
    rho_t = f.op("Sub", f.c(rho_inf), f.op("Div", f.op("Mul", f.op("Mul", f.c(2.0), f.t), f.op(
        "Pow", f.c(b2), f.t)), bc2))
    rect = f.op("Sqrt", f.op("Div", f.op("Mul", f.op("Mul", f.op("Sub", rho_t, f.c(4.0)), f.op(
        "Sub", rho_t, f.c(2.0))), f.c(rho_inf)), f.op("Mul", f.c((rho_inf - 4) * (rho_inf - 2)),
                                                       rho_t)))
    rectified = f.op("Greater", rho_t, f.c(5.0))
    step = f.op("Div", f.lr, bc1)
    zero = f.c(0.0)
    return {"rectified": rectified,
            "adaptive": f.op("Where", rectified, f.op("Mul", f.op("Mul", step, f.op(
                "Sqrt", bc2)), rect), zero),
            "plain": f.op("Where", rectified, zero, step)}


class _Param:
    """One parameter's update: its scalars in its type and rank, the shared prelude."""

    def __init__(self, ctx: GradContext, k: Scalars, s: Values, x: ir.Value) -> None:
        self.ctx, self.k, self.s, self.like = ctx, k, s, x

    def scalar(self, name: str) -> ir.Value:
        return scalar_like(self.k, name, self.s, self.like)

    def c(self, value: float) -> ir.Value:
        return self.k.exact(value, self.like)

    def op(self, op_type: str, *inputs: ir.Value) -> ir.Value:
        return self.ctx.op(op_type, *inputs)

    def prelude(self, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value
                ) -> tuple[ir.Value, ir.Value]:
        """(x, g) after maximize and weight decay (decoupled: x scaled, else L2 into g)."""
        g = maximized(self.ctx, a, g)
        wd = _hyper(a)[3]
        if wd and _decoupled(formula, a):
            x = self.op("Mul", x, self.scalar("decay"))
        elif wd:  # grad = grad.add(param, alpha=weight_decay)
            g = self.op("Add", g, self.op("Mul", self.c(wd), x))
        return x, g

    def lerp(self, m: ir.Value, g: ir.Value, w: float) -> ir.Value:
        """m.lerp_(g, w) = m + w (g - m)."""
        return self.op("Add", m, self.op("Mul", self.op("Sub", g, m), self.c(w)))

    def first_moment(self, m: ir.Value, g: ir.Value, b1: float | ir.Value) -> ir.Value:
        """m.lerp_(g, 1 - b1), b1 this step's (a scheduled one: its graph value)."""
        if not isinstance(b1, ir.Value):
            return self.lerp(m, g, 1 - b1)
        return self.op("Add", m, self.op("Mul", self.op("Sub", g, m),
                                         self.scalar("one_minus_b1")))

    def second_moment(self, v: ir.Value, g: ir.Value, b2: float) -> ir.Value:
        """v * b2 + (1 - b2) g^2."""
        return self.op("Add", self.op("Mul", v, self.c(b2)),
                       self.op("Mul", self.op("Mul", g, g), self.c(1 - b2)))


def _torch_adam(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
                states: Sequence[ir.Value]) -> list[ir.Value]:
    """torch.optim.Adam / AdamW on one parameter: new x, m, v (and v_max with AMSGrad).

    The ops form chains that the runtime writes in place (runtime/inplace.py): every value is
    read last by a descendant of its other readers, so the gradient's memory is free once
    (1 - beta1) g and then g^2 are made, the first moment takes m's memory, the second moment
    v's, and the denominator and the step reuse the gradient's. m is b1 m + (1 - b1) g and
    v is b2 v + (1 - b2) / (1 - b1) ((1 - b1) g) g: PyTorch's values up to float rounding.
    """
    k, like, ctx = p.k, p.like, p.ctx
    m, v, *v_max = states
    al, be, eps, _ = _hyper(a)
    x, g = p.prelude(formula, a, x, g)
    if isinstance(al, ir.Value):  # a scheduled beta1
        g1 = ctx.op("Mul", g, p.scalar("one_minus_b1"))
        m_new = ctx.op("Add", ctx.op("Mul", m, p.scalar("b1")), g1)
        g2 = ctx.op("Mul", ctx.op("Mul", g1, g), p.scalar("v_coef"))
    else:
        g1 = ctx.op("Mul", g, k.const(1 - al, like))  # (1 - b1) g
        m_new = ctx.op("Add", ctx.op("Mul", m, k.const(al, like)), g1)
        g2 = ctx.op("Mul", ctx.op("Mul", g1, g), k.const((1 - be) / (1 - al), like)) \
            if al != 1 else ctx.op("Mul", ctx.op("Mul", g, g), k.const(1 - be, like))
    v_new = ctx.op("Add", ctx.op("Mul", v, k.const(be, like)), g2)
    v_max_new = [ctx.op("Max", v_max[0], v_new)] if v_max else []
    second = v_max_new[0] if v_max_new else v_new
    denom = ctx.op("Add", ctx.op("Div", ctx.op("Sqrt", second), p.scalar("bc2_sqrt")),
                   k.const(eps, like))
    x_new = ctx.op("Sub", x, ctx.op("Mul", ctx.op("Div", m_new, denom), p.scalar("step_size")))
    return [x_new, m_new, v_new, *v_max_new]


def _adamax(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
            states: Sequence[ir.Value]) -> list[ir.Value]:
    """m.lerp_(g, 1 - b1); u = max(b2 u, |g| + eps); x -= lr / (1 - b1^t) * m / u."""
    m, u = states
    b1, b2, eps, _ = _hyper(a)
    x, g = p.prelude(formula, a, x, g)
    m_new = p.first_moment(m, g, b1)
    u_new = p.op("Max", p.op("Mul", u, p.c(b2)), p.op("Add", p.op("Abs", g), p.c(eps)))
    x_new = p.op("Sub", x, p.op("Mul", p.op("Div", m_new, u_new), p.scalar("clr")))
    return [x_new, m_new, u_new]


def _keras_adamax(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
                  states: Sequence[ir.Value]) -> list[ir.Value]:
    """Keras: m += (g - m)(1 - b1); u = max(b2 u, |g|); x -= lr / (1 - b1^t) * m / (u + eps)."""
    m, u = states
    b1, b2, eps, _ = _hyper(a)
    x, g = p.prelude(formula, a, x, g)
    m_new = p.lerp(m, g, 1 - b1)
    u_new = p.op("Max", p.op("Mul", u, p.c(b2)), p.op("Abs", g))
    x_new = p.op("Sub", x, p.op("Mul", p.op("Div", m_new, p.op("Add", u_new, p.c(eps))),
                                p.scalar("clr")))
    return [x_new, m_new, u_new]


def _keras_adamw(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
                 states: Sequence[ir.Value]) -> list[ir.Value]:
    """Keras' AdamW: x *= 1 - lr wd (decoupled, before the update); m += (g - m)(1 - b1);
    v += (g^2 - v)(1 - b2); x -= m alpha / (sqrt(v) + eps)."""
    m, v = states
    b1, b2, eps, _ = _hyper(a)
    x, g = p.prelude(formula, a, x, g)
    m_new = p.lerp(m, g, 1 - b1)
    v_new = p.lerp(v, p.op("Mul", g, g), 1 - b2)
    x_new = p.op("Sub", x, p.op("Div", p.op("Mul", m_new, p.scalar("alpha")),
                                p.op("Add", p.op("Sqrt", v_new), p.c(eps))))
    return [x_new, m_new, v_new]


def _moments(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
             states: Sequence[ir.Value]) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value, float]:
    """NAdam's and RAdam's common start: the prelude (decay, maximize), then torch's moments
    m = lerp(m, g, 1 - b1) and v = b2 v + (1 - b2) g^2. Returns (x, g, m, v, eps)."""
    m, v = states
    b1, b2, eps, _ = _hyper(a)
    x, g = p.prelude(formula, a, x, g)
    return x, g, p.first_moment(m, g, b1), p.second_moment(v, g, b2), eps


def _nadam(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
           states: Sequence[ir.Value]) -> list[ir.Value]:
    """denom = sqrt(v / (1 - b2^t)) + eps; x += grad_coef g / denom + avg_coef m / denom."""
    x, g, m_new, v_new, eps = _moments(p, formula, a, x, g, states)
    denom = p.op("Add", p.op("Sqrt", p.op("Div", v_new, p.scalar("bc2"))), p.c(eps))
    x_new = p.op("Add", p.op("Add", x, p.op("Mul", p.op("Div", g, denom),
                                             p.scalar("grad_coef"))),
                 p.op("Mul", p.op("Div", m_new, denom), p.scalar("avg_coef")))
    return [x_new, m_new, v_new]


def _radam(p: _Param, formula: str, a: Mapping[str, object], x: ir.Value, g: ir.Value,
           states: Sequence[ir.Value]) -> list[ir.Value]:
    """x -= m * (adaptive / (sqrt(v) + eps)) when rectified, else x -= m * plain."""
    x, g, m_new, v_new, eps = _moments(p, formula, a, x, g, states)
    cond = p.k.memo(("radam_cond", id(p.s)), p.like, lambda: p.k.shape(p.s["rectified"], p.like))
    factor = p.op("Where", cond, p.op("Div", p.scalar("adaptive"),
                                      p.op("Add", p.op("Sqrt", v_new), p.c(eps))),
                  p.scalar("plain"))
    return [p.op("Sub", x, p.op("Mul", m_new, factor)), m_new, v_new]


_ONE: dict[str, Callable[..., list[ir.Value]]] = {
    TORCH_ADAM: _torch_adam, TORCH_ADAMW: _torch_adam, ADAMAX: _adamax, NADAM: _nadam,
    RADAM: _radam, KERAS_ADAMAX: _keras_adamax, KERAS_ADAMW: _keras_adamw}


def lower(ctx: GradContext, formula: str, a: Mapping[str, object], r: ir.Value, t: ir.Value,
          xs: Sequence[ir.Value], gs: Sequence[ir.Value], states: Sequence[Sequence[ir.Value]]
          ) -> tuple[list[ir.Value], list[list[ir.Value]]]:
    """New parameters and new states (one list per state kind) of an Adam-family node."""
    s = _scalars(Float64(ctx, r, t), formula, a)
    k = Scalars(ctx)
    new_x: list[ir.Value] = []
    new_s: list[list[ir.Value]] = [[] for _ in states]
    for i, (x, g) in enumerate(zip(xs, gs)):
        x_new, *state_new = _ONE[formula](_Param(ctx, k, s, x), formula, a, x, g,
                                          [kind[i] for kind in states])
        post = a.get("norm_coefficient_post") or 0.0
        if post:
            x_new = ctx.op("Mul", k.const(1 - post, x), x_new)  # type: ignore[operator]
        new_x.append(x_new)
        for j, value in enumerate(state_new):
            new_s[j].append(value)
    return new_x, new_s
