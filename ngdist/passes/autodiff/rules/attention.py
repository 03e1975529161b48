"""Attention (opset 23+: what the dynamo exporter makes of F.scaled_dot_product_attention).

The probabilities P = softmax(scale Q K^T + bias) are taken again from Q and K (the op does
not return them); then dV = P^T dY, dP = dY V^T, dS = P (dP - rowsum(dP P)), dQ = scale dS K,
dK = scale dS^T Q, and a float attention mask (an additive bias, e.g. T5's relative
positions) gets dS summed to its shape. Grouped-query attention repeats K and V over the
query heads of a group and sums their gradients back. 3-D inputs [B, S, heads * D] are
viewed 4-D by q_num_heads / kv_num_heads. The causal mask of a node without a KV cache is
lower-triangular (query i attends keys j <= i).

Refused, naming the node: past_key / past_value (a KV cache), softcap, sliding windows, and a
gradient through present_key, present_value or qk_matmul_output.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext, attr, register
from ngdist.passes.autodiff.rules._common import known_rank


def _check(node: ir.Node, gys) -> None:
    inputs = list(node.inputs) + [None] * 7
    refused = [("past_key/past_value (a KV cache)", inputs[4] is not None or
                inputs[5] is not None),
               ("nonpad_kv_seqlen", inputs[6] is not None),
               ("softcap", bool(attr(node, "softcap", 0.0))),
               ("a sliding window", attr(node, "left_window_size", -1) not in (-1, None) or
                attr(node, "right_window_size", -1) not in (-1, None)),
               ("a gradient through present_key, present_value or qk_matmul_output",
                any(g is not None for g in list(gys)[1:]))]
    bad = [name for name, hit in refused if hit]
    if bad:
        raise ValueError(f"Attention '{node.name}' with {', '.join(bad)} is not "
                         "differentiated; export the attention without them")


def _heads(ctx: GradContext, v: ir.Value, heads: int | None) -> ir.Value:
    """[B, S, heads * D] -> [B, heads, S, D] (a 4-D value is returned as it is)."""
    if known_rank(v, "Attention input") == 4:
        return v
    split = ctx.op("Reshape", v, ctx.ints([0, 0, heads, -1]))
    return ctx.op("Transpose", split, perm=[0, 2, 1, 3])


def _back(ctx: GradContext, g: ir.Value, like: ir.Value) -> ir.Value:
    """A [B, heads, S, D] gradient in the layout of ``like``."""
    if known_rank(like, "Attention input") == 4:
        return g
    return ctx.op("Reshape", ctx.op("Transpose", g, perm=[0, 2, 1, 3]), ctx.op("Shape", like))


def _repeat_heads(ctx, v, groups: ir.Value):
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D], each head repeated ``groups`` times."""
    shape = ctx.op("Shape", v)
    five = ctx.op("Unsqueeze", v, ctx.ints([2]))
    target = ctx.op("Concat", ctx.op("Slice", shape, ctx.ints([0]), ctx.ints([2])), groups,
                    ctx.op("Slice", shape, ctx.ints([2]), ctx.ints([4])), axis=0)
    tiled = ctx.op("Expand", five, target)
    return ctx.op("Reshape", tiled, ctx.op("Concat", ctx.ints([0, -1]), ctx.op(
        "Slice", shape, ctx.ints([2]), ctx.ints([4])), axis=0))


def _sum_groups(ctx, g, like, groups: ir.Value):
    """The inverse of _repeat_heads for gradients: [B, Hkv * groups, S, D] summed per group."""
    shape = ctx.op("Shape", like)
    target = ctx.op("Concat", ctx.op("Slice", shape, ctx.ints([0]), ctx.ints([2])), groups,
                    ctx.op("Slice", shape, ctx.ints([2]), ctx.ints([4])), axis=0)
    return ctx.op("ReduceSum", ctx.op("Reshape", g, target), ctx.ints([2]), keepdims=0)


def _scores(ctx, node, q, k):
    """(scale, probabilities P [B, H, Sq, Skv], masked) from Q and K (4-D, K repeated)."""
    scale = attr(node, "scale")
    if scale is None:  # 1 / sqrt(head size)
        d = ctx.op("CastLike", ctx.op("Shape", q, start=3, end=4), q)
        scale_v = ctx.op("Reciprocal", ctx.op("Sqrt", d))
    else:
        scale_v = ctx.scalar(float(scale), q)
    s = ctx.op("Mul", ctx.op("MatMul", q, ctx.op("Transpose", k, perm=[0, 1, 3, 2])), scale_v)
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    neg_inf = ctx.scalar(float("-inf"), s)
    if mask is not None:
        s = ctx.op("Where", mask, s, neg_inf) if mask.dtype == ir.DataType.BOOL else \
            ctx.op("Add", s, mask)
    if attr(node, "is_causal", 0):
        square = ctx.op("Shape", s, start=2, end=4)
        ones = ctx.op("ConstantOfShape", square, value=ir.tensor(np.ones(1, np.float32)))
        keep = ctx.op("Cast", ctx.op("Trilu", ones, upper=0), to=ir.DataType.BOOL)
        s = ctx.op("Where", keep, s, neg_inf)
    return scale_v, ctx.op("Softmax", s, axis=-1)


@register("Attention")
def attention(ctx, node, gys):
    _check(node, gys)
    q_in, k_in, v_in = node.inputs[:3]
    q = _heads(ctx, q_in, attr(node, "q_num_heads"))
    k, v = (_heads(ctx, x, attr(node, "kv_num_heads")) for x in (k_in, v_in))
    groups = ctx.op("Div", ctx.op("Shape", q, start=1, end=2), ctx.op("Shape", k, start=1,
                                                                       end=2))
    kr, vr = _repeat_heads(ctx, k, groups), _repeat_heads(ctx, v, groups)
    scale, p = _scores(ctx, node, q, kr)
    g = _heads(ctx, gys[0], attr(node, "q_num_heads"))
    out = [None] * len(node.inputs)
    dp = ctx.op("MatMul", g, ctx.op("Transpose", vr, perm=[0, 1, 3, 2]))
    ds = ctx.op("Mul", p, ctx.op("Sub", dp, ctx.op("ReduceSum", ctx.op("Mul", dp, p),
                                                   ctx.ints([-1]), keepdims=1)))
    if ctx.needs(v_in):
        dv = ctx.op("MatMul", ctx.op("Transpose", p, perm=[0, 1, 3, 2]), g)
        out[2] = _back(ctx, _sum_groups(ctx, dv, v, groups), v_in)
    if ctx.needs(q_in):
        out[0] = _back(ctx, ctx.op("Mul", ctx.op("MatMul", ds, kr), scale), q_in)
    if ctx.needs(k_in):
        dk = ctx.op("Mul", ctx.op("MatMul", ctx.op("Transpose", ds, perm=[0, 1, 3, 2]), q),
                    scale)
        out[1] = _back(ctx, _sum_groups(ctx, dk, k, groups), k_in)
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    if mask is not None and ctx.needs(mask):
        out[3] = ctx.unbroadcast(ds, mask, grad_rank=4)
    return out
