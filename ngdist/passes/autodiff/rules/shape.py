"""Shape ops: Reshape, Flatten, Transpose (the data input only; shape inputs get no gradient)."""
from __future__ import annotations

import numpy as np

from ngdist.passes.autodiff.registry import attr, register


@register("Reshape", "Flatten")
def reshape(ctx, node, gys):
    return [ctx.op("Reshape", gys[0], ctx.op("Shape", node.inputs[0])), None]


@register("Transpose")
def transpose(ctx, node, gys):
    perm = attr(node, "perm")
    if perm is None:
        rank = ctx.rank(node.inputs[0])
        if rank is None:
            raise ValueError("Transpose without perm needs an input of known rank")
        perm = list(range(rank))[::-1]
    inverse = np.argsort(np.asarray(perm)).tolist()
    return [ctx.op("Transpose", gys[0], perm=inverse)]
