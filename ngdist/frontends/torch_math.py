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
* ``aten::nanmean`` / ``nansum``: NaNs taken as 0, the mean over the count of the others;
* ``aten::searchsorted`` (MusicFlamingo's audio timestamps): for each value, the count of the
  entries of its row of the sorted sequence with ``not seq >= v`` (``not seq > v`` on the
  right side), the comparisons of torch's binary search: a NaN value goes after every entry;
  ``sorter`` gathered first (a sequence holding NaN, not sorted by ``<``, is not covered);
* ``aten::pow`` and ``aten::sum`` of integers (Hugging Face BLT's rolling hash of byte
  groups): exact, wrapping at 64 bits as torch's: onnxruntime's integer Pow goes through
  doubles (1000000007 ** 2 is off by 49, an overflow saturates) and so does its int64
  ReduceSum (off by 200 above 2 ** 62); the power by repeated squaring (:func:`_int_pow`),
  the sum as the last of a CumSum along each axis (:func:`_int_sum`). Float ones are
  torch's own symbolics.

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


def searchsorted(g: Any, seq: Any, values: Any, out_int32: Any = False, right: Any = False,
                 side: Any = None, sorter: Any = None) -> Any:
    h = helper()
    after = h._maybe_get_const(side, "s") == "right" if not h._is_none(side) else \
        bool(h._maybe_get_const(right, "b"))
    if not h._is_none(sorter):
        seq = g.op("GatherElements", seq, sorter, axis_i=-1)
    last = const(g, [-1])  # (..., 1, n) against (..., m, 1): a 1-D sequence broadcasts
    before = g.op("Not", g.op("Greater" if after else "GreaterOrEqual",
                              g.op("Unsqueeze", seq, const(g, [-2])),
                              g.op("Unsqueeze", values, last)))
    int32 = bool(h._maybe_get_const(out_int32, "b"))
    count = g.op("ReduceSum", g.op("Cast", before, to_i=6 if int32 else 7), last, keepdims_i=0)
    return g.op("Squeeze", count, const(g, [0])) if h._get_tensor_rank(values) == 0 else count


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


def _integral(v: Any) -> bool:
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    j = t.JitScalarType
    return t.JitScalarType.from_value(v, j.UNDEFINED) in (j.UINT8, j.INT8, j.INT16, j.INT,
                                                           j.INT64)


def _int_pow(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, x: Any, e: Any) -> Any:
        h = helper()
        if not (_integral(x) and _integral(e)):
            return builtin(g, x, e)
        known = h._maybe_get_const(e, "t") if h._is_constant(e) else None
        bits = 63 if known is None else \
            max(int(np.max(np.asarray(known), initial=0)), 0).bit_length()
        base, rest = g.op("Cast", x, to_i=7), g.op("Cast", e, to_i=7)
        zero, one, two = const(g, 0), const(g, 1), const(g, 2)
        out = g.op("Add", g.op("Mul", g.op("Add", base, rest), zero), one)  # broadcast ones
        for k in range(bits):  # square-and-multiply over the exponent's bits, low first
            odd = g.op("Equal", g.op("Mod", rest, two), one)
            out = g.op("Where", odd, g.op("Mul", out, base), out)
            if k + 1 < bits:
                rest, base = g.op("Div", rest, two), g.op("Mul", base, base)
        return g.op("Cast", out, to_i=_pow_type(x, e).onnx_type())

    return symbolic


def _pow_type(x: Any, e: Any) -> Any:
    """torch's result type of integer ``x ** e``: a 0-dim operand yields to the other's."""
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    h = helper()
    kx, ke = t.JitScalarType.from_value(x), t.JitScalarType.from_value(e)
    rx, re = h._get_tensor_rank(x), h._get_tensor_rank(e)
    if kx == ke or not re:
        return kx
    if not rx:
        return ke
    return t.JitScalarType.INT64 if t.JitScalarType.INT64 in (kx, ke) else kx


def _int_sum(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, x: Any, *args: Any) -> Any:
        h = helper()
        if len(args) == 1:
            dims, keep, dtype = None, 0, args[0]
        elif len(args) == 3:
            dim, keep, dtype = args
            dims = None if h._is_none(dim) else h._maybe_get_const(dim, "is")
            keep = h._maybe_get_const(keep, "i")
        else:
            return builtin(g, x, *args)
        wanted = None if h._is_none(dtype) else h._maybe_get_const(dtype, "i")
        rank = h._get_tensor_rank(x)
        if rank is None or not (_integral(x) or _boolean(x)) or not isinstance(keep, int) or \
                (dims is not None and not isinstance(dims, list)) or \
                wanted not in (None, 0, 1, 2, 3, 4):  # torch's: floats, unknown ranks
            return builtin(g, x, *args)
        x = g.op("Cast", x, to_i=7)  # torch sums integers and bools in int64
        axes = sorted({d % rank for d in dims}) if dims else list(range(rank))
        for axis in axes:
            pads = [0] * (2 * rank)
            pads[axis] = 1  # a leading zero: an empty axis sums to 0
            total = g.op("CumSum", g.op("Pad", x, const(g, pads)), const(g, axis))
            x = g.op("Slice", total, const(g, [-1]), const(g, [np.iinfo(np.int64).max]),
                     const(g, [axis]))
        if axes and not keep:
            x = g.op("Squeeze", x, const(g, axes))
        if wanted is not None:
            from torch.onnx._internal.torchscript_exporter import _type_utils as t
            x = g.op("Cast", x, to_i=t.JitScalarType(wanted).onnx_type())
        return x

    return symbolic


def _boolean(v: Any) -> bool:
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    return t.JitScalarType.from_value(v, t.JitScalarType.UNDEFINED) == t.JitScalarType.BOOL


# wrappers of torch's symbolics (kept as their fallback)
WRAPS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "aten::pow": _int_pow, "aten::sum": _int_sum}

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
    "aten::searchsorted": searchsorted,
}
