"""ONNX symbolics for elementwise and reduction math operators the TorchScript exporter of
torch lacks (lent with the others by ``frontends/torch_symbolics.py``), each torch's function
in ops whose gradients ngdist has:

* ``aten::logaddexp`` / ``logaddexp2``: torch's ``max + log1p(exp(-|a - b|))``, as
  ``a + softplus(b - a)`` where a >= b, else ``b + softplus(a - b)`` (a Where: at a tie the
  gradient is 1/2 each, as torch's), and a where both are the same infinity;
* ``aten::xlogy``: ``x * log(y)``, 0 where x is 0 and y is not NaN;
* ``aten::copysign``: ``|a|`` times -1 where b's sign bit is set (``signbit``; a NaN result's
  own sign is left as the multiplication gives it);
* ``aten::signbit``: ``x < 0``, or ``1 / x < 0`` for -0.0 (a NaN's sign bit is not read:
  ONNX has no bit cast);
* ``aten::count_nonzero``: the int64 count of ``x != 0`` over ``dim`` (all axes if none);
* ``aten::nanmean`` / ``nansum``: NaNs taken as 0, the mean over the count of the others.

Integer inputs of the float functions are cast to float32, as torch promotes them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def helper() -> Any:
    """torch's TorchScript ``symbolic_helper`` module (imported when a symbolic runs)."""
    from torch.onnx._internal.torchscript_exporter import symbolic_helper
    return symbolic_helper


def const(g: Any, value: Any, dtype: Any = np.int64) -> Any:
    """A Constant node of ``value`` in ``dtype`` in the graph ``g`` being exported."""
    import torch
    return g.op("Constant", value_t=torch.tensor(np.asarray(value, dtype)))


def _floats(g: Any, *values: Any) -> list[Any]:
    """``values`` in one float type: the first floating one's, float32 where none is."""
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    def kind(v: Any) -> Any:
        return t.JitScalarType.from_value(v, t.JitScalarType.UNDEFINED)

    floating = {t.JitScalarType.FLOAT, t.JitScalarType.DOUBLE, t.JitScalarType.HALF,
                t.JitScalarType.BFLOAT16}
    ref = next((v for v in values if kind(v) in floating), None)
    if ref is None:
        return [g.op("Cast", v, to_i=1) for v in values]
    return [v if v is ref else g.op("CastLike", v, ref) for v in values]


def _scalar(g: Any, value: float, like: Any) -> Any:
    return g.op("CastLike", const(g, value, np.float32), like)


def _logaddexp(base2: bool) -> Callable[..., Any]:
    def symbolic(g: Any, a: Any, b: Any) -> Any:
        a, b = _floats(g, a, b)
        if base2:  # log2(2^a + 2^b) = logaddexp(a ln2, b ln2) / ln2
            a, b = (g.op("Mul", v, _scalar(g, np.log(2.0), v)) for v in (a, b))
        first = g.op("Add", a, g.op("Softplus", g.op("Sub", b, a)))
        second = g.op("Add", b, g.op("Softplus", g.op("Sub", a, b)))
        out = g.op("Where", g.op("GreaterOrEqual", a, b), first, second)
        same_inf = g.op("And", g.op("Equal", a, b), g.op("IsInf", a))
        out = g.op("Where", same_inf, a, out)
        return g.op("Div", out, _scalar(g, np.log(2.0), out)) if base2 else out

    return symbolic


def xlogy(g: Any, x: Any, y: Any) -> Any:
    x, y = _floats(g, x, y)
    zero = g.op("And", g.op("Equal", x, _scalar(g, 0.0, x)), g.op("Not", g.op("IsNaN", y)))
    return g.op("Where", zero, _scalar(g, 0.0, x), g.op("Mul", x, g.op("Log", y)))


def signbit(g: Any, x: Any) -> Any:
    x, = _floats(g, x)
    zero = _scalar(g, 0.0, x)
    return g.op("Or", g.op("Less", x, zero),
                g.op("Less", g.op("Div", _scalar(g, 1.0, x), x), zero))


def copysign(g: Any, a: Any, b: Any) -> Any:
    a, b = _floats(g, a, b)
    size = g.op("Abs", a)
    sign = g.op("Where", signbit(g, b), _scalar(g, -1.0, size), _scalar(g, 1.0, size))
    return g.op("Mul", size, sign)  # -0.0 too: onnxruntime's Where turns -0.0 into +0.0


