"""MPI kernels (mpi4py buffer API on numpy arrays), non-blocking with a timeout on every wait."""
from __future__ import annotations

import numpy as np

from ngdist.kernels.allreduce_algs import sum_inplace
from ngdist.kernels.base import flatten, register_kernel, unflatten
from ngdist.kernels.exact import exact_allreduce


@register_kernel("AllReduce", "mpi")
def allreduce(comm, node, inputs):
    """Sum (or mean) of a fused bucket: one flat buffer, one in-place Iallreduce, or the
    point-to-point algorithm named by the ``algorithm`` attribute (kernels/allreduce_algs)."""
    from mpi4py import MPI

    if node.attributes.get("algorithm") == "exact":  # reproducible mode (kernels/exact.py)
        return exact_allreduce(comm, node, inputs)
    buf = flatten(inputs, node)  # a copy: never reduce into a buffer the caller still reads
    algorithm = node.attributes.get("algorithm", "mpi")
    if algorithm != "mpi":
        sum_inplace(algorithm, comm, node, buf)
    else:
        req = comm.world.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.wait(req, node)
        comm.bytes_sent += buf.nbytes
    if node.attributes.get("reduction", "mean") == "mean":
        if buf.dtype.kind == "f":
            buf /= buf.dtype.type(comm.size)
        else:
            buf //= comm.size
    return unflatten(buf, inputs)


@register_kernel("Broadcast", "mpi")
def broadcast(comm, node, inputs):
    buf = flatten(inputs)
    req = comm.world.Ibcast(buf, root=int(node.attributes.get("root", 0)))
    comm.wait(req, node)
    comm.bytes_sent += buf.nbytes if comm.rank == node.attributes.get("root", 0) else 0
    return unflatten(buf, inputs)


@register_kernel("AllGather", "mpi")
def allgather(comm, node, inputs):
    (x,) = inputs
    x = np.ascontiguousarray(x)
    out = np.empty((comm.size * x.shape[0], *x.shape[1:]), x.dtype)
    req = comm.world.Iallgather(x, out)
    comm.wait(req, node)
    comm.bytes_sent += x.nbytes
    return [out]


@register_kernel("ReduceScatter", "mpi")
def reduce_scatter(comm, node, inputs):
    from mpi4py import MPI

    (x,) = inputs
    x = np.ascontiguousarray(x)
    if x.shape[0] % comm.size:
        raise ValueError(f"ReduceScatter needs axis 0 ({x.shape[0]}) divisible by {comm.size}")
    out = np.empty((x.shape[0] // comm.size, *x.shape[1:]), x.dtype)
    req = comm.world.Ireduce_scatter_block(x, out, op=MPI.SUM)
    comm.wait(req, node)
    comm.bytes_sent += x.nbytes
    return [out]
