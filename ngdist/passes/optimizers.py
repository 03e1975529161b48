"""Lowering of ONNX's ``ai.onnx.preview.training`` optimizer ops to ordinary ops.

An ``Adam`` node with the attribute ``ngdist_formula`` (``ngdist.optim.FORMULA_ATTR``) is lowered
with PyTorch's formula instead of ONNX's: ``"torch_adam"`` is ``torch.optim.Adam`` (epsilon
added after the second-moment bias correction), ``"torch_adamw"`` is ``torch.optim.AdamW``
(``norm_coefficient`` is then the decoupled weight decay, x <- x * (1 - R * norm_coefficient)
before the update). T is the 1-based step count there; T <= 0 applies no bias correction.
``ngdist_amsgrad=1`` (PyTorch formula only) adds a third state group after V and H, the running
maximum of H, which then replaces H in the denominator (``amsgrad=True``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import defs

from ngdist.errors import GraphError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.passes.autodiff.registry import GradContext, attr

logger = logging.getLogger(__name__)

OPTIMIZER_OPS = {"Momentum": 1, "Adagrad": 1, "Adam": 2}  # op -> number of state tensors per x
# the Adam attribute that selects PyTorch's formula, and its values (ngdist.optim.TorchAdam,
# ngdist.optim.AdamW)
FORMULA_ATTR = "ngdist_formula"
TORCH_ADAM, TORCH_ADAMW = "torch_adam", "torch_adamw"
# with the PyTorch formula, AMSGrad (1): a third state per parameter, the running maximum of v
AMSGRAD_ATTR = "ngdist_amsgrad"


_ATTR_KINDS = {defs.OpSchema.AttrType.FLOAT: ((float, int), "a float"),
               defs.OpSchema.AttrType.INT: ((int,), "an int"),
               defs.OpSchema.AttrType.STRING: ((str,), "a string")}


def _attrs(node: ir.Node) -> dict[str, object]:
    """The node's attributes by the operator's schema, defaults filled in; a required one
    that is missing or one of the wrong kind is a GraphError naming the node."""
    schema = defs.get_schema(node.op_type, 1, PREVIEW_TRAINING)
    out: dict[str, object] = {}
    for name, a in schema.attributes.items():
        value = attr(node, name, onnx_default(a))
        kinds, what = _ATTR_KINDS.get(a.type, ((object,), ""))
        if value is None and a.required:
            raise GraphError(f"optimizer node {node.name!r} ({node.op_type}) lacks its required "
                             f"attribute {name!r}; ai.onnx.preview.training.{node.op_type} "
                             f"needs {sorted(n for n, s in schema.attributes.items() if s.required)}")
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise GraphError(f"optimizer node {node.name!r} ({node.op_type}): attribute "
                             f"{name!r} is {value!r}, not {what}")
        out[name] = value
    if node.op_type == "Momentum" and out["mode"] not in ("standard", "nesterov"):
        raise GraphError(f"optimizer node {node.name!r} (Momentum): mode is {out['mode']!r}; "
                         "the modes are 'standard' and 'nesterov'")
    return out


def onnx_default(a: defs.OpSchema.Attribute) -> object:
    d = a.default_value
    if d is None or not d.name:
        return None
    return onnx.helper.get_attribute_value(d)


def num_states(node: ir.Node) -> int:
    """State tensors per parameter of an optimizer node (AMSGrad adds one to Adam's two)."""
    return OPTIMIZER_OPS[node.op_type] + (1 if attr(node, AMSGRAD_ATTR, 0) else 0)


def split_optimizer_inputs(node: ir.Node) -> tuple[ir.Value, ir.Value, list[list[ir.Value]]]:
    """(R, T, [xs, gs, state_1s, ...]) of an optimizer node."""
    r, t, rest = node.inputs[0], node.inputs[1], list(node.inputs[2:])
    groups = 2 + num_states(node)
    n = len(rest) // groups
    return r, t, [rest[i * n:(i + 1) * n] for i in range(groups)]


class _Scalars:
    """Scalars of the update, emitted once per (value, element type, rank) and shaped like the
    tensors they scale: onnxruntime's Mul of a rank-0 scalar by a tensor whose last dimension
    is 1 is several times slower than with the scalar reshaped to the tensor's rank (1024 x 1:
    13 vs 4 us), and one node per parameter for each constant is pure dispatch cost."""

    def __init__(self, ctx: GradContext) -> None:
        self.ctx = ctx
        self._cache: dict[tuple, ir.Value] = {}

    @staticmethod
    def _key(x: ir.Value) -> tuple[object, int | None]:
        rank = x.shape.rank() if x.shape is not None else None
        return (x.dtype, rank) if x.dtype is not None else (x.name, rank)

    def _shape(self, v: ir.Value, x: ir.Value) -> ir.Value:
        rank = self._key(x)[1]
        if rank is None:  # unknown rank: a rank-0 scalar broadcasts to anything
            return self.ctx.op("Reshape", v, self.ctx.ints([]))
        return self.ctx.op("Reshape", v, self.ctx.ints([1] * rank))

    def const(self, value: float, x: ir.Value) -> ir.Value:
        key = ("const", float(value), *self._key(x))
        if key not in self._cache:
            rank = self._key(x)[1]
            shape = [1] * rank if rank is not None else []
            if x.dtype is not None:  # float32 first: the values CastLike of a float32 gave
                arr = np.full(shape, value, np.float32).astype(x.dtype.numpy())
                self._cache[key] = self.ctx.op("Constant", value=ir.tensor(arr))
            else:
                self._cache[key] = self.ctx.const(np.full(shape, value, np.float32), like=x)
        return self._cache[key]

    def cast(self, v: ir.Value, x: ir.Value) -> ir.Value:
        """Graph scalar ``v`` (the learning rate, the step count) in x's type and rank."""
        key = ("cast", v.name, *self._key(x))
        if key not in self._cache:
            self._cache[key] = self._shape(self.ctx.op("CastLike", v, x), x)
        return self._cache[key]

    def where(self, cond: ir.Value, a: float, b: float, x: ir.Value) -> ir.Value:
        return self.memo(("where", cond.name, float(a), float(b)), x,
                         lambda: self.ctx.op("Where", cond, self.const(a, x), self.const(b, x)))

    def memo(self, what: tuple, x: ir.Value, build: Callable[[], ir.Value]) -> ir.Value:
        """A scalar expression that depends on x only through its type and rank."""
        key = (*what, *self._key(x))
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def _adam_lr(ctx: GradContext, k: _Scalars, tpos: ir.Value, lr: ir.Value, t: ir.Value,
             al: float, be: float, x: ir.Value) -> ir.Value:
    """lr * sqrt(1 - beta^T) / (1 - alpha^T) from the second step on, lr on the first."""
    tf, one = k.cast(t, x), k.const(1.0, x)
    corr = ctx.op("Div", ctx.op("Sqrt", ctx.op("Sub", one, ctx.op("Pow", k.const(be, x), tf))),
                  ctx.op("Sub", one, ctx.op("Pow", k.const(al, x), tf)))
    return ctx.op("Where", tpos, ctx.op("Mul", lr, corr), lr)


def _decimal(value: object) -> float:
    """A float attribute as the decimal it was written as: ONNX stores attributes as float32,
    and 1 - float32(0.999) is 1.3e-5 off PyTorch's 1 - 0.999 (its betas are Python floats)."""
    return float(str(np.float32(value)))  # the shortest decimal that rounds to it


def _torch_adam_scalars(ctx: GradContext, tpos: ir.Value, r: ir.Value, t: ir.Value,
                        al: float, be: float, decay: float) -> dict[str, ir.Value]:
    """PyTorch's per-step Adam scalars, rank 0 and computed in float64 as torch computes them
    in Python: lr / (1 - beta1^T), sqrt(1 - beta2^T) (lr and 1 for T <= 0) and the decoupled
    decay factor 1 - lr * ``decay`` (only when ``decay`` is not 0)."""
    double = int(ir.DataType.DOUBLE)

    def f64(v: float) -> ir.Value:
        return ctx.op("Constant", value=ir.tensor(np.array(v, np.float64)))

    one, td, rd = f64(1.0), ctx.op("Cast", t, to=double), ctx.op("Cast", r, to=double)
    bc1 = ctx.op("Where", tpos, ctx.op("Sub", one, ctx.op("Pow", f64(al), td)), one)
    bc2_sqrt = ctx.op("Where", tpos,
                      ctx.op("Sqrt", ctx.op("Sub", one, ctx.op("Pow", f64(be), td))), one)
    out = {"step_size": ctx.op("Div", rd, bc1), "bc2_sqrt": bc2_sqrt}
    if decay:
        out["decay"] = ctx.op("Sub", one, ctx.op("Mul", rd, f64(decay)))
    return out


def _torch_adam_one(ctx: GradContext, k: _Scalars, scalars: dict[str, ir.Value],
                    a: dict[str, object], decoupled: bool, x: ir.Value, g: ir.Value,
                    m: ir.Value, v: ir.Value, v_max: ir.Value | None
                    ) -> tuple[ir.Value, ...]:
    """torch.optim.Adam / AdamW (single-tensor path) on one parameter: new x, m, v (and v_max
    with AMSGrad).

    The ops form chains that the runtime writes in place (runtime/inplace.py): every value is
    read last by a descendant of its other readers, so the gradient's memory is free once
    (1 - beta1) g and then g^2 are made, the first moment takes m's memory, the second moment
    v's, and the denominator and the step reuse the gradient's. m is b1 m + (1 - b1) g and
    v is b2 v + (1 - b2) / (1 - b1) ((1 - b1) g) g: PyTorch's values up to float rounding.
    """

    like = x  # the parameter: its rank shapes the scalars (the decayed x has no shape)

    def scalar(name: str) -> ir.Value:
        return k.memo(("torch_adam", name), like,
                      lambda: k._shape(ctx.op("CastLike", scalars[name], like), like))

    al, be = _decimal(a["alpha"]), _decimal(a["beta"])
    wd = float(a.get("norm_coefficient") or 0.0)  # type: ignore[arg-type]
    if wd and decoupled:  # param.mul_(1 - lr * weight_decay)
        x = ctx.op("Mul", x, scalar("decay"))
    elif wd:  # grad = grad.add(param, alpha=weight_decay)
        g = ctx.op("Add", g, ctx.op("Mul", k.const(wd, like), x))
    g1 = ctx.op("Mul", g, k.const(1 - al, like))  # (1 - b1) g
    m_new = ctx.op("Add", ctx.op("Mul", m, k.const(al, like)), g1)
    g2 = ctx.op("Mul", ctx.op("Mul", g1, g), k.const((1 - be) / (1 - al), like)) if al != 1 \
        else ctx.op("Mul", ctx.op("Mul", g, g), k.const(1 - be, like))  # (1 - b2) g^2
    v_new = ctx.op("Add", ctx.op("Mul", v, k.const(be, like)), g2)
    v_max_new = None if v_max is None else ctx.op("Max", v_max, v_new)
    second = v_new if v_max_new is None else v_max_new
    denom = ctx.op("Add", ctx.op("Div", ctx.op("Sqrt", second), scalar("bc2_sqrt")),
                   k.const(float(a["epsilon"]), like))  # type: ignore[arg-type]
    x_new = ctx.op("Sub", x, ctx.op("Mul", ctx.op("Div", m_new, denom), scalar("step_size")))
    return (x_new, m_new, v_new) if v_max_new is None else (x_new, m_new, v_new, v_max_new)


def _lower_one(ctx: GradContext, node: ir.Node) -> list[ir.Value]:
    a = _attrs(node)
    formula = attr(node, FORMULA_ATTR, None)
    if formula is not None and (node.op_type != "Adam" or
                                formula not in (TORCH_ADAM, TORCH_ADAMW)):
        raise GraphError(f"optimizer node {node.name!r}: {FORMULA_ATTR}={formula!r} is not "
                         f"one of {TORCH_ADAM!r}, {TORCH_ADAMW!r} on an Adam node")
    if attr(node, AMSGRAD_ATTR, 0) and formula is None:
        raise GraphError(f"optimizer node {node.name!r}: {AMSGRAD_ATTR} needs "
                         f"{FORMULA_ATTR} (AMSGrad is implemented with PyTorch's formula)")
    r, t, groups = split_optimizer_inputs(node)
    xs, gs, states = groups[0], groups[1], groups[2:]
    tpos = ctx.op("Greater", t, ctx.const(0, dtype=np.int64))
    k = _Scalars(ctx)
    new_x, new_s = [], [[] for _ in states]
    torch_scalars = None if formula is None else _torch_adam_scalars(
        ctx, tpos, r, t, _decimal(a["alpha"]), _decimal(a["beta"]),
        (a.get("norm_coefficient") or 0.0) if formula == TORCH_ADAMW else 0.0)
    for i, (x, g) in enumerate(zip(xs, gs)):
        if torch_scalars is not None:
            v, h, *h_max = (s[i] for s in states)
            x_new, *state_new = _torch_adam_one(ctx, k, torch_scalars, a,
                                                formula == TORCH_ADAMW, x, g, v, h,
                                                h_max[0] if h_max else None)
            post = a.get("norm_coefficient_post") or 0.0
            if post:
                x_new = ctx.op("Mul", k.const(1 - post, x), x_new)
            new_x.append(x_new)
            for j, value in enumerate(state_new):
                new_s[j].append(value)
            continue
        lr = k.cast(r, x)
        nc = a.get("norm_coefficient") or 0.0
        greg = g if nc == 0 else ctx.op("Add", ctx.op("Mul", k.const(nc, x), x), g)
        if node.op_type == "Momentum":
            (v,) = (s[i] for s in states)
            scaled = greg
            if a["beta"] != 1.0:  # beta is 1 on the first step (T == 0), beta after
                scaled = ctx.op("Mul", k.where(tpos, a["beta"], 1.0, x), greg)
            v_new = scaled if a["alpha"] == 0.0 else \
                ctx.op("Add", ctx.op("Mul", k.const(a["alpha"], x), v), scaled)
            step = v_new if a["mode"] == "standard" else \
                ctx.op("Add", greg, ctx.op("Mul", k.const(a["alpha"], x), v_new))
            new_x.append(ctx.op("Sub", x, ctx.op("Mul", lr, step)))
            new_s[0].append(v_new)
        elif node.op_type == "Adagrad":
            (h,) = (s[i] for s in states)
            r_ = k.memo(("adagrad_lr",), x, lambda: ctx.op("Div", lr, ctx.op(
                "Add", k.const(1.0, x),
                ctx.op("Mul", k.cast(t, x), k.const(a["decay_factor"], x)))))
            h_new = ctx.op("Add", h, ctx.op("Mul", greg, greg))
            h_sqrt = ctx.op("Add", ctx.op("Sqrt", h_new), k.const(a["epsilon"], x))
            new_x.append(ctx.op("Sub", x, ctx.op("Div", ctx.op("Mul", r_, greg), h_sqrt)))
            new_s[0].append(h_new)
        else:  # Adam
            v, h = (s[i] for s in states)
            al, be = a["alpha"], a["beta"]
            v_new = ctx.op("Add", ctx.op("Mul", k.const(al, x), v),
                           ctx.op("Mul", k.const(1 - al, x), greg))
            h_new = ctx.op("Add", ctx.op("Mul", k.const(be, x), h),
                           ctx.op("Mul", k.const(1 - be, x), ctx.op("Mul", greg, greg)))
            h_sqrt = ctx.op("Add", ctx.op("Sqrt", h_new), k.const(a["epsilon"], x))
            r_adj = k.memo(("adam_lr",), x, lambda: _adam_lr(ctx, k, tpos, lr, t, al, be, x))
            x_new = ctx.op("Sub", x, ctx.op("Mul", r_adj, ctx.op("Div", v_new, h_sqrt)))
            post = a.get("norm_coefficient_post") or 0.0
            if post:
                x_new = ctx.op("Mul", k.const(1 - post, x), x_new)
            new_x.append(x_new)
            new_s[0].append(v_new)
            new_s[1].append(h_new)
    return new_x + [v for s in new_s for v in s]


class OptimizerLoweringPass(ir.passes.InPlacePass):
    """Rewrites ``Momentum``, ``Adagrad`` and ``Adam`` (ai.onnx.preview.training) as ordinary ops.

    The numerics are those of the ONNX operator specification (and ``onnx.reference``), or
    PyTorch's for an Adam node marked with ``ngdist_formula`` (see the module docstring). Output
    names are kept, so ``update_binding`` still points at the new parameters and states.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = model.opset_imports.get("", 18)
        nodes = [n for n in graph if n.domain == PREVIEW_TRAINING and n.op_type in OPTIMIZER_OPS]
        for node in nodes:
            ctx = GradContext(graph, node, opset)
            ctx.current = node
            outs = _lower_one(ctx, node)
            for old, new in zip(node.outputs, outs):
                name = old.name
                if new.is_graph_input() or new.is_initializer():
                    new = ctx.op("Identity", new)
                new.shape, new.type = old.shape, old.type
                old.replace_all_uses_with(new, replace_graph_outputs=True)
                old.name = f"{name}.replaced"
                new.name = name
            graph.remove(node, safe=True)
        if nodes and not any(n.domain == PREVIEW_TRAINING for n in graph):
            model.opset_imports.pop(PREVIEW_TRAINING, None)
            graph.opset_imports.pop(PREVIEW_TRAINING, None)
        return ir.passes.PassResult(model, bool(nodes))