def _axes(g: Any, dim: Any) -> Any | None:
    """``dim`` (an int, a list or None) as ONNX axes, None for every axis."""
    h = helper()
    if dim is None or h._is_none(dim):
        return None
    try:
        value = h._maybe_get_const(dim, "is")
    except TypeError:  # one int: the exporter's list parse iterates it
        value = h._maybe_get_const(dim, "i")
    value = np.atleast_1d(np.asarray(value, np.int64)).tolist()
    return const(g, value) if value else None


def _reduce_sum(g: Any, x: Any, dim: Any, keepdim: int) -> Any:
    axes = _axes(g, dim)
    if axes is None:
        return g.op("ReduceSum", x, keepdims_i=keepdim)
    return g.op("ReduceSum", x, axes, keepdims_i=keepdim)


def count_nonzero(g: Any, x: Any, dim: Any = None) -> Any:
    nonzero = g.op("Not", g.op("Equal", x, g.op("CastLike", const(g, 0), x)))
    return _reduce_sum(g, g.op("Cast", nonzero, to_i=7), dim, 0)


def _keep(keepdim: Any) -> int:
    h = helper()
    return 0 if keepdim is None or h._is_none(keepdim) else int(h._maybe_get_const(keepdim, "i"))


def _as(g: Any, out: Any, dtype: Any) -> Any:
    """``out`` cast to torch's ``dtype=`` argument where one is given."""
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    h = helper()
    if dtype is None or h._is_none(dtype):
        return out
    return g.op("Cast", out, to_i=t.JitScalarType(h._get_const(dtype, "i", "dtype")).onnx_type())


def nansum(g: Any, x: Any, dim: Any = None, keepdim: Any = None, dtype: Any = None) -> Any:
    x, = _floats(g, x)
    clean = g.op("Where", g.op("IsNaN", x), _scalar(g, 0.0, x), x)
    return _as(g, _reduce_sum(g, clean, dim, _keep(keepdim)), dtype)


def nanmean(g: Any, x: Any, dim: Any = None, keepdim: Any = None, dtype: Any = None) -> Any:
    x, = _floats(g, x)
    counted = g.op("CastLike", g.op("Not", g.op("IsNaN", x)), x)
    mean = g.op("Div", nansum(g, x, dim, keepdim), _reduce_sum(g, counted, dim, _keep(keepdim)))
    return _as(g, mean, dtype)


def exponential(g: Any, x: Any, lambd: Any = 1.0, generator: Any = None) -> Any:
    """``Tensor.exponential_(lambd)`` (PhiMoE's Gumbel sampling of experts in training):
    ``-log(1 - U) / lambd`` of ``U`` uniform in [0, 1) (RandomUniformLike, a draw of
    onnxruntime's generator, not torch's)."""
    one = g.op("CastLike", const(g, 1.0, np.float32), x)
    sample = g.op("Neg", g.op("Log", g.op("Sub", one, g.op("RandomUniformLike", x))))
    rate = helper()._maybe_get_const(lambd, "f")
    if isinstance(rate, float) and rate == 1.0:
        return sample
    return g.op("Div", sample, g.op("CastLike", lambd if helper()._is_value(lambd)
                                    else const(g, rate, np.float32), x))


def uniform(g: Any, x: Any, low: Any = 0.0, high: Any = 1.0, generator: Any = None) -> Any:
    """``Tensor.uniform_(low, high)`` (PhiMoE's Heun mask): RandomUniformLike in [low, high)
    with constant bounds, else ``low + (high - low) U``; onnxruntime's draws, not torch's."""
    h = helper()
    lo, hi = h._maybe_get_const(low, "f"), h._maybe_get_const(high, "f")
    if isinstance(lo, float) and isinstance(hi, float):
        return g.op("RandomUniformLike", x, low_f=lo, high_f=hi)
    lo, hi = (g.op("CastLike", v if h._is_value(v) else const(g, v, np.float32), x)
              for v in (low, high))
    return g.op("Add", lo, g.op("Mul", g.op("Sub", hi, lo), g.op("RandomUniformLike", x)))


SYMBOLICS: dict[str, Callable[..., Any]] = {
    "aten::exponential": exponential,
    "aten::uniform": uniform,
    "aten::logaddexp": _logaddexp(False),
    "aten::logaddexp2": _logaddexp(True),
    "aten::xlogy": xlogy,
    "aten::copysign": copysign,
    "aten::signbit": signbit,
    "aten::count_nonzero": count_nonzero,
    "aten::nansum": nansum,
    "aten::nanmean": nanmean,
}
