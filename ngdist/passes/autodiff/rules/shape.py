"""Shape ops: Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand, Concat, Split, Pad, Tile,
Trilu, DepthToSpace, SpaceToDepth, ReverseSequence, CenterCropPad (the data inputs only;
shape, axes, pads, repeats, k, lengths and split-size inputs get no gradient); an If whose
branches each return a view of one value (torch's squeeze of an axis whose extent is known
only at run time: Squeeze or Identity)."""
from __future__ import annotations

import numpy as np

from ngdist.errors import GradientError
from ngdist.passes.autodiff.registry import attr, register, subgraph_reads
from ngdist.passes.autodiff.rules._common import known_rank
from ngdist.passes.autodiff.rules.pad_modes import folded_pad


@register("Reshape", "Flatten")
def reshape(ctx, node, gys):
    return [ctx.op("Reshape", gys[0], ctx.op("Shape", node.inputs[0])), None]


@register("Transpose")
def transpose(ctx, node, gys):
    perm = attr(node, "perm")
    if perm is None:
        rank = known_rank(node.inputs[0], "Transpose (without perm) input")
        perm = list(range(rank))[::-1]
    inverse = np.argsort(np.asarray(perm)).tolist()
    return [ctx.op("Transpose", gys[0], perm=inverse)]


@register("Squeeze", "Unsqueeze")
def squeeze(ctx, node, gys):
    return [ctx.op("Reshape", gys[0], ctx.op("Shape", node.inputs[0])), None]


@register("Expand")
def expand(ctx, node, gys):
    return [ctx.unbroadcast(gys[0], node.inputs[0]), None]


def _extent(ctx, value, axis: int):
    """The size of one axis, as a 1-element int64 tensor (static when known)."""
    if value.shape is not None and isinstance(value.shape.dims[axis], int):
        return ctx.ints([value.shape.dims[axis]])
    return ctx.op("Gather", ctx.op("Shape", value), ctx.ints([axis]))


@register("Concat")
def concat(ctx, node, gys):
    rank = ctx.rank(node.outputs[0]) or known_rank(node.inputs[0], "Concat input")
    axis = attr(node, "axis") % rank
    if len(node.inputs) == 1:
        return [gys[0]]
    sizes = ctx.op("Concat", *[_extent(ctx, x, axis) for x in node.inputs], axis=0)
    return list(ctx.op_multi("Split", gys[0], sizes, axis=axis, num_outputs=len(node.inputs)))


@register("Split")
def split(ctx, node, gys):
    rank = known_rank(node.inputs[0], "Split input")
    parts = [g if g is not None else ctx.zeros_like(y) for g, y in zip(gys, node.outputs)]
    return [ctx.op("Concat", *parts, axis=attr(node, "axis", 0) % rank), None]


@register("Pad")
def pad(ctx, node, gys):
    """Constant padding: the gradient is the output gradient padded by the negated pads (a
    positive pad is cut off, a negative one, which cropped, becomes zeros). The pads may be
    computed at run time. Reflect, edge and wrap padding fold several outputs onto one input
    element: ``pad_modes.folded_pad``."""
    mode = attr(node, "mode", "constant")
    if mode != "constant":
        return folded_pad(ctx, node, gys, mode)
    if ctx.opset < 11:
        pads = ctx.ints([-p for p in attr(node, "pads")])
        return [ctx.op("Pad", gys[0], pads)]
    neg = ctx.op("Neg", node.inputs[1])
    axes = [node.inputs[3]] if len(node.inputs) > 3 and node.inputs[3] is not None else []
    inputs = [gys[0], neg, None, *axes] if axes else [gys[0], neg]
    return [ctx.op("Pad", *inputs), None, None, None]


@register("Tile")
def tile(ctx, node, gys):
    """The copies summed: g reshaped to [r0, n0, r1, n1, ...] and reduced over the r axes
    (repeats and sizes read at run time)."""
    x, repeats = node.inputs
    rank = known_rank(x, "Tile input")
    pairs = ctx.op("Concat", ctx.op("Unsqueeze", repeats, ctx.ints([1])),
                   ctx.op("Unsqueeze", ctx.op("Shape", x), ctx.ints([1])), axis=1)
    split = ctx.op("Reshape", gys[0], ctx.op("Reshape", pairs, ctx.ints([-1])))
    return [ctx.op("ReduceSum", split, ctx.ints(list(range(0, 2 * rank, 2))), keepdims=0),
            None]


@register("Trilu")
def trilu(ctx, node, gys):
    """The same triangle of the gradient (a mask is its own adjoint)."""
    k = node.inputs[1:2] if len(node.inputs) > 1 and node.inputs[1] is not None else []
    return [ctx.op("Trilu", gys[0], *k, upper=attr(node, "upper", 1)), None]


