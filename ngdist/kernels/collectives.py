"""Kernels of the plain collectives: AllReduce, Broadcast, AllGather, ReduceScatter.

Written against ProcessGroup only. AllReduce runs through the first of its implementations
that takes the node (kernels/allreduce.py); it reduces its bucket in place: the bucketing pass
hands it one flat tensor (Concat in the graph), produced for it alone, so in a steady-state
step no byte of a gradient is copied by Python; ``reduction="mean"`` divides once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ngdist.comm.group import array_module
from ngdist.kernels.allreduce import (allreduce, allreduce_batch, alone_identity, explain,
                                      plain, writable_in_place)
from ngdist.kernels.base import CommNode, register_kernel
from ngdist.kernels.compressed_rs import compressed_reduce_scatter

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup

register_kernel("AllReduce", memory="any", alone_identity=alone_identity,
                batch=allreduce_batch, batchable=plain, explain=explain)(allreduce)


@register_kernel("Broadcast", alone_identity=True)
def broadcast(group: ProcessGroup, node: CommNode, inputs: Sequence[Any]) -> list[Any]:
    root = int(node.attributes["root"])
    outs = []
    for i, x in enumerate(inputs):
        buf = x if writable_in_place(node, i, x) \
            else array_module(x).array(x, order="C")  # one copy, contiguous
        outs.append(buf)
    works = [group.broadcast(b, root, node) for b in outs]
    for w in works:
        w.wait()
    return outs


def _whole(attributes: dict[str, Any]) -> bool:
    return not attributes["ndims"]


@register_kernel("AllGather", alone_identity=_whole)
def allgather(group: ProcessGroup, node: CommNode, inputs: Sequence[Any]) -> list[Any]:
    """The ranks' inputs joined along axis 0; with ``ndims``, cut into views of it (no copy:
    the gathered buffer lives as long as one of them, in memory the runtime frees at their
    last use, not in an onnxruntime arena)."""
    (x,) = inputs
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    out = xp.empty((group.size * x.shape[0], *x.shape[1:]), x.dtype)
    group.allgather(x, out, node).wait()
    if _whole(node.attributes):
        return [out]
    return cut_views(out.reshape(-1), list(node.attributes["dims"]),
                     list(node.attributes["ndims"]))


def cut_views(flat: Any, dims: list[int], ndims: list[int]) -> list[Any]:
    """Consecutive views of the 1-D ``flat``, output i of the next ``ndims[i]`` extents of
    ``dims``; what is left past the last is dropped."""
    views, at, d = [], 0, 0
    for k in ndims:
        shape = tuple(int(e) for e in dims[d:d + k])
        count = math.prod(shape)
        if at + count > flat.shape[0]:
            raise ValueError(f"AllGather: outputs of {at + count} elements from a gathered "
                             f"buffer of {flat.shape[0]}")
        views.append(flat[at:at + count].reshape(shape))
        at, d = at + count, d + k
    return views


@register_kernel("ReduceScatter", alone_identity=True)
def reduce_scatter(group: ProcessGroup, node: CommNode, inputs: Sequence[Any]) -> list[Any]:
    (x,) = inputs
    if node.attributes["compression"] != "none":  # 16-bit values, float32 sums
        return [compressed_reduce_scatter(group, node, x)]
    xp = array_module(x)
    x = xp.ascontiguousarray(x)
    if x.shape[0] % group.size:
        raise ValueError(f"ReduceScatter needs axis 0 ({x.shape[0]}) divisible by {group.size}")
    out = xp.empty((x.shape[0] // group.size, *x.shape[1:]), x.dtype)
    group.reduce_scatter(x, out, node).wait()
    return [out]
