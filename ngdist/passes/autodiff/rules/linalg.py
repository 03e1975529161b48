"""Matrix products: Gemm and MatMul (batched, broadcast, 1-D operands), and the DFT (a
linear map: its gradient is the adjoint transform).

The weight gradient of a batched MatMul with a 2-D right operand (``[B, M, K] @ [K, N]``, a
linear layer applied to sequences) is one Gemm over the B*M rows, not B products and a
ReduceSum over a [B, K, N] intermediate.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext, attr, register
from ngdist.passes.autodiff.rules._common import known_rank


@register("Gemm")
def gemm(ctx, node, gys):
    (g,) = gys
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
    if (ta, tb) == (0, 0):
        ga = ctx.op("Gemm", g, b, transB=1, alpha=alpha)
        gb = ctx.op("Gemm", a, g, transA=1, alpha=alpha)
    elif (ta, tb) == (0, 1):
        ga = ctx.op("Gemm", g, b, alpha=alpha)
        gb = ctx.op("Gemm", g, a, transA=1, alpha=alpha)
    elif (ta, tb) == (1, 0):
        ga = ctx.op("Gemm", b, g, transB=1, alpha=alpha)
        gb = ctx.op("Gemm", a, g, alpha=alpha)
    else:
        ga = ctx.op("Gemm", b, g, transA=1, transB=1, alpha=alpha)
        gb = ctx.op("Gemm", g, a, transA=1, transB=1, alpha=alpha)
    grads = [ga, gb]
    if c is not None:
        gc = g if beta == 1.0 else ctx.op("Mul", g, ctx.const([[beta]], like=g))
        cdims = list(c.shape.dims) if c.shape is not None else []
        if len(cdims) == 1 and isinstance(cdims[0], int) and cdims[0] != 1:
            grads.append(ctx.op("ReduceSum", gc, ctx.ints([0]), keepdims=0))  # a bias row
        else:
            grads.append(ctx.unbroadcast(gc, c, grad_rank=2))
    return grads


def _swap_last(ctx, v, rank):
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return ctx.op("Transpose", v, perm=perm)


def _rows_of(ctx: GradContext, v: ir.Value) -> ir.Value:
    """The shape [-1, last dim of v]: v as a matrix of its rows."""
    last = list(v.shape.dims)[-1] if v.shape is not None and v.shape.rank() else None
    if isinstance(last, int):
        return ctx.ints([-1, last])
    return ctx.op("Concat", ctx.ints([-1]), ctx.op("Shape", v, start=-1), axis=0)


@register("MatMul")
def matmul(ctx, node, gys):
    (g,) = gys
    a, b = node.inputs
    ra, rb = known_rank(a, "MatMul operand A"), known_rank(b, "MatMul operand B")
    a2 = a if ra >= 2 else ctx.op("Unsqueeze", a, ctx.ints([0]))
    b2 = b if rb >= 2 else ctx.op("Unsqueeze", b, ctx.ints([1]))
    g2 = g
    if ra == 1:
        g2 = ctx.op("Unsqueeze", g2, ctx.ints([-1 if rb == 1 else -2]))
    if rb == 1:
        g2 = ctx.op("Unsqueeze", g2, ctx.ints([-1]))
    rout = max(ra, rb, 2)
    ga = ctx.op("MatMul", g2, _swap_last(ctx, b2, max(rb, 2)))
    if rb == 2 and ra > 2:  # a weight under batched rows: one product over every row
        rows = ctx.op("Reshape", a, _rows_of(ctx, a))  # [B*M, K]
        return [ga, ctx.op("Gemm", rows, ctx.op("Reshape", g, _rows_of(ctx, g)), transA=1)]
    gb = ctx.op("MatMul", _swap_last(ctx, a2, max(ra, 2)), g2)
    if not (ra == rb == 2):
        ga = ctx.unbroadcast(ga, a2, grad_rank=rout) if ra >= 2 else \
            ctx.op("Reshape", ctx.op("ReduceSum", ga, ctx.ints(list(range(rout - 1))), keepdims=0),
                   ctx.op("Shape", a))
        gb = ctx.unbroadcast(gb, b2, grad_rank=rout) if rb >= 2 else \
            ctx.op("Reshape", ctx.op("ReduceSum", gb, ctx.ints(list(range(rout - 2)) + [rout - 1]),
                                     keepdims=0), ctx.op("Shape", b))
    return [ga, gb]


@register("DFT")
def dft(ctx: GradContext, node: ir.Node, gys):
    """A DFT is linear: y = F x (F_kj = exp(-2 pi i jk / n), unnormalised) has the gradient
    F^H g = n * IDFT(g), and the inverse transform's (F^H / n) is DFT(g) / n (torch.fft.fft,
    ifft, fftn: FNet's token mixing). Complex values are pairs in the last axis; a real
    input's gradient is the real part. One-sided (real-to-half-spectrum) transforms and a
    dft_length that pads or trims are refused."""
    (g,) = gys
    x = node.inputs[0]
    if not ctx.needs(x):
        return [None] * len(node.inputs)
    if attr(node, "onesided", 0):
        raise ValueError(f"DFT node {node.name!r}: a one-sided DFT (torch.fft.rfft) has no "
                         "gradient rule; use torch.fft.fft and keep half the spectrum")
    given = [v for v in node.inputs[1:2] if v is not None]
    axis_input = node.inputs[2] if len(node.inputs) > 2 else None
    axis = attr(node, "axis", None)
    if axis_input is not None:
        value = ctx.constant_value(axis_input)
        if value is None:
            raise ValueError(f"DFT node {node.name!r}: its axis is computed at run time; "
                             "export with a constant dim")
        axis = int(np.asarray(value).reshape(-1)[0])
    elif axis is None:
        axis = -2 if ctx.opset >= 20 else 1
    extent = ctx.op("Shape", x, start=axis, end=axis + 1 if axis != -1 else None)
    for length in given:
        n = ctx.constant_value(length)
        dim = x.shape[axis] if x.shape is not None else None
        if n is None or not isinstance(dim, int) or int(np.asarray(n).reshape(-1)[0]) != dim:
            raise ValueError(f"DFT node {node.name!r}: a dft_length that pads or trims the "
                             "signal has no gradient rule; pad or slice before the FFT")
    inverse = attr(node, "inverse", 0)
    back = ctx.op("DFT", g, *([node.inputs[1]] if len(node.inputs) > 1 else []),
                  *([axis_input] if axis_input is not None else []),
                  inverse=1 - inverse, onesided=0,
                  axis=attr(node, "axis", None))
    scale = ctx.op("CastLike", extent, g)
    back = ctx.op("Div" if inverse else "Mul", back, scale)
    real = ctx.op("Slice", back, ctx.ints([0]), ctx.op("Shape", x, start=-1), ctx.ints([-1]))
    return [real] + [None] * (len(node.inputs) - 1)
