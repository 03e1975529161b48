"""The PushSum kernel (Stochastic Gradient Push) and its peer schedule.

At iteration ``k`` rank ``i`` keeps ``1/(m+1)`` of its push-sum numerators and weight and sends
the same share to each of its ``m = peers_per_itr`` out-peers; what its in-peers sent is added.
The mixing matrix is column-stochastic, so the sums over ranks of ``x`` and of ``w`` are kept
exactly (up to rounding), and ``x / w`` on every rank tends to the average.

Peers (``schedule``): the time-varying directed exponential graph of the SGP paper sends to
``(i + 2**e) % n`` with ``e = k mod (floor(log2(n-1)) + 1)``; with ``peers_per_itr = m > 1`` an
iteration uses ``m`` consecutive phases (``e = (k*m + j) mod L``, ``j < m``), which are distinct
peers. The static ``ring`` sends to ``i+1`` (and ``i-1`` with two peers). In-peers come from the
same offsets (``(i - 2**e) % n``), so every message that is waited for is sent.

All parameters and the weight travel as one flat buffer per message (one grouped exchange on
a duplicate of the group made for the node, tag = iteration); every wait is a Work bounded by
the group's timeout that ends in an error naming the op and the peers (the progress thread
polls gently with the same deadline).

``overlap=1``: the round of iteration ``k`` is posted and left to a progress thread (as the
reference implementation's gossip thread); the kernel returns at once with its own share.
Rounds that have arrived are added at a later iteration (before the next share is taken); a
round older than ``synch_freq + 1`` iterations is waited for, so with ``synch_freq = 0`` what
arrives is added exactly one iteration later. Pending rounds, their buffers and the iteration
counter live in ``CommNode.state``; ``drain`` (the kernel's registered hook, called by the
runtime's flush) completes the rounds still in flight.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ngdist.errors import CommError
from ngdist.kernels.base import CommNode, flatten, register_kernel, unflatten

logger = logging.getLogger(__name__)

TAG_MOD = 1 << 15  # MPI guarantees tags up to 32767


# --------------------------------------------------------------------------- schedule

def phase_offsets(n: int, graph: str = "exponential") -> list[int]:
    """The offsets a rank cycles through: 2**0 .. 2**floor(log2(n-1)), or +1/-1 for the ring."""
    if n < 2:
        return []
    if graph == "exponential":
        return [1 << e for e in range((n - 1).bit_length())]  # bit_length(m) = floor(log2 m)+1
    if graph == "ring":
        return [1] if n == 2 else [1, n - 1]
    raise CommError(f"unknown gossip graph {graph!r}; choose 'exponential' or 'ring'")


def schedule(rank: int, n: int, k: int, graph: str = "exponential", peers_per_itr: int = 1
             ) -> tuple[list[int], list[int]]:
    """(out-peers, in-peers) of ``rank`` at iteration ``k``."""
    phases = phase_offsets(n, graph)
    if peers_per_itr > len(phases):
        raise CommError(f"peers_per_itr={peers_per_itr} needs that many distinct peers, but the "
                        f"{graph} graph on {n} ranks has {len(phases)}; lower peers_per_itr")
    if graph == "ring":
        offs = phases[:peers_per_itr]
    else:
        offs = [phases[(k * peers_per_itr + j) % len(phases)] for j in range(peers_per_itr)]
    return [(rank + o) % n for o in offs], [(rank - o) % n for o in offs]


# --------------------------------------------------------------------------- state

@dataclass
class _Round:
    itr: int
    send: np.ndarray
    recv: list[np.ndarray]
    srcs: list[int]
    dsts: list[int]
    work: Any = None  # the round's grouped exchange
    done: Future | None = None

    def received(self) -> np.ndarray | None:
        if not self.recv:
            return None
        total = self.recv[0].copy()
        for b in self.recv[1:]:
            total += b
        return total


class _Gossip:
    """What one PushSum node keeps across steps (stored in ``node.state``)."""

    def __init__(self, comm: Any, node: CommNode) -> None:
        a = node.attributes
        self.graph = str(a["graph"])
        self.peers_per_itr = int(a["peers_per_itr"])
        self.overlap = bool(int(a["overlap"]))
        self.synch_freq = int(a["synch_freq"])
        schedule(comm.rank, comm.size, 0, self.graph, self.peers_per_itr)  # validates
        self.group = comm.dup(node)
        self.pending: list[_Round] = []
        self.like: list[np.ndarray] = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ngdist-gossip") \
            if self.overlap else None

    def post(self, comm: Any, node: CommNode, k: int, share: np.ndarray) -> _Round:
        dsts_srcs = schedule(comm.rank, comm.size, k, self.graph, self.peers_per_itr)
        rnd = _Round(k, share, [np.empty_like(share) for _ in dsts_srcs[1]], dsts_srcs[1],
                     dsts_srcs[0])
        sent0 = self.group.bytes_sent
        rnd.work = self.group.exchange([(share, d) for d in rnd.dsts],
                                       list(zip(rnd.recv, rnd.srcs)), k % TAG_MOD, node)
        comm.bytes_sent += self.group.bytes_sent - sent0
        return rnd

    @staticmethod
    def complete(rnd: _Round, gentle: bool = False) -> None:
        """Wait for the round; ``gentle`` (the progress thread) polls instead of spinning a
        core the compute needs, with the same deadline."""
        rnd.work.wait(gentle=gentle)

    def take_arrived(self, comm: Any, node: CommNode, k: int, everything: bool = False
                     ) -> np.ndarray | None:
        """Sum of the rounds that have arrived (waiting for those too old, or for all)."""
        total, keep = None, []
        for rnd in self.pending:
            must = everything or rnd.itr <= k - 1 - self.synch_freq
            if must or rnd.done.done():
                rnd.done.result()  # re-raises the progress thread's CommTimeoutError
                got = rnd.received()
                if got is not None:
                    total = got if total is None else total + got
            else:
                keep.append(rnd)
        self.pending = keep
        return total


def _gossip(comm: Any, node: CommNode) -> _Gossip:
    g = node.state.get("gossip")
    if g is None:
        g = node.state["gossip"] = _Gossip(comm, node)
        node.state["itr"] = 0
    return g


def _split(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    return [part.astype(a.dtype, copy=False) for part, a in zip(unflatten(flat, like), like)]


# --------------------------------------------------------------------------- kernel

def pushsum(comm, node, inputs):
    """Inputs: new parameters then the push-sum weight; outputs: their mixed values."""
    if comm.size < 2:  # no peers: the mix is the identity
        return list(inputs)
    g = _gossip(comm, node)
    k = node.state["itr"]
    g.like = list(inputs)
    dtype = np.result_type(*inputs)
    flat = flatten(inputs)
    if g.overlap:
        arrived = g.take_arrived(comm, node, k)
        if arrived is not None:
            flat += arrived
    dsts, _ = schedule(comm.rank, comm.size, k, g.graph, g.peers_per_itr)
    share = flat * dtype.type(1.0 / (len(dsts) + 1))  # uniform mixing weights
    rnd = g.post(comm, node, k, share)
    node.state["itr"] = k + 1
    if g.overlap:
        rnd.done = g.pool.submit(g.complete, rnd, True)
        g.pending.append(rnd)
        return _split(share.copy(), inputs)  # the send buffer stays untouched while in flight
    g.complete(rnd)
    out = share
    for buf in rnd.recv:
        out += buf  # the send has completed, so the buffer is ours again
    return _split(out, inputs)


def drain(comm: Any, node: CommNode) -> list[np.ndarray] | None:
    """Wait for every round still in flight (overlap mode) and return what they bring, one
    array per output (to be added to the node's bound values); None if nothing was pending."""
    g: _Gossip | None = node.state.get("gossip")
    if g is None or not g.pending:
        return None
    arrived = g.take_arrived(comm, node, node.state["itr"], everything=True)
    if arrived is None:
        return None
    return _split(arrived, g.like)


def close(node: CommNode) -> None:
    g: _Gossip | None = node.state.get("gossip")
    if g is not None and g.pool is not None:
        g.pool.shutdown(wait=True)


register_kernel("PushSum", drain=drain, close=close, alone_identity=True)(pushsum)
