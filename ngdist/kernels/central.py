"""Kernels of ``ngdist.CentralReduce`` (the ``simple`` strategy): gather at the root, reduce
there in rank order, broadcast back. One flat buffer per node (the pass groups by dtype)."""
from __future__ import annotations

import numpy as np

from ngdist.comm.group import divide
from ngdist.kernels.base import flatten, register_kernel, unflatten


@register_kernel("CentralReduce", alone_identity=True)
def central_reduce(comm, node, inputs):
    if comm.size == 1:
        return list(inputs)
    root = int(node.attributes["root"])
    buf = flatten(inputs)
    if len(inputs) == 1 and buf.base is not None:
        buf = buf.copy()
    table = np.empty((comm.size, buf.size), buf.dtype) if comm.rank == root else None
    comm.gather(buf, table, root, node).wait()
    if comm.rank == root:
        acc = table[0].copy()
        for row in table[1:]:  # fixed rank order: the same sum whoever runs it
            acc += row
        if node.attributes["reduction"] == "mean":
            divide(acc, comm.size)
        buf[...] = acc
    comm.broadcast(buf, root, node).wait()
    if comm.rank == root:
        comm.bytes_sent += buf.nbytes * (comm.size - 2)  # one copy to each other rank
    return unflatten(buf, inputs)
