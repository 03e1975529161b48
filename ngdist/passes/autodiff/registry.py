"""Gradient-rule registry and the context rules emit their nodes through.

A rule is ``rule(ctx, node, grads) -> list`` where ``grads[i]`` is the gradient flowing into
``node.outputs[i]`` (``None`` when nothing flows there) and the result holds one entry per
input of ``node``: an ``ir.Value`` with the input's shape, or ``None`` for "no gradient"
(indices, shapes, masks). Rules *emit* nodes through ``ctx`` and read forward values, so
activations are reused, never recomputed; the one change a rule may make to a forward node is
to add an optional output it already computes (MaxPool's Indices, Dropout's mask,
LayerNormalization's Mean/InvStdDev, see ``rules._common.ensure_output``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from ngdist.errors import GradientError

MIN_ROW_SUM = 64  # a whole-tensor sum starts with rows at least this long (see sum_over)

GradRule = Callable[["GradContext", ir.Node, list["ir.Value | None"]], Sequence["ir.Value | None"]]

_RULES: dict[tuple[str, str], GradRule] = {}

# Ops whose outputs never carry a gradient (shape computations, comparisons, indices).
NON_DIFFERENTIABLE: set[str] = {
    "Shape", "Size", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Not", "And",
    "Or", "Xor", "ArgMax", "ArgMin", "NonZero", "ConstantOfShape", "Constant", "OneHot",
    "Range", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
    "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf", "Bernoulli", "Multinomial", "EyeLike",
    # piecewise constant in their float inputs, or integer/boolean results
    "Hardmax", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Unique",
    "NonMaxSuppression", "HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix",
    "DynamicQuantizeLinear",
}


def subgraph_reads(node: ir.Node) -> list[ir.Value]:
    """The values of the graph around ``node`` that its subgraphs (an If's branches, a Loop's
    body) read without being among its inputs, in first-read order. A rule of such a node
    returns one gradient per input, then one per value of this list."""
    inputs = {id(i) for i in node.inputs if i is not None}
    made: set[int] = set()
    reads: dict[int, ir.Value] = {}
    for attr_ in node.attributes.values():
        if attr_.type not in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            continue
        for sub in [attr_.value] if attr_.type == ir.AttributeType.GRAPH else attr_.value:
            made.update(id(v) for v in sub.inputs)
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                made.update(id(o) for o in inner.outputs)
                reads.update((id(i), i) for i in inner.inputs if i is not None)
            reads.update((id(o), o) for o in sub.outputs)
    return [v for k, v in reads.items() if k not in made and k not in inputs]


def register(*op_types: str, domain: str = "") -> Callable[[GradRule], GradRule]:
    """Decorator: ``@register("Add")`` makes the function the gradient rule of Add."""

    def wrap(fn: GradRule) -> GradRule:
        for op in op_types:
            _RULES[(domain, op)] = fn
        return fn

    return wrap


def get_rule(node: ir.Node) -> GradRule | None:
    return _RULES.get((node.domain or "", node.op_type))


def registered_ops() -> list[str]:
    return sorted(op for _, op in _RULES)


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


_ATTR_MAKERS: dict[type, Callable[[str, Any], ir.Attr]] = {
    int: ir.AttrInt64, float: ir.AttrFloat32, str: ir.AttrString, ir.Tensor: ir.AttrTensor}


def _attr(name: str, value: Any) -> ir.Attr:
    """An attribute from a Python value; the common types without onnx_ir's protocol checks
    (they cost ~50 us a node, most of the time of a large backward graph)."""
    make = _ATTR_MAKERS.get(type(value))
    if make is not None:
        return make(name, value)
    if type(value) in (list, tuple) and value and all(type(v) is int for v in value):
        return ir.AttrInt64s(name, list(value))
    return ir.convenience.convert_attribute(name, value)


def _numpy_dtype(dtype: ir.DataType | None) -> np.dtype | None:
    """The numpy dtype of a float element type numpy has (float16/32/64), else None."""
    if dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16):
        return np.dtype(dtype.numpy())
    return None


def taken_names(graph: ir.Graph) -> set[str]:
    """Every node and value name in ``graph`` (its inputs, initializers and node outputs)."""
    names = {v.name for v in graph.inputs if v.name} | set(graph.initializers)
    for node in graph:
        if node.name:
            names.add(node.name)
        names.update(o.name for o in node.outputs if o.name)
    return names


class GradContext:
    """Emits backward nodes before ``anchor`` in the graph; small helpers for common idioms."""

    def __init__(self, graph: ir.Graph, anchor: ir.Node, opset: int,
                 taken: set[str] | None = None) -> None:
        self.graph = graph
        self.anchor = anchor
        self.opset = opset
        self._count = 0
        # node and value names in use: shared by every context working on one graph, so that
        # names stay unique across contexts (onnxruntime rejects a graph with duplicates)
        self.taken = taken_names(graph) if taken is None else taken
        self.current: ir.Node | None = None  # the forward node being differentiated
        self.needed: set[int] | None = None  # ids of values that want a gradient (None: all)
        self._consts: dict[tuple, ir.Value] = {}  # constants emitted so far, by value
        self._keep: list[ir.Value] = []

    def needs(self, value: ir.Value | None) -> bool:
        """Whether a gradient for ``value`` is wanted (it depends on an x); rules skip the rest."""
        return value is not None and (self.needed is None or id(value) in self.needed) and \
            (value.dtype is None or value.dtype.is_floating_point())

    # -- emission ---------------------------------------------------------------------------
    def _name(self, op_type: str, num_outputs: int = 1) -> str:
        """A node name (its outputs are ``name:i``) that no node or value of the graph has."""
        base = self.current.name if self.current is not None and self.current.name else "grad"
        while True:
            self._count += 1
            name = f"{base}/grad/{op_type}_{self._count}"
            if name not in self.taken and \
                    not any(f"{name}:{i}" in self.taken for i in range(num_outputs)):
                self.taken.add(name)
                return name

    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "",
           **attributes: Any) -> ir.Value:
        return self.op_multi(op_type, *inputs, num_outputs=1, domain=domain, **attributes)[0]

    def op_multi(self, op_type: str, *inputs: ir.Value | None, num_outputs: int,
                 domain: str = "", **attributes: Any) -> Sequence[ir.Value]:
        attrs = [_attr(k, v) for k, v in attributes.items() if v is not None]
        name = self._name(op_type, num_outputs)
        node = ir.Node(domain, op_type, list(inputs), attrs, num_outputs=num_outputs, name=name)
        for i, out in enumerate(node.outputs):
            out.name = f"{name}:{i}"
            self.taken.add(out.name)
        self.graph.insert_before(self.anchor, node)
        return node.outputs

    # -- constants --------------------------------------------------------------------------
    def const(self, value: Any, like: ir.Value | None = None, dtype: Any = None) -> ir.Value:
        """A constant; with ``like`` it is cast to that value's element type (CastLike)."""
        arr = np.asarray(value, dtype=dtype if dtype is not None else
                         (np.float32 if like is not None else None))
        target = _numpy_dtype(like.dtype) if like is not None else None
        if target is not None:  # like's element type is known: no CastLike needed
            arr, like = arr.astype(target), None
        key = (arr.dtype.str, arr.shape, arr.tobytes(), None if like is None else id(like))
        out = self._consts.get(key)
        if out is None:  # one node per distinct constant: a chain of n ops shares its zeros
            out = self.op("Constant", value=ir.Tensor(arr))
            if like is not None:
                out = self.op("CastLike", out, like)
                self._keep.append(like)  # keeps id(like) unique while the key lives
            self._consts[key] = out
        return out

    def scalar(self, value: float, like: ir.Value) -> ir.Value:
        """The number ``value`` in like's element type and shaped [1] * rank(like) (rank 0 when
        the rank is unknown), for elementwise ops with ``like`` or a tensor of its rank:
        onnxruntime's binary ops take a slow path for a rank-0 operand against a tensor whose
        last dimension is 1 (Mul, Sub, Greater of [262144, 1]: 2.3 ms vs 0.05 ms)."""
        rank = self.rank(like)
        return self.const(np.full([1] * (rank or 0), value, np.float32), like=like)

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64))

    def constant_value(self, value: ir.Value | None) -> np.ndarray | None:
        """The value of a constant input (initializer or Constant node), else None."""
        if value is None:
            return None
        if value.const_value is not None and not value.is_graph_input():
            return value.const_value.numpy()
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant":
            for key in ("value", "value_int", "value_ints", "value_float", "value_floats"):
                a = producer.attributes.get(key)
                if a is not None:
                    v = a.value
                    return v.numpy() if hasattr(v, "numpy") else np.asarray(v)
        return None

    # -- shapes -----------------------------------------------------------------------------
    @staticmethod
    def rank(value: ir.Value) -> int | None:
        return value.shape.rank() if value.shape is not None else None

    def zeros_like(self, value: ir.Value) -> ir.Value:
        zero = self.op("ConstantOfShape", self.op("Shape", value),
                       value=ir.tensor(np.zeros(1, np.float32)))
        return self.op("CastLike", zero, value)

    def sum_over(self, value: ir.Value, axes: Sequence[int], rank: int) -> ir.Value:
        """ReduceSum of ``value`` (of ``rank``) over ``axes``, kept as 1s. Where the innermost
        axis is kept, onnxruntime adds the reduced positions one after another into each
        output, an error growing with their count (a bias over [B, T, C]: 12x torch's sum);
        one ReduceSum an axis, the inner first, keeps each run short at the same cost.
        Over every axis (a scalar's gradient) its single sum runs as long (and its long rows
        too): the innermost axes are summed first, as many as make rows of
        ``MIN_ROW_SUM`` values (shorter rows are slow), then one axis at a time
        (docs/benchmarks.md)."""
        axes = sorted(a % rank for a in axes)
        if rank > 1 and axes == list(range(rank)):
            first = self._row_start(value, rank)
            value = self.op("ReduceSum", value, self.ints(axes[first:]), keepdims=1)
            axes = axes[:first]
        elif len(axes) < 2 or rank - 1 in axes:
            return self.op("ReduceSum", value, self.ints(axes), keepdims=1)
        for axis in reversed(axes):
            value = self.op("ReduceSum", value, self.ints([axis]), keepdims=1)
        return value

    @staticmethod
    def _row_start(value: ir.Value, rank: int) -> int:
        """The first of the innermost axes of ``value`` whose static extents make rows of at
        least ``MIN_ROW_SUM`` values (an unknown extent counts as enough)."""
        dims = list(value.shape.dims) if value.shape is not None else [None] * rank
        first, row = rank - 1, dims[rank - 1]
        while first > 0 and isinstance(row, int) and row < MIN_ROW_SUM:
            first -= 1
            row = row * dims[first] if isinstance(dims[first], int) else None
        return first

    def unbroadcast(self, grad: ir.Value, like: ir.Value, grad_rank: int | None = None) -> ir.Value:
        """Sum ``grad`` down to the shape of ``like`` (the inverse of numpy broadcasting).

        A ``grad`` of unknown shape (a value the rule just emitted) is taken to have the shape
        of the current node's first output, as for every broadcasting elementwise op.
        """
        gshape, xshape = grad.shape, like.shape
        if gshape is None and grad_rank is None and self.current is not None and \
                self.current.outputs:
            gshape = self.current.outputs[0].shape
            grad_rank = gshape.rank() if gshape is not None else None
        if gshape is not None and xshape is not None and tuple(gshape.dims) == tuple(xshape.dims):
            return grad
        rg = grad_rank if grad_rank is not None else self.rank(grad)
        rx = self.rank(like)
        if rg is None or rx is None:
            raise GradientError(
                f"cannot reduce the gradient of '{like.name}' to its shape: rank unknown "
                f"(node '{self.current.name if self.current else '?'}'); give the model's "
                "inputs shapes with a known rank")
        lead = list(range(rg - rx))
        static_axes: list[int] | None = list(lead)
        if gshape is not None and xshape is not None:
            for i, xd in enumerate(xshape.dims):
                gd = gshape.dims[i + rg - rx]
                if isinstance(xd, int) and xd == 1 and gd != 1:
                    static_axes.append(i + rg - rx)
                elif xd != gd and not (isinstance(xd, int) and isinstance(gd, int) and xd == gd):
                    if not (isinstance(xd, int) and xd != 1):
                        static_axes = None  # symbolic dims that may or may not broadcast
                        break
        elif xshape is not None and all(d == 1 for d in xshape.dims):
            static_axes = list(range(rg))  # a scalar (or [1, ..., 1]): every axis is summed
        else:
            static_axes = None
        if static_axes is not None:
            out = grad
            if static_axes:
                out = self.sum_over(grad, static_axes, rg)
            if lead or static_axes:
                out = self.op("Reshape", out, self.op("Shape", like))
            return out
        # dynamic: reduce the axes where like has extent 1 and grad does not
        sx = self.op("Shape", like)
        if rg > rx:
            sx = self.op("Concat", self.ints([1] * (rg - rx)), sx, axis=0)
        sg = self.op("Shape", grad)
        one = self.ints([1])
        mask = self.op("And", self.op("Equal", sx, one), self.op("Not", self.op("Equal", sg, one)))
        axes = self.op("Reshape", self.op("NonZero", mask), self.ints([-1]))
        red = self.op("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", red, self.op("Shape", like))
