"""AllReduce algorithms on MPI point-to-point messages, chosen by AllReduce's ``algorithm``.

Each algorithm sums a flat contiguous buffer over the ranks *in place* and leaves every rank
with bit-for-bit the same result (each element is reduced once, or by an exactly commutative
pairwise add, and then copied); the ``mpi`` AllReduce kernel divides by the size for ``mean``.

* ``ring``: reduce-scatter then all-gather around the ring ``r -> r+1`` (Patarasuk & Yuan; the
  Baidu/Horovod ring). The buffer is cut into ``p`` segments; each step moves one segment per
  rank, sent in chunks of at most ``CHUNK_BYTES`` so that adding a chunk overlaps with the
  transfer of the next. ``2(p-1)/p`` of the buffer leaves each rank.
* ``recursive_doubling``: ``log2 p`` rounds of full-buffer exchange with the partner
  ``r xor 2^k`` (Thakur, Rabenseifner & Gropp 2005). A size that is not a power of two is
  handled as MPICH does: the first ``2*rem`` ranks pair up, the even one hands its buffer to
  its odd neighbour and sits out, and gets the result back at the end.
* ``hierarchical``: reduce within each host (a ``COMM_TYPE_SHARED`` communicator) to its
  local leader, allreduce among the leaders across hosts, broadcast within the host (as
  Horovod's hierarchical allreduce); when all ranks share one host, simply the host's
  allreduce. ``NGDIST_RANKS_PER_HOST=k`` groups consecutive ranks by ``k`` instead, to
  exercise the cross-host path on one machine.

Every algorithm runs on its own duplicate of the group (created on first use, the same point
of the program on every rank), so its messages never match another kernel's, and every wait
is a Work of that group, bounded by its timeout and naming the peer it waits for.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from ngdist.errors import CommError
from ngdist.ir.domain import ALLREDUCE_ALGORITHMS
from ngdist.kernels.base import private_group

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # ring: largest single message; smaller chunks pipeline the adds
_TAG = 7

def _dup(group: Any) -> Any:
    return private_group(group, "dup", lambda g: g.dup("allreduce algorithm set-up"))


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def _chunks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


# --------------------------------------------------------------------------- ring

# ``add(acc, other)``: acc += other in place; the default is numpy's, kernels/compressed.py
# passes its 16-bit sum with float32 accumulation (the wire buffers are then uint16 views)
Add = Optional[Callable[[np.ndarray, np.ndarray], None]]


def _add(acc: np.ndarray, other: np.ndarray) -> None:
    np.add(acc, other, out=acc)


def ring(comm: Any, node: Any, buf: np.ndarray, add: Add = None) -> int:
    """Ring reduce-scatter + all-gather; returns the bytes this rank sent."""
    p, r = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        return 0
    world = _dup(comm)
    seg = _bounds(buf.size, p)
    # rank r ends the reduce-scatter with segment r + 1 whole; it starts the all-gather
    sent = ring_reduce_scatter(world, node, buf, seg, add or _add, r)
    step = max(1, CHUNK_BYTES // buf.itemsize)
    for s in range(p - 1):
        (slo, shi), (rlo, rhi) = seg[(r + 1 - s) % p], seg[(r - s) % p]
        recvs = [world.exchange([], [(buf[a:b], (r - 1) % p)], _TAG, node)
                 for a, b in _chunks(rlo, rhi, step)]
        sends = [world.exchange([(buf[a:b], (r + 1) % p)], [], _TAG, node)
                 for a, b in _chunks(slo, shi, step)]
        for work in (*recvs, *sends):
            work.wait()
        sent += (shi - slo) * buf.itemsize
    return sent


def ring_reduce_scatter(world: Any, node: Any, buf: np.ndarray, seg: list[tuple[int, int]],
                        add: Callable[[np.ndarray, np.ndarray], None], first: int) -> int:
    """The reduce-scatter half of the ring ``r -> r+1`` on ``world`` (a group of ``_dup``),
    in place over ``buf``'s segments ``seg`` (one per rank): step ``s`` sends segment
    ``first - s`` to the right and adds the left's into segment ``first - s - 1``, so after
    ``p - 1`` steps segment ``first + 1`` holds the sum of every rank's (summed in ring order
    from rank ``first + 2 - p``). Chunks of at most ``CHUNK_BYTES``, so that adding one
    overlaps with the transfer of the next; returns the bytes this rank sent."""
    p, r = world.size, world.rank
    right, left = (r + 1) % p, (r - 1) % p
    step = max(1, CHUNK_BYTES // buf.itemsize)
    tmp = np.empty(max(hi - lo for lo, hi in seg), buf.dtype)
    sent = 0
    for s in range(p - 1):
        (slo, shi), (rlo, rhi) = seg[(first - s) % p], seg[(first - s - 1) % p]
        recvs = [(a - rlo, b - rlo,
                  world.exchange([], [(tmp[a - rlo:b - rlo], left)], _TAG, node))
                 for a, b in _chunks(rlo, rhi, step)]
        sends = [world.exchange([(buf[a:b], right)], [], _TAG, node)
                 for a, b in _chunks(slo, shi, step)]
        for a, b, work in recvs:
            work.wait()
            add(buf[rlo + a:rlo + b], tmp[a:b])
        for work in sends:
            work.wait()
        sent += (shi - slo) * buf.itemsize
    return sent


# --------------------------------------------------------------------------- recursive doubling

def recursive_doubling(comm: Any, node: Any, buf: np.ndarray, add: Add = None) -> int:
    """Recursive doubling, correct for any number of ranks; returns the bytes sent."""
    add = add or _add
    p, r = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        return 0
    world = _dup(comm)
    p2 = 1 << (p.bit_length() - 1)  # largest power of two <= p
    rem = p - p2
    tmp = np.empty_like(buf)
    sent = 0
    if r < 2 * rem:  # fold the extra ranks into their odd neighbours
        if r % 2 == 0:
            world.exchange([(buf, r + 1)], [], _TAG, node).wait()
            sent += buf.nbytes
            world.exchange([], [(buf, r + 1)], _TAG, node).wait()
            return sent
        world.exchange([], [(tmp, r - 1)], _TAG, node).wait()
        add(buf, tmp)
        new = r // 2
    else:
        new = r - rem
    mask = 1
    while mask < p2:
        peer_new = new ^ mask
        peer = peer_new * 2 + 1 if peer_new < rem else peer_new + rem
        world.exchange([(buf, peer)], [(tmp, peer)], _TAG, node).wait()
        sent += buf.nbytes
        add(buf, tmp)  # a + b == b + a exactly: both partners hold the same sum
        mask <<= 1
    if r < 2 * rem:  # hand the result back to the even neighbour that sat out
        world.exchange([(buf, r - 1)], [], _TAG, node).wait()
        sent += buf.nbytes
    return sent


# --------------------------------------------------------------------------- hierarchical

def _host_groups(group: Any) -> tuple[Any, Any | None]:
    """(this host's ranks, the host leaders or None), created once per group."""
    per_host = int(os.environ.get("NGDIST_RANKS_PER_HOST", "0") or 0)
    return private_group(group, ("hierarchical", per_host),
                         lambda g: g.host_groups("hierarchical allreduce set-up", per_host))


def hierarchical(comm: Any, node: Any, buf: np.ndarray) -> int:
    """Reduce to the host leader, allreduce among leaders, broadcast within the host."""
    if comm.size == 1 or buf.size == 0:
        return 0
    local, leaders = _host_groups(comm)
    sent0 = local.bytes_sent + (leaders.bytes_sent if leaders is not None else 0)
    if local.size == comm.size:
        # one host: nothing crosses hosts, and the host's own allreduce beats reduce + bcast
        local.allreduce(buf, node).wait()
    else:
        if local.size > 1:
            root = local.rank == 0
            local.reduce(buf, buf if root else None, 0, node).wait()
        if leaders is not None and leaders.size > 1:
            leaders.allreduce(buf, node).wait()
        if local.size > 1:
            local.broadcast(buf, 0, node).wait()
    return local.bytes_sent + (leaders.bytes_sent if leaders is not None else 0) - sent0


ALGORITHMS: dict[str, Callable[[Any, Any, np.ndarray], int]] = {
    "ring": ring, "recursive_doubling": recursive_doubling, "hierarchical": hierarchical}
assert set(ALGORITHMS) | {"mpi", "exact"} == set(ALLREDUCE_ALGORITHMS)  # exact: kernels/exact.py


def sum_inplace(algorithm: str, comm: Any, node: Any, buf: np.ndarray, add: Add = None) -> None:
    """Sum ``buf`` over all ranks in place with ``algorithm`` (``add`` for ring and
    recursive doubling); counts the bytes sent."""
    fn = ALGORITHMS.get(algorithm)
    if fn is None:
        raise CommError(f"unknown all_reduce_alg {algorithm!r} on ngdist.AllReduce "
                        f"'{getattr(node, 'name', node)}'; choose one of "
                        f"{list(ALLREDUCE_ALGORITHMS)}")
    sent = fn(comm, node, buf) if add is None else fn(comm, node, buf, add)
    comm.bytes_sent += sent  # private groups count their own bytes
