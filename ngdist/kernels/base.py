"""The kernel registry and the uniform kernel signature.

A kernel is ``kernel(comm, node, inputs) -> outputs``: ``comm`` is the runtime's
``Communicator`` (rank, size, timeouts, byte counters), ``node`` the comm node's name and
attributes, ``inputs`` numpy arrays (views of the runtime's buffers; a kernel may work in
place on them), and the result one array per output.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ngdist.errors import CommError

if TYPE_CHECKING:
    from ngdist.comm.mpi import Communicator


@dataclass
class CommNode:
    """What a kernel sees of a comm node."""

    op_type: str
    name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # kernel-private, lives across steps


Kernel = Callable[["Communicator", CommNode, Sequence[np.ndarray]], list[np.ndarray]]
KERNELS: dict[tuple[str, str], Kernel] = {}


def register_kernel(op_type: str, backend: str) -> Callable[[Kernel], Kernel]:
    def wrap(fn: Kernel) -> Kernel:
        KERNELS[(op_type, backend)] = fn
        return fn

    return wrap


def get_kernel(op_type: str, backend: str) -> Kernel:
    try:
        return KERNELS[(op_type, backend)]
    except KeyError:
        have = sorted(b for (op, b) in KERNELS if op == op_type)
        raise CommError(f"no kernel for ngdist.{op_type} on backend {backend!r}; backends with "
                        f"one: {have}") from None


def flatten(arrays: Sequence[np.ndarray], node: CommNode | None = None) -> np.ndarray:
    """One contiguous buffer holding a copy of every array.

    With ``node`` whose ``state["reuse_buffer"]`` the executor set (its outputs do not outlive
    the step), the buffer is kept in the node's state and reused at the next step: fresh
    multi-megabyte allocations page-fault on every call and cost as much as the copy.
    """
    size = sum(a.size for a in arrays)
    dtype = np.result_type(*arrays)
    buf = None
    if node is not None and node.state.get("reuse_buffer"):
        buf = node.state.get("buffer")
        if buf is None or buf.size != size or buf.dtype != dtype:
            buf = node.state["buffer"] = np.empty(size, dtype)
    if buf is None:
        buf = np.empty(size, dtype)
    offset = 0
    for a in arrays:
        buf[offset:offset + a.size] = a.reshape(-1)
        offset += a.size
    return buf


def unflatten(buffer: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Views into ``buffer`` with the shapes of ``like``."""
    out, offset = [], 0
    for a in like:
        out.append(buffer[offset:offset + a.size].reshape(a.shape))
        offset += a.size
    return out
