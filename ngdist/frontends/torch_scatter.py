"""``aten::scatter_reduce`` and ``aten::index_add`` for the TorchScript exporter (lent by
``frontends/torch_symbolics.py``): torch's own ``scatter_reduce`` symbolic refuses
``include_self=False`` and ``reduce="mean"`` (Hugging Face BLT pools its patches with ``amax``
and include_self False), and wraps the scatter in two If nodes for a rank-0 input; its
``index_add`` scatters without reduction and adds ``self`` after, so of a repeated index only
one row lands (Hugging Face JetMoE's attention experts merge each token's top-k outputs so),
and refuses ``alpha``. Here ``index_add`` is one ScatterElements with reduction add, the
index broadcast over the other axes, ``source`` times ``alpha`` where one is given.

Every reduction (sum, prod, amax, amin, mean), with or without ``self``, in ScatterElements:

* without ``self``: the targeted positions of ``self`` are first overwritten with the
  reduction's identity (0, 1, the lowest or highest value of the type; a ScatterElements
  without reduction, which also gives ``self`` no gradient there, as torch), then the
  updates are scattered with the reduction; untouched positions keep ``self``;
* ``mean``: the sum divided by the count of the values reduced (``self`` counted when
  included; untouched positions divide by 1), floored for integer types as torch does;
* ``src`` is read over ``index``'s extent only (a Slice where the shapes may differ), as
  torch reads it.

Gradients come from the ScatterElements rules (passes/autodiff/rules/indexing.py): amax/amin
share a position's gradient equally among its values equal to the result, as torch. Where an
excluded ``self`` equals the result at a targeted position, torch's backward counts it among
the ties anyway (its gradient there is not the derivative of the values it returns); ngdist
gives the derivative. A ``self`` of unknown or zero rank, or of type bool, is left to torch's
symbolic.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ngdist.frontends.torch_math import const, helper

_ONNX_REDUCTION = {"sum": "add", "mean": "add", "prod": "mul", "amax": "max", "amin": "min"}


def scatter_reduce(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, x: Any, dim: Any, index: Any, src: Any, reduce: Any,
                 include_self: Any = True) -> Any:
        h = helper()
        rank = h._get_tensor_rank(x)
        kind = _dtype(x)
        if not rank or kind is None or kind == np.bool_:
            return builtin(g, x, dim, index, src, reduce, include_self)
        how = h._get_const(reduce, "s", "reduce")
        keep = bool(h._get_const(include_self, "b", "include_self"))
        axis = int(h._get_const(dim, "i", "dim")) % rank
        src = _over_index(g, src, index, rank)
        base = x if keep else g.op("ScatterElements", x, index, g.op(
            "CastLike", g.op("ConstantOfShape", g.op("Shape", index),
                             value_t=_identity(how, kind)), x), axis_i=axis)
        out = g.op("ScatterElements", base, index, src, axis_i=axis,
                   reduction_s=_ONNX_REDUCTION[how])
        if how != "mean":
            return out
        ones = g.op("CastLike", g.op("ConstantOfShape", g.op("Shape", index),
                                     value_t=_tensor(1, kind)), x)
        start = g.op("CastLike", const(g, 1 if keep else 0), x)
        counts = g.op("ScatterElements", g.op("Expand", start, g.op("Shape", x)), index, ones,
                      axis_i=axis, reduction_s="add")
        counts = g.op("Max", counts, g.op("CastLike", const(g, 1), x))
        if np.issubdtype(kind, np.floating):
            return g.op("Div", out, counts)
        return g.op("Div", g.op("Sub", out, g.op("Mod", out, counts)), counts)  # floored

    return symbolic


def index_add(builtin: Callable[..., Any]) -> Callable[..., Any]:
    def symbolic(g: Any, x: Any, dim: Any, index: Any, source: Any, alpha: Any = None) -> Any:
        h = helper()
        rank, rank_source = h._get_tensor_rank(x), h._get_tensor_rank(source)
        if not rank or rank_source is None or not h._is_constant(dim):
            return builtin(g, x, dim, index, source, alpha)
        axis = int(h._get_const(dim, "i", "dim")) % rank
        if rank_source < rank:  # a 0-dim source of a 1-dim self
            source = g.op("Reshape", source, const(g, [1] * rank))
        if alpha is not None and not h._is_none(alpha):
            scale = h._maybe_get_const(alpha, "f")
            if not (isinstance(scale, (int, float)) and scale == 1):
                source = g.op("Mul", source, g.op("CastLike", alpha if h._is_value(alpha)
                                                  else const(g, scale, np.float64), source))
        shape = [1] * rank
        shape[axis] = -1
        spread = g.op("Expand", g.op("Reshape", index, const(g, shape)), g.op("Shape", source))
        return g.op("ScatterElements", x, spread, source, axis_i=axis, reduction_s="add")

    return symbolic


def _dtype(x: Any) -> Any:
    """The numpy type of the exported value ``x`` (None where the exporter has none)."""
    from torch.onnx._internal.torchscript_exporter import _type_utils as t

    kind = t.JitScalarType.from_value(x, t.JitScalarType.UNDEFINED)
    if kind == t.JitScalarType.UNDEFINED:
        return None
    if kind == t.JitScalarType.BFLOAT16:
        return np.float32  # the identity's value only: cast like x
    import torch
    return torch.empty(0, dtype=kind.dtype()).numpy().dtype.type


def _identity(how: str, kind: Any) -> Any:
    """The reduction's identity in ``kind``, as a one-element tensor (ConstantOfShape's)."""
    if how in ("amax", "amin"):
        info = np.finfo(kind) if np.issubdtype(kind, np.floating) else np.iinfo(kind)
        low, high = (-np.inf, np.inf) if np.issubdtype(kind, np.floating) else \
            (info.min, info.max)
        return _tensor(low if how == "amax" else high, kind)
    return _tensor(1 if how == "prod" else 0, kind)


def _tensor(value: Any, kind: Any) -> Any:
    import torch
    return torch.tensor(np.full(1, value, kind if kind != np.float16 else np.float32))


def _over_index(g: Any, src: Any, index: Any, rank: int) -> Any:
    """``src`` sliced to ``index``'s extent (as is where both shapes are the same)."""
    h = helper()
    sizes = h._get_tensor_sizes(src), h._get_tensor_sizes(index)
    if sizes[0] is not None and sizes[0] == sizes[1] and all(isinstance(n, int) and n >= 0
                                                              for n in sizes[0]):
        return src
    return g.op("Slice", src, const(g, [0] * rank), g.op("Shape", index),
                const(g, list(range(rank))))
