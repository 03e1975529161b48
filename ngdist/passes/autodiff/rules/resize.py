"""Resize (nearest, linear, cubic; every coordinate transformation, antialias, roi).

Resize is linear in X and separable: each resized axis is a matrix A (output x input
positions) applied along it, for every mode ONNX defines. The rule builds A for each axis
from ONNX's reference Resize on the identity (so its semantics are the op's own, not a
re-derivation) and applies A^T to the gradient with one MatMul per axis (a block sum where A
repeats each input a whole number of times: nearest upsampling). That needs the
sizes of the resized axes and the scales (or output sizes) as constants; a Resize whose
sizes are known only at run time is refused, naming its mode.
"""
from __future__ import annotations

import numpy as np
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
    """(axis, axis_matrix arguments) of every axis the Resize changes."""
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
        if sizes is None:  # the output's static extents
            out = node.outputs[0].shape
            sizes = [out.dims[a] if out is not None else None for a in axes]
            if None in sizes or not all(isinstance(s, int) for s in sizes):
                raise ValueError(f"{what}: its output sizes are computed at run time; the "
                                 "gradient needs them static (export with static spatial "
                                 "sizes, or scale_factor instead of size)")
    plan = []
    for k, a in enumerate(axes):
        n = sizes_in[a]
        scale = float(scales[k]) if scales is not None else None
        size = int(sizes[k]) if scales is None else None
        if not crop and (scale == 1.0 or (size is not None and size == n)):
            continue  # the identity
        if n is None:
            raise ValueError(f"{what} resizes axis {a}, whose size is known only at run "
                             "time; the gradient needs it static")
        plan.append((a, dict(n=n, scale=scale, size=size,
                             roi=(float(roi[k]), float(roi[k + len(axes)])) if crop else None)))
    return plan


@register("Resize")
def resize(ctx, node, gys):
    g = gys[0]
    rank = len(dims(node.inputs[0], "Resize input"))
    for axis, spec in _plan(ctx, node):
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
        if axis == rank - 2:  # M @ g [..., out, w]
            g = ctx.op("MatMul", ctx.const(mat, like=g), g)
            continue
        perm = [*range(axis), *range(axis + 1, rank), axis]  # the axis last: g @ M^T
        moved = g if axis == rank - 1 else ctx.op("Transpose", g, perm=perm)
        moved = ctx.op("MatMul", moved, ctx.const(np.ascontiguousarray(mat.T), like=g))
        g = moved if axis == rank - 1 else \
            ctx.op("Transpose", moved, perm=np.argsort(perm).tolist())
    return [g, None, None, None]
