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
    from ngdist.runtime.comm import Communicator


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


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """One contiguous buffer holding every array (copied once)."""
    if len(arrays) == 1:
        return np.ascontiguousarray(arrays[0]).reshape(-1)
    return np.concatenate([np.ascontiguousarray(a).reshape(-1) for a in arrays])


def unflatten(buffer: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Views into ``buffer`` with the shapes of ``like``."""
    out, offset = [], 0
    for a in like:
        out.append(buffer[offset:offset + a.size].reshape(a.shape))
        offset += a.size
    return out
