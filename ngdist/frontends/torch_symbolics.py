"""ONNX symbolics for aten operators the TorchScript exporter of torch lacks, lent to it only
for the duration of one of ngdist's exports (:func:`lent_symbolics`) and taken back after,
so that the user's process keeps torch's registry as it was. A symbolic that the user (or
torch) already registers for an operator is left in place and used.

* ``aten::expm1``: ``2 t / (1 - t)`` with ``t = tanh(x / 2)`` up to x = 1 (relative
  precision near 0, where ``exp(x) - 1`` cancels, and a gradient that is ``exp(x)`` by the
  chain rule), ``exp(x) - 1`` above;
* ``aten::diff``: ``prepend``/``append`` concatenated, then ``n`` times the difference of two
  slices along ``dim``;
* ``aten::histc``: counts of each bin (an Equal against the bin indices, summed), torch's bin
  formula ``floor((x - min) * bins / (max - min))`` with the last edge inclusive, values
  outside [min, max] not counted, min = max meaning the data's own range (widened by 1 each
  way when it is one value). Not differentiable, as in torch;
* ``aten::cumsum`` of a bool or integer tensor: cast to int64 first, as torch promotes it
  (torch's symbolic hands ONNX's CumSum a bool tensor, which onnxruntime refuses);
* ``aten::unfold`` (``Tensor.unfold``) along an axis whose extent the exporter cannot see
  (timm's halonet): :func:`_unfold`;
* ``aten::permute`` and ``aten::movedim`` with negative dims: counted from the end
  (:func:`_permute`, :func:`_movedim`);
* ``aten::repeat_interleave`` along a negative dim: torch's symbolic adds the rank to the
  traced constant in place, which every other user of that constant then reads
  (:func:`_repeat_interleave`);
* ``aten::avg_pool2d`` whose one window covers the whole map: GlobalAveragePool
  (:func:`_avg_pool2d`);
* ``aten::as_strided`` of a view whose memory is a permuted dense block (Longformer's and
  LED's overlapping chunks, taken from a transposed tensor): transposed to memory order first,
  since torch's symbolic reads the input in logical order (frontends/torch_strided.py);
* ``aten::col2im`` (``F.fold``) with an ``output_size`` computed from a shape (VOLO): the
  spatial rank from ``dilation``, the sizes concatenated (frontends/torch_strided.py);
* ``aten::_grouped_mm`` (Hugging Face's mixture-of-experts layers): :func:`grouped_mm`, and
  for the dynamo exporter the same as an ONNX Script translation of
  ``transformers::grouped_mm_fallback`` (:func:`dynamo_translations`);
* ``aten::adaptive_avg_pool2d`` with an output size that is not a factor of the input's (the
  exporter refuses it): with static spatial sizes, one averaging matrix per axis (row i
  averages torch's window ``[floor(i * n / m), ceil((i + 1) * n / m))``), applied by MatMul;
  the factor cases keep torch's own symbolic;
* ``aten::scatter_reduce`` of every reduction, with or without ``self`` (torch refuses
  ``include_self=False`` and ``mean``), and ``aten::index_add`` with a repeated index (torch's
  keeps one row of each): ``frontends/torch_scatter.py``;
* elementwise and reduction math (``logaddexp``, ``xlogy``, ``copysign``, ``signbit``,
  ``count_nonzero``, ``nanmean``, integer ``pow`` and ``sum``, ...) and ``exponential_``
  (``-log(1 - U)``, PhiMoE's Gumbel sampling): ``frontends/torch_math.py``;
* ``aten::detach``: a marked stop-gradient (``frontends/torch_stop_gradient.py``);
* complex tensors as (real, imaginary) pairs (``polar``, ``view_as_complex``,
  ``view_as_real``, complex products; any other op of a complex value refused):
  ``frontends/torch_complex.py``.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ngdist.errors import GraphError
from ngdist.frontends import torch_complex
from ngdist.frontends.torch_strided import as_strided, col2im
from ngdist.frontends.torch_math import SYMBOLICS, WRAPS, const, helper
from ngdist.frontends.torch_scatter import index_add, scatter_reduce
from ngdist.frontends.torch_stop_gradient import dynamo_translations as stop_gradient_translations
from ngdist.frontends.torch_stop_gradient import stop_gradient

logger = logging.getLogger(__name__)


def expm1(g: Any, x: Any) -> Any:
    half, one, two = (g.op("CastLike", const(g, v, np.float32), x) for v in (0.5, 1.0, 2.0))
    small = g.op("Min", x, one)  # the tanh form's input: finite gradients where unused
    t = g.op("Tanh", g.op("Mul", small, half))
    near = g.op("Div", g.op("Mul", two, t), g.op("Sub", one, t))
    far = g.op("Sub", g.op("Exp", x), one)
    return g.op("Where", g.op("Greater", x, one), far, near)


def diff(g: Any, x: Any, n: Any, dim: Any, prepend: Any, append: Any) -> Any:
    h = helper()
    n, dim = h._get_const(n, "i", "n"), h._get_const(dim, "i", "dim")
    parts = [v for v in (prepend, x, append) if v is x or not h._is_none(v)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=dim)
    axes, big = const(g, [dim]), const(g, [np.iinfo(np.int64).max])
    for _ in range(n):
        upper = g.op("Slice", x, const(g, [1]), big, axes)
        lower = g.op("Slice", x, const(g, [0]), const(g, [-1]), axes)
        x = g.op("Sub", upper, lower)
    return x


def histc(g: Any, x: Any, bins: Any, low: Any, high: Any) -> Any:
    h = helper()
    bins = h._get_const(bins, "i", "bins")
    low, high = h._get_const(low, "f", "min"), h._get_const(high, "f", "max")
    flat = g.op("Reshape", x, const(g, [-1]))
    if low == high:  # the data's range, widened where it is one value
        lo, hi = g.op("ReduceMin", flat, keepdims_i=1), g.op("ReduceMax", flat, keepdims_i=1)
        same = g.op("Cast", g.op("Equal", lo, hi), to_i=1)
        same = g.op("CastLike", same, x)
        lo, hi = g.op("Sub", lo, same), g.op("Add", hi, same)
    else:
        lo, hi = (g.op("CastLike", const(g, [v], np.float32), x) for v in (low, high))
    nbins = g.op("CastLike", const(g, [bins], np.float32), x)
    pos = g.op("Floor", g.op("Div", g.op("Mul", g.op("Sub", flat, lo), nbins),
                             g.op("Sub", hi, lo)))
    pos = g.op("Cast", pos, to_i=7)  # int64
    last = const(g, [bins - 1])
    pos = g.op("Min", pos, last)  # x == max: the last bin
    inside = g.op("And", g.op("GreaterOrEqual", flat, lo), g.op("LessOrEqual", flat, hi))
    pos = g.op("Where", inside, pos, const(g, [-1]))  # outside (and NaN): no bin
    hits = g.op("Equal", g.op("Unsqueeze", pos, const(g, [1])),
                g.op("Range", const(g, 0), const(g, bins), const(g, 1)))
    counts = g.op("ReduceSum", g.op("Cast", hits, to_i=7), const(g, [0]), keepdims_i=0)
    return g.op("CastLike", counts, x)


def _size0(g: Any, x: Any) -> Any:
    """Axis 0's size, a scalar (Gather of Shape: the exporter's folding ignores Shape's
    start and end attributes)."""
    return g.op("Gather", g.op("Shape", x), const(g, 0), axis_i=0)


def grouped_mm(g: Any, x: Any, weight: Any, offs: Any, bias: Any = None,
               out_dtype: Any = None) -> Any:
    """A mixture of experts' grouped product: rows ``offs[e-1]:offs[e]`` of ``x`` [S, K] times
    ``weight[e]`` [K, N]. Each row's expert is the count of offsets at or below its index;
    its weight is gathered and multiplied row by row ([S, 1, K] @ [S, K, N]; S x K x N
    memory); rows past the last offset are zero, as torch leaves them."""
    h = helper()
    if h._get_tensor_rank(x) != 2 or h._get_tensor_rank(weight) != 3 or h._is_none(offs) \
            or not h._is_none(bias):
        raise GraphError("ngdist's aten::_grouped_mm symbolic takes a 2-D input, 3-D "
                         "weights and offsets, without bias; export such a product yourself")
    rows = g.op("Range", const(g, 0), _size0(g, x), const(g, 1))
    ends = g.op("Cast", offs, to_i=7)
    after = g.op("GreaterOrEqual", g.op("Unsqueeze", rows, const(g, [1])),
                 g.op("Unsqueeze", ends, const(g, [0])))  # [S, E]: row past expert e's end
    expert = g.op("ReduceSum", g.op("Cast", after, to_i=7), const(g, [1]), keepdims_i=0)
    experts = _size0(g, weight)
    last = g.op("Sub", experts, const(g, 1))
    picked = g.op("Gather", weight, g.op("Min", expert, last), axis_i=0)  # [S, K, N]
    out = g.op("MatMul", g.op("Unsqueeze", x, const(g, [1])), picked)
    out = g.op("Squeeze", out, const(g, [1]))
    inside = g.op("Less", expert, experts)
    return g.op("Where", g.op("Unsqueeze", inside, const(g, [1])), out,
                g.op("CastLike", const(g, 0.0, np.float32), out))


def _grouped_mm_onnxscript(x: Any, weight: Any, offs: Any) -> Any:
    """:func:`grouped_mm` for the dynamo exporter (an ONNX Script function it traces)."""
    from onnxscript import opset18 as op

    def ints(*v: int) -> Any:
        return op.Constant(value_ints=list(v))

    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Range(zero, op.Gather(op.Shape(x), zero, axis=0), one)
    after = op.GreaterOrEqual(op.Unsqueeze(rows, ints(1)),
                              op.Unsqueeze(op.Cast(offs, to=7), ints(0)))
    expert = op.ReduceSum(op.Cast(after, to=7), ints(1), keepdims=0)
    experts = op.Gather(op.Shape(weight), zero, axis=0)
    picked = op.Gather(weight, op.Min(expert, op.Sub(experts, one)), axis=0)
    out = op.Squeeze(op.MatMul(op.Unsqueeze(x, ints(1)), picked), ints(1))
    inside = op.Unsqueeze(op.Less(expert, experts), ints(1))
    return op.Where(inside, out, op.CastLike(op.Constant(value_float=0.0), out))


def dynamo_translations() -> dict[Any, Callable[..., Any]]:
    """The dynamo exporter's translations ngdist adds: ``aten.detach`` (a marked
    stop-gradient) and Hugging Face's ``transformers::grouped_mm_fallback`` (what its MoE
    layers call under torch.export), where that op is registered in this process."""
    import torch

    table = stop_gradient_translations()
    try:
        table[torch.ops.transformers.grouped_mm_fallback.default] = _grouped_mm_onnxscript
    except (AttributeError, RuntimeError):
        pass  # transformers' MoE layers are not imported
    return table


def _pool_matrix(n: int, m: int) -> np.ndarray:
    """(m, n): row i averages torch's adaptive window of output i over n inputs."""
    out = np.zeros((m, n), np.float32)
    for i in range(m):
        start, end = (i * n) // m, math.ceil((i + 1) * n / m)
        out[i, start:end] = 1.0 / (end - start)
    return out


