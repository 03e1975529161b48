"""What every optimizer lowering shares: the node's layout, its attributes, its scalars.

An optimizer node is one of ONNX's ``ai.onnx.preview.training`` ``Momentum``, ``Adagrad`` and
``Adam`` (inputs R, T, the parameters, their gradients, then one group of states per state
kind). ``ngdist_formula`` on a node selects another formula with that layout
(``FORMULAS``); ``STATE_KINDS`` says which states it has, ``ngdist_maximize=1`` negates the
gradient first (torch's ``maximize=True``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import defs

from ngdist.errors import GraphError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.passes.autodiff.registry import GradContext, attr

OPTIMIZER_OPS = {"Momentum": 1, "Adagrad": 1, "Adam": 2}  # op -> ONNX's state tensors per x
# the attribute that selects a formula other than ONNX's, and its values
FORMULA_ATTR = "ngdist_formula"
TORCH_ADAM, TORCH_ADAMW = "torch_adam", "torch_adamw"
RMSPROP, ADADELTA = "rmsprop", "adadelta"  # on an Adagrad node
ADAMAX, NADAM, RADAM = "adamax", "nadam", "radam"  # on an Adam node
# Keras' formulas where they differ from torch's (epsilon elsewhere)
KERAS_RMSPROP, KERAS_ADAGRAD, KERAS_ADAMAX = "keras_rmsprop", "keras_adagrad", "keras_adamax"
KERAS_ADAMW = "keras_adamw"  # Keras' AdamW: Keras' (ONNX's) Adam after a decoupled decay
FORMULAS = {TORCH_ADAM: "Adam", TORCH_ADAMW: "Adam", ADAMAX: "Adam", NADAM: "Adam",
            RADAM: "Adam", KERAS_ADAMAX: "Adam", KERAS_ADAMW: "Adam", RMSPROP: "Adagrad",
            ADADELTA: "Adagrad",
            KERAS_RMSPROP: "Adagrad", KERAS_ADAGRAD: "Adagrad"}  # formula -> its node
# with the PyTorch Adam formula, AMSGrad (1): a third state per parameter, the running max of v
AMSGRAD_ATTR = "ngdist_amsgrad"
MAXIMIZE_ATTR = "ngdist_maximize"  # 1: the update ascends (the gradient is negated first)
DECOUPLED_ATTR = "ngdist_decoupled"  # NAdam/RAdam: 1 for decoupled weight decay (AdamW's)
# attributes whose values the node reads from its last inputs instead, in this order (a
# scheduled momentum: ``alpha`` (beta1) of a Momentum node or of an Adam node of torch's,
# ``ngdist_momentum`` of an RMSprop node; NAdam's also ``MU_PRODUCT``)
SCHEDULED_ATTR = "ngdist_scheduled"
# NAdam with a scheduled beta1: torch's mu_product, mu_1 ... mu_t, each mu_i from the beta1 of
# step i (a state of the step, updated before the node reads it)
MU_PRODUCT = "ngdist_mu_product"
# (op, formula) -> the attributes it may read from inputs (SCHEDULED_ATTR), in order
SCHEDULED_FORMULAS: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("Momentum", None): ("alpha",), ("Adam", TORCH_ADAM): ("alpha",),
    ("Adam", TORCH_ADAMW): ("alpha",), ("Adam", ADAMAX): ("alpha",),
    ("Adam", RADAM): ("alpha",), ("Adam", NADAM): ("alpha", MU_PRODUCT),
    ("Adagrad", RMSPROP): ("ngdist_momentum",)}
# Keras' weight decay on any node: x <- x - x * decay * lr before the update
KERAS_DECAY_ATTR = "ngdist_keras_weight_decay"
# every float attribute's value as the Python float it was given ("alpha=0.9", repr's digits):
# ONNX attributes are float32, and a float64 model's update reads every digit of torch's.
# Kept in the node's metadata_props (entries joined by ";"), not as an attribute: the node
# stays valid ONNX (onnx.checker, the reference evaluator).
EXACT_ATTR = "ngdist_exact"


def make_optimizer_node(op_type: str, inputs: list[str], outputs: list[str],
                        attributes: Mapping[str, object], **kwargs: Any) -> onnx.NodeProto:
    """The optimizer node of ``attributes`` (an optimizer's ``attributes()``, Python floats),
    their every digit (``EXACT_ATTR``) in the node's metadata_props."""
    exact = exact_attr(attributes)
    node = onnx.helper.make_node(op_type, inputs, outputs, domain=PREVIEW_TRAINING, **kwargs,
                                 **attributes)
    if exact:
        entry = node.metadata_props.add()
        entry.key, entry.value = EXACT_ATTR, ";".join(exact)  # type: ignore[arg-type]
    return node


def exact_entries(props: Mapping[str, str]) -> list[str]:
    """``EXACT_ATTR``'s entries from a node's metadata_props (none: [])."""
    text = props.get(EXACT_ATTR)
    return text.split(";") if text else []


def _adam_kinds(a: Mapping[str, object]) -> tuple[str, ...]:
    return ("adam_m", "adam_v", "adam_vmax") if a.get(AMSGRAD_ATTR) else ("adam_m", "adam_v")


def _rmsprop_kinds(a: Mapping[str, object]) -> tuple[str, ...]:
    return ("rmsprop_sq", *(("rmsprop_mom",) if a.get("ngdist_momentum") else ()),
            *(("rmsprop_gavg",) if a.get("ngdist_centered") else ()))


# (op, formula) -> the state kinds of a parameter, in the node's order; a kind is the suffix of
# the state's name (``<param>.<kind>``)
STATE_KINDS: dict[tuple[str, str | None], Callable[[Mapping[str, object]], tuple[str, ...]]] = {
    ("Momentum", None): lambda a: ("momentum",),
    ("Adagrad", None): lambda a: ("adagrad_h",),
    ("Adam", None): lambda a: ("adam_m", "adam_v"),
    ("Adam", TORCH_ADAM): _adam_kinds, ("Adam", TORCH_ADAMW): _adam_kinds,
    ("Adam", ADAMAX): lambda a: ("adamax_m", "adamax_u"),
    ("Adam", NADAM): lambda a: ("nadam_m", "nadam_v"),
    ("Adam", RADAM): lambda a: ("radam_m", "radam_v"),
    ("Adagrad", RMSPROP): _rmsprop_kinds,
    ("Adagrad", ADADELTA): lambda a: ("adadelta_sq", "adadelta_acc"),
    ("Adagrad", KERAS_RMSPROP): _rmsprop_kinds,
    ("Adagrad", KERAS_ADAGRAD): lambda a: ("adagrad_h",),
    ("Adam", KERAS_ADAMAX): lambda a: ("adamax_m", "adamax_u"),
    ("Adam", KERAS_ADAMW): lambda a: ("adam_m", "adam_v"),
}


def state_kinds(op_type: str, attributes: Mapping[str, object]) -> tuple[str, ...]:
    """The state kinds of a parameter under the optimizer ``op_type`` with ``attributes``."""
    formula = attributes.get(FORMULA_ATTR)
    check_formula(op_type, formula, f"optimizer op {op_type}")
    return STATE_KINDS[(op_type, formula)](attributes)  # type: ignore[index]


def check_formula(op_type: str, formula: object, where: str) -> None:
    """A GraphError unless ``formula`` (None: ONNX's) is one an ``op_type`` node carries."""
    if formula is None or FORMULAS.get(formula) == op_type:  # type: ignore[arg-type]
        return
    if formula not in FORMULAS:
        raise GraphError(f"{where}: {FORMULA_ATTR}={formula!r} is not a formula ngdist knows; "
                         f"the formulas are {sorted(FORMULAS)}")
    raise GraphError(f"{where}: {FORMULA_ATTR}={formula!r} is a formula of "
                     f"{FORMULAS[formula]} nodes (ngdist.optim writes it there), not of "
                     f"{op_type}")


def node_state_kinds(node: ir.Node) -> tuple[str, ...]:
    return state_kinds(node.op_type, {k: a.value for k, a in node.attributes.items()})


def num_states(node: ir.Node) -> int:
    """State tensors per parameter of an optimizer node."""
    return len(node_state_kinds(node))


def scheduled_names(node: ir.Node) -> list[str]:
    """The attributes ``node`` reads from its last inputs (``SCHEDULED_ATTR``), in order."""
    return [str(n) for n in attr(node, SCHEDULED_ATTR, None) or ()]


def split_optimizer_inputs(node: ir.Node) -> tuple[ir.Value, ir.Value, list[list[ir.Value]]]:
    """(R, T, [xs, gs, state_1s, ...]) of an optimizer node (its scheduled inputs aside)."""
    scheduled = len(scheduled_names(node))
    r, t = node.inputs[0], node.inputs[1]
    rest = list(node.inputs[2:len(node.inputs) - scheduled])
    groups = 2 + num_states(node)
    if scheduled and len(rest) % groups:
        raise GraphError(
            f"optimizer node {node.name!r} ({node.op_type}) reads {scheduled_names(node)} from "
            f"its last inputs but has {len(node.inputs)} inputs, not R, T, {groups} per "
            "parameter and those; a momentum that a torch scheduler cycles is followed where "
            "the step keeps its optimizer node whole, not under ps or shard= (there: "
            "OneCycleLR(..., cycle_momentum=False))")
    n = len(rest) // groups
    return r, t, [rest[i * n:(i + 1) * n] for i in range(groups)]


def scheduled_inputs(node: ir.Node) -> dict[str, ir.Value]:
    """{attribute: the input giving its value} for the node's scheduled attributes."""
    names = scheduled_names(node)
    return dict(zip(names, node.inputs[len(node.inputs) - len(names):])) if names else {}


_ATTR_KINDS = {defs.OpSchema.AttrType.FLOAT: ((float, int), "a float"),
               defs.OpSchema.AttrType.INT: ((int,), "an int"),
               defs.OpSchema.AttrType.STRING: ((str,), "a string")}


def onnx_default(a: defs.OpSchema.Attribute) -> object:
    d = a.default_value
    if d is None or not d.name:
        return None
    return onnx.helper.get_attribute_value(d)


def exact_attr(attributes: Mapping[str, object]) -> list[str]:
    """``EXACT_ATTR``'s value for node attributes ``attributes``: each float's every digit."""
    return [f"{k}={v!r}" for k, v in sorted(attributes.items()) if isinstance(v, float)]


def exact_values(where: str, attributes: Mapping[str, object]) -> dict[str, float]:
    """{attribute: its exact value} from ``EXACT_ATTR`` among ``attributes``; an exact value
    that the float attribute does not round to (one of them edited) is a GraphError."""
    out = {}
    for item in attributes.get(EXACT_ATTR) or ():  # type: ignore[attr-defined]
        text = item.decode() if isinstance(item, bytes) else str(item)
        name, _, value = text.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise GraphError(f"{where}: {EXACT_ATTR} entry {text!r} is not NAME=FLOAT") from None
        given = attributes.get(name)
        if isinstance(given, float) and np.float32(given) != np.float32(out[name]):
            raise GraphError(f"{where}: attribute {name!r} is {given} but {EXACT_ATTR} says "
                             f"{out[name]}; edit both, or remove {EXACT_ATTR} to use the "
                             "attributes (float32) alone")
    return out


def node_attrs(node: ir.Node) -> dict[str, object]:
    """The node's attributes by the operator's schema, defaults filled in, and its ngdist
    attributes as they are; a required one that is missing or one of the wrong kind is a
    GraphError naming the node. A float is its exact value (``EXACT_ATTR``) where the node
    has one, else, on a node with ``FORMULA_ATTR``, the decimal it was written as
    (``decimal``), else the float32 attribute (ONNX's operator)."""
    schema = defs.get_schema(node.op_type, 1, PREVIEW_TRAINING)
    out: dict[str, object] = {k: a.value for k, a in node.attributes.items()
                              if k.startswith("ngdist_")}
    required = sorted(n for n, s in schema.attributes.items() if s.required)
    for name, a in schema.attributes.items():
        value = attr(node, name, onnx_default(a))
        kinds, what = _ATTR_KINDS.get(a.type, ((object,), ""))
        if value is None and a.required:
            raise GraphError(f"optimizer node {node.name!r} ({node.op_type}) lacks its required "
                             f"attribute {name!r}; ai.onnx.preview.training.{node.op_type} "
                             f"needs {required}")
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise GraphError(f"optimizer node {node.name!r} ({node.op_type}): attribute "
                             f"{name!r} is {value!r}, not {what}")
        out[name] = value
    out[EXACT_ATTR] = exact_entries(node.metadata_props)
    exact = exact_values(f"optimizer node {node.name!r}", out)
    out.pop(EXACT_ATTR, None)
    for name, value in out.items():
        if isinstance(value, float):
            out[name] = exact.get(name, value if out.get(FORMULA_ATTR) is None
                                  else decimal(value))
    if node.op_type == "Momentum" and out["mode"] not in ("standard", "nesterov"):
        raise GraphError(f"optimizer node {node.name!r} (Momentum): mode is {out['mode']!r}; "
                         "the modes are 'standard' and 'nesterov'")
    return out


def decimal(value: object) -> float:
    """A float attribute as the decimal it was written as (a node without ``EXACT_ATTR``):
    ONNX stores attributes as float32, and 1 - float32(0.999) is 1.3e-5 off PyTorch's
    1 - 0.999 (its betas are Python floats)."""
    return float(str(np.float32(value)))  # the shortest decimal that rounds to it


class Scalars:
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

    def shape(self, v: ir.Value, x: ir.Value) -> ir.Value:
        rank = self._key(x)[1]
        if rank is None:  # unknown rank: a rank-0 scalar broadcasts to anything
            return self.ctx.op("Reshape", v, self.ctx.ints([]))
        return self.ctx.op("Reshape", v, self.ctx.ints([1] * rank))

    def const(self, value: float, x: ir.Value) -> ir.Value:
        key = ("const", float(value), *self._key(x))
        if key not in self._cache:
            rank = self._key(x)[1]
            shape = [1] * rank if rank is not None else []
            if x.dtype is not None:  # rounded once from the Python float to x's type
                arr = np.full(shape, value, np.float64).astype(x.dtype.numpy())
                self._cache[key] = self.ctx.op("Constant", value=ir.tensor(arr))
            else:
                self._cache[key] = self.ctx.const(np.full(shape, value), like=x,
                                                   dtype=np.float64)
        return self._cache[key]

    def hyper(self, value: float | ir.Value, x: ir.Value) -> ir.Value:
        """A hyper-parameter in x's type and rank: an attribute's float (``const``) or a
        scheduled graph value (``cast``)."""
        return self.cast(value, x) if isinstance(value, ir.Value) else self.const(value, x)

    def exact(self, value: float, x: ir.Value) -> ir.Value:
        """``value`` in x's type and rank, rounded once from the Python float (a float64
        parameter gets every digit of it)."""
        return self.memo(("exact", float(value)), x, lambda: self.shape(
            self.ctx.op("CastLike", self.ctx.op(
                "Constant", value=ir.tensor(np.array(value, np.float64))), x), x))

    def cast(self, v: ir.Value, x: ir.Value) -> ir.Value:
        """Graph scalar ``v`` (the learning rate, the step count) in x's type and rank."""
        key = ("cast", v.name, *self._key(x))
        if key not in self._cache:
            self._cache[key] = self.shape(self.ctx.op("CastLike", v, x), x)
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


class Float64:
    """Rank-0 float64 scalars of one optimizer node (the learning rate, the step count and
    what torch computes from them in Python floats), built once per node."""

    def __init__(self, ctx: GradContext, r: ir.Value, t: ir.Value) -> None:
        self.ctx = ctx
        double = int(ir.DataType.DOUBLE)
        self.lr = ctx.op("Cast", r, to=double)
        self.t = ctx.op("Cast", t, to=double)

    def c(self, v: float) -> ir.Value:
        return self.ctx.op("Constant", value=ir.tensor(np.array(v, np.float64)))

    def scalar(self, v: float | ir.Value) -> ir.Value:
        """A float, or a scheduled graph value, as a float64 scalar."""
        if isinstance(v, ir.Value):
            return self.ctx.op("Cast", v, to=int(ir.DataType.DOUBLE))
        return self.c(v)

    def op(self, op_type: str, *inputs: ir.Value) -> ir.Value:
        return self.ctx.op(op_type, *inputs)

    def one_minus_pow(self, base: float | ir.Value, exponent: ir.Value) -> ir.Value:
        """1 - base^exponent."""
        return self.op("Sub", self.c(1.0), self.op("Pow", self.scalar(base), exponent))


def scalar_like(k: Scalars, name: str, scalars: Mapping[str, ir.Value], like: ir.Value
                ) -> ir.Value:
    """The float64 scalar ``scalars[name]`` in the type and rank of ``like`` (memoized)."""
    return k.memo(("f64", name, id(scalars)), like,
                  lambda: k.shape(k.ctx.op("CastLike", scalars[name], like), like))


def keras_decayed(ctx: GradContext, k: Scalars, a: Mapping[str, object], r: ir.Value,
                  x: ir.Value) -> ir.Value:
    """x - x * decay * lr (Keras' ``_apply_weight_decay``) under ``KERAS_DECAY_ATTR``, else x."""
    decay = a.get(KERAS_DECAY_ATTR) or 0.0
    if not decay:
        return x
    return ctx.op("Sub", x, ctx.op("Mul", ctx.op("Mul", x, k.const(decay, x)),  # type: ignore
                                   k.cast(r, x)))


def maximized(ctx: GradContext, a: Mapping[str, object], g: ir.Value) -> ir.Value:
    """torch's ``maximize=True``: the gradient negated before anything else."""
    return ctx.op("Neg", g) if a.get(MAXIMIZE_ATTR) else g
