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
from ngdist.kernels.allreduce_algs import _dup, ring_reduce_scatter
from ngdist.kernels.compressed import wire_format


def compressed_reduce_scatter(group: Any, node: Any, x: np.ndarray) -> np.ndarray:
    """Rank r's row of the ranks' summed 16-bit ``x`` (``[N * k, ...]``, float16, or uint16
    bfloat16 bits), the mean by ``node``'s ``reduction``; ``x`` is left as it was."""
    fmt = wire_format(node, x, "ReduceScatter", "sharding")
    p = group.size
    if x.shape[0] % p:
        raise CommError(f"ngdist.ReduceScatter '{node.name}' needs axis 0 ({x.shape[0]}) "
                        f"divisible by the {p} ranks")
    rows = np.array(x, order="C").reshape(p, -1).view(np.uint16)  # a copy: summed in place
    if p > 1:  # row r ends whole on rank r, summed from rank r + 1 on
        size = rows.shape[1]
        group.bytes_sent += ring_reduce_scatter(  # (as the compressed AllReduce counts)
            _dup(group), node, rows.reshape(-1), [(k * size, (k + 1) * size) for k in range(p)],
            fmt.add, group.rank - 1)
    mine = rows[group.rank]
    if node.attributes["reduction"] == "mean" and p > 1:
        fmt.divide(mine, p)
    return mine.view(x.dtype).reshape((x.shape[0] // p, *x.shape[1:]))
