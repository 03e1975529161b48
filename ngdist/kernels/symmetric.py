"""A comm node's symmetric memory: the kernel asks for its next input there, and hands the
group the memory it holds the input in.

A gradient bucket of floats, made in the step for one AllReduce node alone, on ranks that share
one host, may be written by the segment that makes it straight into memory every rank maps
(comm/shared.py); the group then reduces it there without a message. The kernel owns that
memory (made by ``group.symmetric``, kept in its node's state), says where the next input goes
with a typed request (``WriteInto`` in ``node.requests``, which the runtime binds the
producer's output to), and gives the group the memory at the call (``placed_in``): the group
never looks a buffer up by its address.

Outputs that die within the step take one memory. Outputs the step returns as values that the
next step's results replace (plain SGD's state is the reduced gradient) live until the end of
the next step: they take two memories in turn, so the next step's input is never written over
the value that step reads. Each memory is made at a call that every rank reaches (a
collective): the first one at the first call, which goes through MPI.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ngdist.ir.domain import NO_BUCKET
from ngdist.kernels.base import CommNode, WriteInto

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup

FLOATS = (np.float32, np.float64)


def placed_in(node: CommNode, buf: Any) -> Any:
    """The handle (``comm.shared.Placed``) of ``buf`` in one of the node's symmetric
    memories, else None."""
    for mem in node.state.get("symmetric", ()):
        if mem is not None:
            placed = mem.locate(buf)
            if placed is not None:
                return placed
    return None


def offer_symmetric(group: ProcessGroup, node: CommNode, buf: np.ndarray) -> None:
    """Ask for the next call's input in symmetric memory where the group has it (see the
    module docstring); else ask for nothing."""
    node.requests = ()
    if node.attributes["bucket"] == NO_BUCKET or buf.dtype not in FLOATS:
        return
    facts = node.facts
    turns = 1 if facts.outputs_die else 2 if facts.replaced_next_step else 0
    mems = node.state.setdefault("symmetric", [])
    if not turns or None in mems:  # (None: the group has no symmetric memory)
        return
    # with one memory, that one; with two, the one that does not hold this call's result
    # (a new one while there is only that)
    mem = next((m for m in mems if turns == 1 or m.locate(buf) is None), None)
    if mem is None:
        mem = group.symmetric(buf.nbytes, node)
        mems.append(mem)
        if mem is None:
            return
    if buf.nbytes > mem.nbytes:
        return
    targets = node.state.setdefault("write_targets", {})
    target = targets.get(id(mem))
    if target is None or target.shape != buf.shape or target.dtype != buf.dtype:
        target = targets[id(mem)] = \
            mem.view(group.rank)[:buf.nbytes].view(buf.dtype).reshape(buf.shape)
    node.requests = (WriteInto(0, target),)
