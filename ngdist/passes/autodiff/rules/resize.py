"""Resize (nearest, linear, cubic; every coordinate transformation, antialias, roi).

Resize is linear in X and separable: each resized axis is a matrix A (output x input
positions) applied along it, for every mode ONNX defines. The rule builds A for each axis
from ONNX's reference Resize on the identity (so its semantics are the op's own, not a
re-derivation) and applies A^T to the gradient with one MatMul per axis (a block sum where A
repeats each input a whole number of times: nearest upsampling). Where the axis's input
extent and its scale (or output size) are constants, A is a constant; where either is known
only at run time (``F.interpolate(size=x.shape[2:])`` under a symbolic batch), A is built
at run time by the runtime's own Resize of an identity matrix [n, n] to [n, m], n read from
Shape(X) and m from Shape(Y) (or the constant scale): the forward op's own interpolation.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from ngdist.passes.autodiff.registry import attr, register
from ngdist.passes.autodiff.rules._common import dims

# the attributes that shape the interpolation matrix (extrapolation_value is an offset, not
# part of the linear map: the matrix is built with 0)
_MATRIX_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                 "nearest_mode", "antialias")


def axis_matrix(node, n: int, *, scale: float | None, size: int | None,
                roi: tuple[float, float] | None) -> np.ndarray:
    """M [n, m]: row i is the Resize (of ``node``'s kind) of the i-th unit vector along one
    axis of n positions, to ``size`` positions or by ``scale``."""
    kwargs = {k: attr(node, k) for k in _MATRIX_ATTRS if attr(node, k) is not None}
    kwargs = {k: v.decode() if isinstance(v, bytes) else v for k, v in kwargs.items()}
    inputs = ["x", "roi" if roi is not None else "", "scales" if scale is not None else ""]
    feeds: dict[str, np.ndarray] = {"x": np.eye(n)}
    if roi is not None:
        feeds["roi"] = np.asarray(roi, np.float32)
    if scale is not None:
        feeds["scales"] = np.asarray([scale], np.float32)
    else:
        inputs.append("sizes")
        feeds["sizes"] = np.asarray([size], np.int64)
    resize = helper.make_node("Resize", inputs, ["y"], axes=[1], **kwargs)
    graph = helper.make_graph(
        [resize], "axis", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(
            v.dtype), list(v.shape)) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    return np.asarray(ReferenceEvaluator(model).run(None, feeds)[0], np.float64)


def _plan(ctx, node) -> list[tuple[int, dict]]:
    """(axis, axis_matrix arguments) of every axis the Resize changes; ``n`` is None where the
    input extent is known only at run time, ``scale`` and ``size`` both None where the output
    size is (the matrix is then built at run time, :func:`_runtime_matrix`)."""
    x, mode = node.inputs[0], attr(node, "mode", "nearest")
    what = f"Resize (mode {mode!r})"
    if ctx.opset < 11:
        raise ValueError(f"{what} before opset 11 is not differentiated; export with opset 11 "
                         "or newer")
    if attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        raise ValueError(f"{what} with keep_aspect_ratio_policy="
                         f"{attr(node, 'keep_aspect_ratio_policy')!r} is not differentiated; "
                         "give scales or sizes for every axis (stretch)")
    sizes_in = dims(x, "Resize input")
    rank = len(sizes_in)
    axes = [a % rank for a in (attr(node, "axes") or range(rank))]
    inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
    roi = ctx.constant_value(inputs[1])
    crop = attr(node, "coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize"
    if crop and roi is None:
        raise ValueError(f"{what} with tf_crop_and_resize needs a constant roi to differentiate")
    scales = ctx.constant_value(inputs[2])
    if scales is None or scales.size == 0:
        scales = None
        sizes = ctx.constant_value(inputs[3])
        if sizes is None:  # the output's static extents, None where known at run time only
            out = node.outputs[0].shape
            sizes = [out.dims[a] if out is not None and isinstance(out.dims[a], int) else None
                     for a in axes]
    plan = []
    for k, a in enumerate(axes):
        n = sizes_in[a]
        scale = float(scales[k]) if scales is not None else None
        size = None if scales is not None or sizes[k] is None else int(sizes[k])
        if not crop and (scale == 1.0 or (size is not None and size == n)
                         or (scale is None and size is None and _same_extent(node, a))):
            continue  # the identity
        plan.append((a, dict(n=n, scale=scale, size=size,
                             roi=(float(roi[k]), float(roi[k + len(axes)])) if crop else None)))
    return plan


def _same_extent(node, axis: int) -> bool:
    """Whether the Resize's output has its input's extent on ``axis`` by shape inference (the
    same symbolic dimension): that axis is not resized."""
    x, y = node.inputs[0].shape, node.outputs[0].shape
    if x is None or y is None:
        return False
    a, b = x.dims[axis], y.dims[axis]
    return isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim) and \
        a.value is not None and a.value == b.value


def _extent(ctx, v: ir.Value, axis: int) -> ir.Value:
    """``v``'s extent on ``axis``, a 1-element int64 tensor read at run time: a Gather of
    Shape, not a Shape with ``start``/``end``, which onnxruntime's shape inference (given a
    segment's input shapes) took for an empty tensor and then refused the Resize it sizes."""
    return ctx.op("Gather", ctx.op("Shape", v), ctx.ints([axis]), axis=0)


def _runtime_matrix(ctx, node, g, axis: int, spec: dict) -> ir.Value:
    """M [n, m] of one axis (as :func:`axis_matrix`) computed at run time: the Resize of the
    node's kind applied to an identity [n, n] (n read from Shape(X)) along its second axis, to
    the output's extent on ``axis`` (read from Shape(Y)) or by the constant scale."""
    x, y = node.inputs[0], node.outputs[0]
    n = ctx.ints([spec["n"]]) if spec["n"] is not None else _extent(ctx, x, axis)
    zeros = ctx.op("ConstantOfShape", ctx.op("Concat", n, n, axis=0),
                   value=ir.tensor(np.zeros(1, np.float32)))
    eye = ctx.op("CastLike", ctx.op("EyeLike", zeros), g)
    roi = spec["roi"]
    roi_v = ctx.const(np.asarray([] if roi is None else [0.0, roi[0], 1.0, roi[1]], np.float32))
    kwargs = {k: attr(node, k) for k in _MATRIX_ATTRS if attr(node, k) is not None}
    kwargs = {k: v.decode() if isinstance(v, bytes) else v for k, v in kwargs.items()}
    if spec["scale"] is not None:
        scales = ctx.const(np.asarray([1.0, spec["scale"]], np.float32))
        return ctx.op("Resize", eye, roi_v, scales, **kwargs)
    m = ctx.ints([spec["size"]]) if spec["size"] is not None else _extent(ctx, y, axis)
    return ctx.op("Resize", eye, roi_v, ctx.const(np.zeros(0, np.float32)),
                  ctx.op("Concat", n, m, axis=0), **kwargs)


@register("Resize")
def resize(ctx, node, gys):
    g = gys[0]
    rank = len(dims(node.inputs[0], "Resize input"))
    for axis, spec in _plan(ctx, node):
        if spec["n"] is None or (spec["scale"] is None and spec["size"] is None):
            mat = _runtime_matrix(ctx, node, g, axis, spec)
            g = _apply(ctx, g, mat, None, axis, rank)
            continue
        mat = axis_matrix(node, **spec)  # [n, out]
        n, out = mat.shape
        if out % n == 0 and np.array_equal(mat, np.kron(np.eye(n), np.ones((1, out // n)))):
            # each input repeated out/n times in a row (nearest, integer scale): sum the
            # blocks, O(out) where the product costs O(n out)
            view = ctx.op("Concat", ctx.op("Shape", g, start=0, end=axis),
                          ctx.ints([n, out // n]), ctx.op("Shape", g, start=axis + 1), axis=0)
            g = ctx.op("ReduceSum", ctx.op("Reshape", g, view), ctx.ints([axis + 1]),
                       keepdims=0)
            continue
        g = _apply(ctx, g, ctx.const(mat, like=g),
                   ctx.const(np.ascontiguousarray(mat.T), like=g), axis, rank)
    return [g, None, None, None]


def _apply(ctx, g, mat, mat_t, axis: int, rank: int):
    """M [n, out] applied to ``g`` along ``axis`` (of extent out): the gradient [.., n, ..];
    ``mat_t`` is M^T, or None to transpose M at run time."""
    if axis == rank - 2:  # M @ g [..., out, w]
        return ctx.op("MatMul", mat, g)
    if mat_t is None:
        mat_t = ctx.op("Transpose", mat, perm=[1, 0])
    perm = [*range(axis), *range(axis + 1, rank), axis]  # the axis last: g @ M^T
    moved = g if axis == rank - 1 else ctx.op("Transpose", g, perm=perm)
    moved = ctx.op("MatMul", moved, mat_t)
    return moved if axis == rank - 1 else \
        ctx.op("Transpose", moved, perm=np.argsort(perm).tolist())
