"""AllReduce of 16-bit buffers (``compression="fp16"`` or ``"bf16"``, passes/compression.py).

MPI has no float16 or bfloat16 sum, so the kernel sums them itself, over point-to-point
messages of 16-bit values (``uint16`` views on the wire): the ring of kernels/allreduce_algs.py
(reduce-scatter + all-gather; also for ``algorithm="mpi"``) or recursive doubling. Each add
widens both operands to float32, adds in float32 and rounds the sum to the nearest 16-bit
value (ties to even), as numpy's float16 arithmetic and onnxruntime's Cast do; the partial
sums travel as 16-bit values, so each element is rounded once per hop of the ring (as NCCL's
and Horovod's float16 sums do).

Every rank ends with the same bits: the ring reduces each segment once (along the ranks
``k, k+1, ..., k-1`` for segment ``k``) and then copies it, and recursive doubling's partners
compute ``a + b`` and ``b + a``, equal in float32. ``reduction="mean"`` divides the sum in
float32 and rounds once more.

bfloat16 has no numpy type: the runtime hands bfloat16 values to the kernel as ``uint16``
views of their memory (runtime/executor.py); float16 values come as float16 arrays and are
viewed as ``uint16`` here. Bytes on the wire: ``2 (p-1)/p`` of the 16-bit buffer per rank
with the ring, half of the float32 ring's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ngdist.errors import CommError
from ngdist.kernels.allreduce_algs import sum_inplace


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (the top half of a float32)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even; NaN stays
    a (quiet) NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    bits = np.where(np.isnan(x), np.uint32(0x7FC0), rounded).astype(np.uint16)
    if out is None:
        return bits
    out[...] = bits
    return out


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(np.float32)


def f32_to_f16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    bits = x.astype(np.float16).view(np.uint16)
    if out is None:
        return bits
    out[...] = bits
    return out


@dataclass(frozen=True)
class WireFormat:
    """A 16-bit format as bit patterns: widening to float32 and rounding back."""

    name: str
    dtype: str  # what the kernel's input arrays are: float16, or uint16 views of bfloat16
    widen: Callable[[np.ndarray], np.ndarray]
    narrow: Callable[..., np.ndarray]

    def add(self, acc: np.ndarray, other: np.ndarray) -> None:
        """``acc`` = round16(float32(acc) + float32(other)), in place (uint16 bit patterns)."""
        self.narrow(self.widen(acc) + self.widen(other), out=acc)

    def divide(self, bits: np.ndarray, n: int) -> None:
        """``bits`` = round16(float32(bits) / n), in place: the mean of a sum over n ranks."""
        self.narrow(self.widen(bits) / np.float32(n), out=bits)


FORMATS = {"fp16": WireFormat("fp16", "float16", f16_to_f32, f32_to_f16),
           "bf16": WireFormat("bf16", "uint16", bf16_to_f32, f32_to_bf16)}


def compressed_allreduce(group, node, buf: np.ndarray, algorithm: str) -> None:
    """Sum (or mean, by ``node``'s ``reduction``) of the contiguous 16-bit ``buf`` over the
    ranks, in place; ``buf`` is float16 (``fp16``) or uint16 bfloat16 bits (``bf16``)."""
    compression = node.attributes.get("compression", "none")
    fmt = FORMATS.get(compression)
    if fmt is None:
        raise CommError(f"unknown compression {compression!r} on ngdist.AllReduce "
                        f"'{node.name}'; choose one of {sorted(FORMATS)}")
    if buf.dtype != np.dtype(fmt.dtype):
        raise CommError(f"ngdist.AllReduce '{node.name}' has compression={compression!r} but "
                        f"its input is {buf.dtype}; the compression pass casts it to "
                        f"{'float16' if compression == 'fp16' else 'bfloat16'}: rewrite the "
                        "model again instead of editing the file")
    if algorithm not in ("mpi", "ring", "recursive_doubling"):
        raise CommError(f"ngdist.AllReduce '{node.name}': compression {compression!r} runs "
                        f"on algorithm 'mpi' (ngdist's ring), 'ring' or 'recursive_doubling', "
                        f"not {algorithm!r}")
    bits = buf.reshape(-1).view(np.uint16)
    sum_inplace("ring" if algorithm == "mpi" else algorithm, group, node, bits, fmt.add)
    if node.attributes.get("reduction", "mean") == "mean" and group.size > 1:
        fmt.divide(bits, group.size)