def _adaptive_avg_pool2d(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, x: Any, output_size: Any) -> Any:
        h = helper()
        sizes = h._get_tensor_sizes(x)
        out = h._maybe_get_const(output_size, "is")
        spatial = None if sizes is None or len(sizes) < 3 else sizes[-2:]
        if spatial is None or not all(isinstance(s, int) for s in spatial) or \
                not isinstance(out, (list, tuple)) or \
                all(s % o == 0 for s, o in zip(spatial, out)):
            return builtin(g, x, output_size)
        rows, cols = (_pool_matrix(s, o) for s, o in zip(spatial, out))
        import torch
        mh = g.op("CastLike", g.op("Constant", value_t=torch.from_numpy(rows)), x)
        mw = g.op("CastLike", g.op("Constant", value_t=torch.from_numpy(cols.T.copy())), x)
        return g.op("MatMul", g.op("MatMul", mh, x), mw)

    return symbolic


def _unfold(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.unfold(d, size, step)`` where axis d's extent is unknown at export: window
    starts ``range(0, (L - size) // step + 1) * step`` plus offsets ``range(size)``, one
    Gather along d ([.., windows, size, ..]), the offsets' axis moved last (torch's layout).
    A static extent keeps torch's symbolic."""
    def symbolic(g: Any, x: Any, dimension: Any, size: Any, step: Any) -> Any:
        h = helper()
        sizes, rank = h._get_tensor_sizes(x), h._get_tensor_rank(x)
        d, k, st = (h._get_const(v, "i", n) for v, n in ((dimension, "dimension"),
                                                          (size, "size"), (step, "step")))
        d = d % rank if rank else d
        if rank is None or (sizes is not None and isinstance(sizes[d], int)):
            return builtin(g, x, dimension, size, step)
        extent = g.op("Gather", g.op("Shape", x), const(g, d), axis_i=0)
        windows = g.op("Add", g.op("Div", g.op("Sub", extent, const(g, k)), const(g, st)),
                       const(g, 1))
        starts = g.op("Mul", g.op("Range", const(g, 0), windows, const(g, 1)),
                      const(g, st))
        idx = g.op("Add", g.op("Unsqueeze", starts, const(g, [1])),
                   g.op("Unsqueeze", g.op("Range", const(g, 0), const(g, k), const(g, 1)),
                        const(g, [0])))
        picked = g.op("Gather", x, idx, axis_i=d)  # axes d, d + 1: windows, offsets
        perm = [a for a in range(rank + 1) if a != d + 1] + [d + 1]
        return g.op("Transpose", picked, perm_i=perm)

    return symbolic


def _permute(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``permute`` with negative dims (``x.permute(0, -2, -1, 1)``: Hugging Face's Mamba-2
    mixers): counted from the end (the permutation's length is the rank), where torch's
    symbolic writes them into Transpose's ``perm`` as they are, which ONNX refuses (shape
    inference stops there, and every value after it has no rank)."""
    def symbolic(g: Any, x: Any, dims: Any) -> Any:
        perm = helper()._maybe_get_const(dims, "is")
        if not isinstance(perm, (list, tuple)) or all(d >= 0 for d in perm):
            return builtin(g, x, dims)
        return g.op("Transpose", x, perm_i=[int(d) % len(perm) for d in perm])

    return symbolic


def _movedim(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``movedim`` with negative dims (``x.movedim(-1, 2)``: Hugging Face Gemma 3n's audio
    attention): torch's symbolic indexes its permutation with them unchanged and writes -1
    into Transpose's ``perm``; here they count from the end, as torch counts them."""
    def symbolic(g: Any, x: Any, source: Any, destination: Any) -> Any:
        h = helper()
        rank = h._get_tensor_rank(x)
        src, dst = (h._maybe_get_const(v, "t") for v in (source, destination))
        if rank is None or h._is_value(src) or h._is_value(dst):
            return builtin(g, x, source, destination)
        src, dst = ([int(a) % rank for a in np.reshape(v, -1)] for v in (src, dst))
        perm = [-1] * rank
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter(a for a in range(rank) if a not in src)
        perm = [next(rest) if p < 0 else p for p in perm]
        return g.op("Transpose", x, perm_i=perm)

    return symbolic


def _repeat_interleave(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``repeat_interleave`` with a constant ``dim``: torch's symbolic (opset 13) makes a
    negative dim positive by ``dim += rank`` on the constant's own tensor, so every node that
    shares the traced constant (the tracer pools equal constants) reads the new value: Hugging
    Face Cohere's rotary table repeats along -1 on 3 axes, then its ``stack(dim=-1)`` on 4
    axes stacked along axis 2. The builtin is given a fresh constant of its own instead."""
    def symbolic(g: Any, x: Any, repeats: Any, dim: Any = None, output_size: Any = None
                 ) -> Any:
        h = helper()
        if dim is not None and not h._is_none(dim) and h._is_constant(dim):
            dim = const(g, int(h._get_const(dim, "i", "dim")))
        return builtin(g, x, repeats, dim, output_size)

    return symbolic


def _avg_pool2d(builtin: Callable[..., Any]) -> Callable[..., Any]:
    """``avg_pool2d`` whose one window covers the whole map (Hugging Face's EfficientNet pools
    with ``AvgPool2d(hidden_dim, ceil_mode=True)``: a kernel of 1280 on a 2x2 map): torch
    clips the window to the input and divides by what it covers, a global average, written
    as GlobalAveragePool (an AveragePool whose window exceeds its input has no gradient)."""
    def symbolic(g: Any, x: Any, kernel: Any, stride: Any, padding: Any, ceil_mode: Any,
                 count_include_pad: Any, divisor_override: Any = None) -> Any:
        h = helper()
        sizes = h._get_tensor_sizes(x)
        spatial = sizes[-2:] if sizes is not None and len(sizes) == 4 else None
        k, st, pad = (list(h._maybe_get_const(v, "is")) for v in (kernel, stride, padding))
        st = st or k
        covers = spatial is not None and all(isinstance(n, int) for n in spatial) and \
            not any(pad) and all(kk >= n and ss >= n for kk, ss, n in zip(k, st, spatial))
        if not covers or (divisor_override is not None and not h._is_none(divisor_override)):
            return builtin(g, x, kernel, stride, padding, ceil_mode, count_include_pad,
                           divisor_override)
        return g.op("GlobalAveragePool", x)

    return symbolic


def _cumsum(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, x: Any, dim: Any, dtype: Any = None) -> Any:
        from torch.onnx._internal.torchscript_exporter import _type_utils

        kind = _type_utils.JitScalarType.from_value(x, _type_utils.JitScalarType.UNDEFINED)
        h = helper()
        if kind in _promoted() and (dtype is None or h._is_none(dtype)):
            x = g.op("Cast", x, to_i=7)  # torch: a bool or integer cumsum is int64
        return builtin(g, x, dim, dtype)

    return symbolic


def _promoted() -> set[Any]:
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    j = t.JitScalarType
    return {j.BOOL, j.UINT8, j.INT8, j.INT16, j.INT}


_LENT: dict[str, Callable[[Callable[..., Any] | None], Callable[..., Any]]] = {
    "aten::expm1": lambda _: expm1,
    "aten::diff": lambda _: diff,
    "aten::histc": lambda _: histc,
    "aten::_grouped_mm": lambda _: grouped_mm,
    "aten::adaptive_avg_pool2d": _adaptive_avg_pool2d,
    "aten::cumsum": _cumsum,
    "aten::unfold": _unfold,
    "aten::permute": _permute,
    "aten::movedim": _movedim,
    "aten::avg_pool2d": _avg_pool2d,
    "aten::repeat_interleave": _repeat_interleave,
    "aten::as_strided": as_strided,
    "aten::col2im": col2im,
    "aten::scatter_reduce": scatter_reduce,
    "aten::index_add": index_add,
    "aten::detach": lambda _: stop_gradient,
    **{name: (lambda _, f=f: f) for name, f in SYMBOLICS.items()},  # torch_math's
    **WRAPS,
    **{name: (lambda _, f=f: f) for name, f in torch_complex.SYMBOLICS.items()},
    **torch_complex.WRAPS,
}
# operators whose torch symbolic is kept as the fallback of the lent one
_WRAPS = {"aten::adaptive_avg_pool2d", "aten::cumsum", "aten::unfold", "aten::permute",
          "aten::movedim", "aten::avg_pool2d", "aten::repeat_interleave", "aten::as_strided",
          "aten::col2im",
          "aten::scatter_reduce", "aten::index_add", "aten::detach", *WRAPS, *torch_complex.WRAPS}


@contextlib.contextmanager
def lent_symbolics(opset: int) -> Iterator[list[str]]:
    """The symbolics above registered at ``opset`` for the block (the names lent), each only
    where no custom symbolic is registered, and unregistered after it, also on error. torch
    registers its symbolics of opsets above 9 at its first export: done here first, so that a
    wrapped builtin is the one of ``opset``, not opset 9's."""
    import torch
    from torch.onnx._internal.torchscript_exporter import registration, utils

    utils._trigger_symbolic_function_registration()
    lent: list[str] = []
    absent = set(_LENT) - registration.registry.all_functions()
    try:
        for name, make in _LENT.items():
            group = registration.registry.get_function_group(name)
            current = None if group is None else group.get(opset)
            if name in _WRAPS:
                if current is None or (group is not None and group._functions.overridden(
                        _dispatched(group, opset))):
                    continue  # nothing to wrap, or the user's own symbolic: leave it
            elif current is not None:
                continue
            torch.onnx.register_custom_op_symbolic(name, make(current), opset)
            lent.append(name)
        with torch_complex.complex_checked():
            yield lent
    finally:
        for name in lent:
            torch.onnx.unregister_custom_op_symbolic(name, opset)
            if name in absent:  # the empty group registering made: gone too
                registration.registry._registry.pop(name, None)


def _dispatched(group: Any, opset: int) -> int:
    """The opset key of ``group`` that serves ``opset`` (torch's dispatch rule)."""
    from torch.onnx._internal.torchscript_exporter import registration

    return registration._dispatch_opset_version(opset, group._functions)