def _blocks(ctx, x, b: int, depth_first: bool):
    """The 6-D view [N, C / b^2, H, b, W, b] (CRD) or [N, b, b, C / b^2, H, W] (DCR) of a
    [N, C, H, W] tensor ``x``, its sizes read at run time."""
    shape = ctx.op("Shape", x)
    n, c = ctx.op("Slice", shape, ctx.ints([0]), ctx.ints([1])), \
        ctx.op("Div", ctx.op("Slice", shape, ctx.ints([1]), ctx.ints([2])), ctx.ints([b * b]))
    h, w = (ctx.op("Slice", shape, ctx.ints([i]), ctx.ints([i + 1])) for i in (2, 3))
    bb = ctx.ints([b])
    parts = [n, bb, bb, c, h, w] if depth_first else [n, c, bb, bb, h, w]
    return ctx.op("Concat", *parts, axis=0)


# DepthToSpace: x [N, C, H, W] viewed 6-D, permuted, then [N, C / b^2, H b, W b]
_D2S_PERM = {"DCR": [0, 3, 4, 1, 5, 2], "CRD": [0, 1, 4, 2, 5, 3]}


@register("DepthToSpace")
def depth_to_space(ctx, node, gys):
    """A permutation: the gradient is g viewed as the permuted 6-D tensor, permuted back."""
    x, b = node.inputs[0], attr(node, "blocksize")
    mode = attr(node, "mode", "DCR")
    known_rank(x, "DepthToSpace input")
    perm = _D2S_PERM[mode]
    view = ctx.op("Gather", _blocks(ctx, x, b, mode == "DCR"), ctx.ints(perm))
    moved = ctx.op("Transpose", ctx.op("Reshape", gys[0], view),
                   perm=np.argsort(perm).tolist())
    return [ctx.op("Reshape", moved, ctx.op("Shape", x))]


@register("SpaceToDepth")
def space_to_depth(ctx, node, gys):
    """x [N, C, H, W] viewed [N, C, H/b, b, W/b, b], permuted to [N, b, b, C, H/b, W/b]."""
    x, b = node.inputs[0], attr(node, "blocksize")
    (y,) = node.outputs
    known_rank(x, "SpaceToDepth input")
    perm = [0, 3, 5, 1, 2, 4]
    # y [N, C b^2, H/b, W/b] viewed [N, C, b, b, H/b, W/b], reordered to the permuted view
    after = ctx.op("Gather", _blocks(ctx, y, b, False), ctx.ints([0, 2, 3, 1, 4, 5]))
    moved = ctx.op("Transpose", ctx.op("Reshape", gys[0], after),
                   perm=np.argsort(perm).tolist())
    return [ctx.op("Reshape", moved, ctx.op("Shape", x))]


@register("ReverseSequence")
def reverse_sequence(ctx, node, gys):
    """Its own inverse: the gradient reversed the same way."""
    return [ctx.op("ReverseSequence", gys[0], node.inputs[1],
                   batch_axis=attr(node, "batch_axis", 1), time_axis=attr(node, "time_axis", 0)),
            None]


@register("CenterCropPad")
def center_crop_pad(ctx, node, gys):
    """A centred crop's adjoint is the centred pad back to the input's extents, and the other
    way round (both place the window at offset |n - m| // 2)."""
    x = node.inputs[0]
    axes = attr(node, "axes")
    extents = ctx.op("Shape", x)
    if axes is not None:
        extents = ctx.op("Gather", extents, ctx.ints(list(axes)))
    return [ctx.op("CenterCropPad", gys[0], extents, axes=None if axes is None else list(axes)),
            None]


_VIEWS = {"Squeeze", "Unsqueeze", "Identity", "Reshape", "Flatten"}


def _viewed(branch, output):
    """The value around ``branch`` that ``output`` is a chain of views of, else None."""
    inner = {id(n) for n in branch}
    value = output
    while value.producer() is not None and id(value.producer()) in inner:
        node = value.producer()
        if node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx"):
            return None
        value = node.inputs[0]
    return None if value.producer() is None and value in branch.inputs else value


@register("If")
def if_of_views(ctx, node, gys):
    branches = [attr(node, "then_branch"), attr(node, "else_branch")]
    targets = [*node.inputs, *subgraph_reads(node)]
    gxs = [None] * len(targets)
    for k, gy in enumerate(gys):
        if gy is None:
            continue
        seen = {id(v) if v is not None else None
                for v in (_viewed(b, b.outputs[k]) for b in branches)}
        source = next((t for t in targets if id(t) in seen), None)
        if len(seen) != 1 or source is None:
            raise GradientError(
                f"If node '{node.name}': output {k} is not a view of one value in both "
                "branches (Squeeze, Unsqueeze, Reshape, Identity); ngdist differentiates an "
                "If only so (torch's squeeze of an axis whose extent is known at run time)")
        g = ctx.op("Reshape", gy, ctx.op("Shape", source))
        i = targets.index(source)
        gxs[i] = g if gxs[i] is None else ctx.op("Add", gxs[i], g)
    return gxs
