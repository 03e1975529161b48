"""Kernels of ``ngdist.CentralReduce`` (the ``simple`` strategy): gather at the root, reduce
there in rank order, broadcast back. One flat buffer per node (the pass groups by dtype)."""
from __future__ import annotations

import numpy as np

from ngdist.kernels.base import flatten, register_kernel, unflatten


@register_kernel("CentralReduce", "mpi")
def central_reduce(comm, node, inputs):
    root = int(node.attributes.get("root", 0))
    buf = flatten(inputs)
    if len(inputs) == 1 and buf.base is not None:
        buf = buf.copy()
    table = np.empty((comm.size, buf.size), buf.dtype) if comm.rank == root else None
    everyone = list(range(comm.size))
    comm.wait(comm.world.Igather(buf, table, root=root), node,
              peers=everyone if comm.rank == root else [root])
    if comm.rank == root:
        acc = table[0].copy()
        for row in table[1:]:  # fixed rank order: the same sum whoever runs it
            acc += row
        if node.attributes.get("reduction", "mean") == "mean":
            if acc.dtype.kind == "f":
                acc /= acc.dtype.type(comm.size)
            else:
                acc //= comm.size
        buf[...] = acc
    else:
        comm.bytes_sent += buf.nbytes
    comm.wait(comm.world.Ibcast(buf, root=root), node,
              peers=everyone if comm.rank == root else [root])
    if comm.rank == root:
        comm.bytes_sent += buf.nbytes * (comm.size - 1)
    return unflatten(buf, inputs)


@register_kernel("CentralReduce", "local")
def central_reduce_local(comm, node, inputs):
    return list(inputs)
