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
from typing import Any

import numpy as np

from ngdist.errors import CommError
from ngdist.kernels.allreduce_algs import sum_inplace


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (the top half of a float32)."""
    wide = bits.astype(np.uint32)
    np.left_shift(wide, 16, out=wide)
    return wide.view(np.float32)


def f32_to_bf16(x: np.ndarray, out: np.ndarray) -> None:
    """float32 -> bfloat16 bit patterns (uint16) into ``out``, rounded to nearest, ties to
    even; NaN stays a (quiet) NaN. ``x`` is used as scratch."""
    u = x.view(np.uint32)
    lsb = np.right_shift(u, 16)
    np.bitwise_and(lsb, 1, out=lsb)
    nan = np.isnan(x)
    np.add(u, lsb, out=u)
    np.add(u, np.uint32(0x7FFF), out=u)
    np.right_shift(u, 16, out=u)
    np.copyto(out, u, casting="unsafe")  # the top half, < 2^16
    if nan.any():
        out[nan] = 0x7FC0


_F16_TABLE: np.ndarray | None = None


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float16 bit patterns -> float32, exactly, by a lookup in a table of all 65536 values
    (256 KiB): several times faster than numpy's float16 ``astype``, which converts element
    by element in software (docs/benchmarks.md, "Gradient compression")."""
    global _F16_TABLE
    if _F16_TABLE is None:
        _F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    return np.take(_F16_TABLE, bits.reshape(-1).view(np.uint16)).reshape(bits.shape)


def f32_to_f16(x: np.ndarray, out: np.ndarray) -> None:
    """float32 -> float16 bit patterns (uint16) into ``out``, rounded to nearest even; beyond
    float16's range, infinity (a sum that overflows, as in any float16 sum)."""
    with np.errstate(over="ignore"):
        np.copyto(out.view(np.float16), x, casting="same_kind")


@dataclass(frozen=True)
class WireFormat:
    """A 16-bit format as bit patterns: widening to float32 and rounding back."""

    name: str
    dtype: str  # what the kernel's input arrays are: float16, or uint16 views of bfloat16
    widen: Callable[[np.ndarray], np.ndarray]  # a new float32 array
    narrow: Callable[[np.ndarray, np.ndarray], None]  # float32 (clobbered) -> uint16 out

    def add(self, acc: np.ndarray, other: np.ndarray) -> None:
        """``acc`` = round16(float32(acc) + float32(other)), in place (uint16 bit patterns)."""
        total = self.widen(acc)
        np.add(total, self.widen(other), out=total)
        self.narrow(total, acc)

    def divide(self, bits: np.ndarray, n: int) -> None:
        """``bits`` = round16(float32(bits) / n), in place: the mean of a sum over n ranks."""
        wide = self.widen(bits)
        np.divide(wide, np.float32(n), out=wide)
        self.narrow(wide, bits)


FORMATS = {"fp16": WireFormat("fp16", "float16", f16_to_f32, f32_to_f16),
           "bf16": WireFormat("bf16", "uint16", bf16_to_f32, f32_to_bf16)}


def wire_format(node: Any, buf: np.ndarray, op: str, by: str) -> WireFormat:
    """The format of ``node``'s ``compression``, checked against its 16-bit input ``buf``
    (cast by the ``by`` pass)."""
    compression = node.attributes["compression"]
    fmt = FORMATS.get(compression)
    if fmt is None:
        raise CommError(f"unknown compression {compression!r} on ngdist.{op} "
                        f"'{node.name}'; choose one of {sorted(FORMATS)}")
    if buf.dtype != np.dtype(fmt.dtype):
        raise CommError(f"ngdist.{op} '{node.name}' has compression={compression!r} but "
                        f"its input is {buf.dtype}; the {by} pass casts it to "
                        f"{'float16' if compression == 'fp16' else 'bfloat16'}: rewrite the "
                        "model again instead of editing the file")
    return fmt


def compressed_allreduce(group, node, buf: np.ndarray, algorithm: str) -> None:
    """Sum (or mean, by ``node``'s ``reduction``) of the contiguous 16-bit ``buf`` over the
    ranks, in place; ``buf`` is float16 (``fp16``) or uint16 bfloat16 bits (``bf16``)."""
    compression = node.attributes["compression"]
    fmt = wire_format(node, buf, "AllReduce", "compression")
    if algorithm not in ("mpi", "ring", "recursive_doubling"):
        raise CommError(f"ngdist.AllReduce '{node.name}': compression {compression!r} runs "
                        f"on algorithm 'mpi' (ngdist's ring), 'ring' or 'recursive_doubling', "
                        f"not {algorithm!r}")
    bits = buf.reshape(-1).view(np.uint16)
    sum_inplace("ring" if algorithm == "mpi" else algorithm, group, node, bits, fmt.add)
    if node.attributes["reduction"] == "mean" and group.size > 1:
        fmt.divide(bits, group.size)
