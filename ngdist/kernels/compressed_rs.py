"""ReduceScatter of 16-bit buffers (``compression="fp16"`` or ``"bf16"`` with ``shard=``,
passes/shard.py): the reduce-scatter half of the compressed AllReduce's ring
(kernels/compressed.py), with the same numerics.

The ``[N, S]`` buffer's row ``k`` is reduced along the ranks ``k+1, k+2, ..., k`` and ends
on rank ``k``: at each hop the partial sum arrives as 16-bit values, both operands are widened
to float32, added in float32 and the sum rounded to the nearest 16-bit value (ties to even),
as the compressed AllReduce does. Bytes on the wire: ``(p-1)/p`` of the 16-bit buffer per
rank, half the compressed AllReduce's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ngdist.errors import CommError
from ngdist.kernels.allreduce_algs import CHUNK_BYTES, _chunks, _dup, _TAG
from ngdist.kernels.compressed import WireFormat, wire_format


def compressed_reduce_scatter(group: Any, node: Any, x: np.ndarray) -> np.ndarray:
    """Rank r's row of the ranks' summed 16-bit ``x`` (``[N * k, ...]``, float16, or uint16
    bfloat16 bits), the mean by ``node``'s ``reduction``; ``x`` is left as it was."""
    fmt = wire_format(node, x, "ReduceScatter", "sharding")
    p = group.size
    if x.shape[0] % p:
        raise CommError(f"ngdist.ReduceScatter '{node.name}' needs axis 0 ({x.shape[0]}) "
                        f"divisible by the {p} ranks")
    rows = np.array(x, order="C").reshape(p, -1).view(np.uint16)  # a copy: summed in place
    if p > 1:
        _ring(group, node, rows, fmt)
    mine = rows[group.rank]
    if node.attributes["reduction"] == "mean" and p > 1:
        fmt.divide(mine, p)
    return mine.view(x.dtype).reshape((x.shape[0] // p, *x.shape[1:]))


def _ring(group: Any, node: Any, rows: np.ndarray, fmt: WireFormat) -> None:
    """Reduce-scatter around the ring ``r -> r+1``: step s sends row ``r-s-1`` and adds the
    received row ``r-s-2``; after ``p-1`` steps row ``r`` is the sum, on rank ``r``."""
    p, r = group.size, group.rank
    world = _dup(group)
    right, left = (r + 1) % p, (r - 1) % p
    size = rows.shape[1]
    step = max(1, CHUNK_BYTES // rows.itemsize)
    tmp = np.empty(size, rows.dtype)
    sent = 0
    for s in range(p - 1):
        out, into = rows[(r - s - 1) % p], rows[(r - s - 2) % p]
        recvs = [(a, b, world.exchange([], [(tmp[a:b], left)], _TAG, node))
                 for a, b in _chunks(0, size, step)]
        sends = [world.exchange([(out[a:b], right)], [], _TAG, node)
                 for a, b in _chunks(0, size, step)]
        for a, b, work in recvs:
            work.wait()
            fmt.add(into[a:b], tmp[a:b])
        for work in sends:
            work.wait()
        sent += out.nbytes
    group.bytes_sent += sent  # counted as the compressed AllReduce counts its ring's
