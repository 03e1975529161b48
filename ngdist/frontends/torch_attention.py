"""ONNX export of ``torch.nn.functional.scaled_dot_product_attention`` in every form Hugging
Face models call it with, for the TorchScript exporter.

torch 2.13's own symbolic (``symbolic_opset14.scaled_dot_product_attention``) refuses grouped
key/value heads (``enable_gqa=True``, the default path of Hugging Face LLaMA/Mistral/Qwen
under ``attn_implementation="sdpa"``), builds its masks from float32 constants (a float64
model fails type checking) and exports ``dropout_p`` as an inference-mode Dropout (no
dropout at all). :func:`sdpa_export` registers, for the duration of one export, a symbolic
that writes torch's math formula out in plain ONNX ops, each with a gradient rule:

* grouped heads: key and value ``[..., Hkv, S, D]`` are repeated ``Hq / Hkv`` times along the
  head axis (``Unsqueeze -> Expand -> Reshape``, torch's ``repeat_interleave``), so their
  gradients are the sums over each group of query heads;
* ``scores = (Q @ K^T) * scale`` with ``scale = 1 / sqrt(D)`` unless given, in Q's dtype (a
  constant, or computed from Q's shape where the exporter does not know D);
* ``is_causal``: a boolean ``row >= column`` mask from two ``Range`` (top-left aligned, torch's
  ``tril``); a boolean ``attn_mask`` (or the causal one): ``Where(mask, scores, -inf)``, and
  after the Softmax rows masked entirely give 0 instead of NaN (torch's safe softmax); a float
  ``attn_mask`` is added to the scores (T5's position bias, which is trained, gets its
  gradient through that Add);
* ``dropout_p > 0``: a training-mode Dropout on the attention weights;
* ``Softmax(axis=-1)``, then ``@ V``.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

_OP = "aten::scaled_dot_product_attention"


def _const(g: Any, value: Any, dtype: Any) -> Any:
    import torch

    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _dim(g: Any, shape: Any, index: int) -> Any:
    """``shape[index:index + 1]`` as a 1-D int64 value."""
    import torch

    end = index + 1 if index != -1 else 2 ** 62
    return g.op("Slice", shape, _const(g, [index], torch.int64), _const(g, [end], torch.int64))


def _repeat_heads(g: Any, kv: Any, groups: Any, rank: int) -> Any:
    """``kv.repeat_interleave(groups, dim=-3)``: each key/value head once per query head."""
    import torch

    shape = g.op("Shape", kv)
    expanded = g.op("Expand", g.op("Unsqueeze", kv, _const(g, [rank - 2], torch.int64)),
                    g.op("Concat", _const(g, [1] * (rank - 2), torch.int64), groups,
                         _const(g, [1, 1], torch.int64), axis_i=0))
    heads = g.op("Mul", _dim(g, shape, rank - 3), groups)
    target = g.op("Concat", g.op("Slice", shape, _const(g, [0], torch.int64),
                                 _const(g, [rank - 3], torch.int64)),
                  heads, _dim(g, shape, rank - 2), _dim(g, shape, rank - 1), axis_i=0)
    return g.op("Reshape", expanded, target)


def _causal_mask(g: Any, query: Any, key: Any) -> Any:
    """Boolean ``[L, S]``: True where column <= row (torch's ``ones(L, S).tril()``)."""
    import torch

    one = _const(g, 1, torch.int64)
    zero = _const(g, 0, torch.int64)
    squeeze_axes = _const(g, [0], torch.int64)
    length_q = g.op("Squeeze", _dim(g, g.op("Shape", query), -2), squeeze_axes)
    length_k = g.op("Squeeze", _dim(g, g.op("Shape", key), -2), squeeze_axes)
    rows = g.op("Unsqueeze", g.op("Range", zero, length_q, one), _const(g, [1], torch.int64))
    cols = g.op("Range", zero, length_k, one)
    return g.op("GreaterOrEqual", rows, cols)


def _symbolic(g: Any, query: Any, key: Any, value: Any, attn_mask: Any = None,
              dropout_p: Any = None, is_causal: Any = None, scale: Any = None,
              enable_gqa: Any = None) -> Any:
    import torch
    from torch.onnx._internal.torchscript_exporter import _type_utils, symbolic_helper

    def const_arg(v: Any, kind: str, default: Any) -> Any:
        return default if v is None or symbolic_helper._is_none(v) else \
            symbolic_helper._maybe_get_const(v, kind)

    dropout = float(const_arg(dropout_p, "f", 0.0))
    causal = bool(const_arg(is_causal, "b", False))
    gqa = bool(const_arg(enable_gqa, "b", False))
    has_mask = attn_mask is not None and not symbolic_helper._is_none(attn_mask)
    if causal and has_mask:
        raise ValueError("scaled_dot_product_attention: is_causal=True and an attn_mask "
                         "cannot be given together (torch refuses it too)")
    dtype = _type_utils.JitScalarType.from_value(query).dtype()
    rank = symbolic_helper._get_tensor_rank(query)
    if rank is None or rank < 3:
        raise ValueError("scaled_dot_product_attention export needs query/key/value of known "
                         "rank >= 3 ([..., heads, length, head_dim])")
    if gqa:
        groups = g.op("Div", _dim(g, g.op("Shape", query), rank - 3),
                      _dim(g, g.op("Shape", key), rank - 3))
        key, value = (_repeat_heads(g, t, groups, rank) for t in (key, value))
    scale_value = const_arg(scale, "f", None)
    if scale_value is None:
        sizes = symbolic_helper._get_tensor_sizes(query) or [None]
        if sizes[-1] is not None:
            scale_value = 1.0 / math.sqrt(sizes[-1])
    if scale_value is None:  # head size known only at run time: 1 / sqrt(D) in Q's dtype
        head = g.op("Cast", _dim(g, g.op("Shape", query), -1),
                    to_i=_type_utils.JitScalarType.from_value(query).onnx_type())
        scale_of = g.op("Reciprocal", g.op("Sqrt", head))
    else:
        scale_of = _const(g, float(scale_value), dtype)
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    scores = g.op("Mul", g.op("MatMul", query, g.op("Transpose", key, perm_i=perm)), scale_of)
    if causal:
        attn_mask, has_mask = _causal_mask(g, query, key), True
    boolean = has_mask and \
        _type_utils.JitScalarType.from_value(attn_mask) == _type_utils.JitScalarType.BOOL
    if boolean:
        scores = g.op("Where", attn_mask, scores, _const(g, -math.inf, dtype))
    elif has_mask:
        scores = g.op("Add", scores, attn_mask)
    weights = g.op("Softmax", scores, axis_i=-1)
    if boolean:  # a row masked entirely: 0 (torch's safe softmax), not NaN
        weights = g.op("Where", g.op("IsNaN", weights), _const(g, 0.0, dtype), weights)
    if dropout > 0.0:
        weights, _ = g.op("Dropout", weights, _const(g, dropout, dtype),
                          _const(g, True, torch.bool), outputs=2)  # the mask: for the rule
    return g.op("MatMul", weights, value)


@contextlib.contextmanager
def sdpa_export(opset: int) -> Iterator[None]:
    """While the block runs, the TorchScript exporter writes ``scaled_dot_product_attention``
    out in plain ONNX ops (grouped heads, causal and boolean/float masks, dropout); torch's
    own symbolic is back afterwards."""
    import torch

    torch.onnx.register_custom_op_symbolic(_OP, _symbolic, opset)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic(_OP, opset)
