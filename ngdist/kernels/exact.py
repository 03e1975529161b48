"""AllReduce ``algorithm="exact"``: a sum that does not depend on grouping or order.

A floating-point sum depends on the order of its additions, so an ordinary allreduce of
per-rank gradients gives different bits on 2 and on 3 ranks. This kernel sums in per-element
fixed point instead, where addition is exact and associative:

1. Each input is a stack of *micro-batch values* ``[k, *shape]`` (``node.facts.stacked``,
   set by runtime/microbatch.py), or one value per rank (``k = 1``).
2. Per element ``j``: ``E_j`` = the largest binary exponent (as ``np.frexp`` gives it) over
   all micro-batches of all ranks, through one ``MAX`` Iallreduce of int16 exponents. It is
   read from the bits of the largest magnitude (for IEEE floats without sign, integer order
   is magnitude order). Zeros count as ``EMPTY`` (the int16 minimum, neutral for MAX), so a
   zero never costs precision; a non-finite value as ``NONFINITE`` (the int16 maximum): that
   element's result is NaN.
3. Every micro-value ``x`` (``|x| < 2^E_j``) becomes ``rint(x * 2^(F - E_j))``, an int64 of
   magnitude at most ``2^F`` with ``F = 62 - HEADROOM``: multiplying by a power of two only
   moves the exponent (exact in float64 for float32 and float64 inputs, denormals included),
   and the rounding (to nearest, ties to even, through adding 1.5 * 2^52) is symmetric for
   negative values. The integers are summed locally and with one ``SUM`` Iallreduce of int64
   whose last element carries the number of micro-batches. Integer addition is exact and
   associative (even wrapped modulo 2^64), and ``HEADROOM`` bits keep the true sum of up to
   ``2^HEADROOM`` micro-batches inside int64; more is an error raised on every rank.
4. The sum goes back to float64 (one rounding, the same everywhere), is scaled by
   ``2^(E_j - F)``, divided by the total number of micro-batches for ``mean``, and cast to
   the input's dtype.

So the result depends only on the multiset of micro-batch values: the same bits on every
rank, for every rank count and every assignment of micro-batches to ranks. Each
contribution is rounded to ``2^(E_j - F)``, i.e. ``F = 42`` bits below the element's largest
micro-value: far below float32's 24-bit precision (and 11 bits short of float64's 53).
Cost: an int16 exponent and an int64 per element (10 bytes instead of 4 for float32) in two
collectives instead of one, and a few passes over the micro-batch values (scratch buffers
live in the node's state across steps). float16 inputs are reduced as float32, integers as
float64.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ngdist.errors import CommError

HEADROOM = 20  # bits above the largest micro-value: up to 2**20 micro-batches per step
FRACTION_BITS = 62 - HEADROOM
EMPTY = np.iinfo(np.int16).min  # every contribution is zero
NONFINITE = np.iinfo(np.int16).max  # some contribution is inf or NaN
# dtype -> (unsigned view, mantissa bits, exponent mask, frexp exponent of the biased 1)
_LAYOUT = {np.dtype(np.float32): (np.uint32, 23, 0xFF, 126),
           np.dtype(np.float64): (np.uint64, 52, 0x7FF, 1022)}
_MAGIC = 1.5 * 2.0 ** 52  # x + _MAGIC rounds x to an integer (ties to even) for |x| < 2^51
_MAGIC_BITS = int(np.array(_MAGIC).view(np.int64))


def _matrices(inputs: Sequence[np.ndarray], stacked: bool) -> tuple[list[np.ndarray], int]:
    """Each input as a [micro-batches, elements] float32/float64 matrix, and the count."""
    k = int(inputs[0].shape[0]) if stacked else 1
    if stacked and any(x.ndim == 0 or x.shape[0] != k for x in inputs):
        raise CommError(f"exact AllReduce: stacked inputs disagree on the number of "
                        f"micro-batches: {[x.shape for x in inputs]}")
    mats = []
    for x in inputs:
        m = np.ascontiguousarray(x).reshape(k, -1)
        if m.dtype not in _LAYOUT:  # integers exactly (below 2^53), float16 as float32
            m = m.astype(np.float64 if m.dtype.kind in "iub" else np.float32)
        mats.append(m)
    return mats, k


def local_exponents(rows: np.ndarray) -> np.ndarray:
    """Per column of ``rows`` [micro-batches, elements]: the frexp exponent of its largest
    magnitude (int16), ``EMPTY`` for an all-zero column, ``NONFINITE`` if some value is inf
    or NaN."""
    utype, mbits, emask, bias = _LAYOUT[rows.dtype]
    bits = rows.view(utype)
    magnitude = utype(~(1 << (8 * bits.itemsize - 1)) & ((1 << 8 * bits.itemsize) - 1))
    if len(bits) > 16:  # many micro-batches: one vectorised reduction
        top = np.bitwise_and(bits, magnitude).max(axis=0)
    else:  # a few: row by row, without a temporary of the stack's size
        top = bits[0] & magnitude
        scratch = np.empty_like(top)
        for row in bits[1:]:
            np.bitwise_and(row, magnitude, out=scratch)
            np.maximum(top, scratch, out=top)
    biased = (top >> utype(mbits)).astype(np.int16)
    out = biased - np.int16(bias)
    tiny = np.flatnonzero(biased == 0)  # zeros and denormals
    if tiny.size:
        top_tiny = top[tiny]
        _, length = np.frexp(top_tiny.astype(np.float64))  # bit length of the mantissa
        out[tiny] = np.where(top_tiny == 0, EMPTY, length - (mbits + bias))
    out[biased == emask] = NONFINITE
    return out


def _powers_of_two(exps: np.ndarray, out: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """(2^(F - E), 2^(E - F)) per element as float64 built from their bits (1.0 where E is
    EMPTY or NONFINITE), or None if one is outside float64's normal range (float64
    denormals). ``out``: an int64 scratch of the same size for the first."""
    e = np.empty(exps.shape, np.int64) if out is None else out
    np.subtract(FRACTION_BITS, exps, out=e)
    e[(exps == EMPTY) | (exps == NONFINITE)] = 0
    if e.size and (e.min() < -1022 or e.max() > 1022):
        return None
    e += 1023
    e <<= 52
    return e.view(np.float64), ((2046 << 52) - e).view(np.float64)  # exponent field negated


def to_fixed(rows: np.ndarray, exps: np.ndarray, out: np.ndarray | None = None,
             tmp: np.ndarray | None = None, scale: np.ndarray | None = None) -> np.ndarray:
    """Column sums of ``rows`` in fixed point relative to ``exps`` (int64, exact): each value
    times 2^(F - E) (exact: a power of two), rounded to an integer, summed modulo 2^64 (exact
    whenever the true sum fits, which the headroom guarantees). ``scale``: 2^(F - E) if
    known."""
    if scale is None:
        powers = _powers_of_two(exps)
        scale = None if powers is None else powers[0]
    acc = np.empty(rows.shape[1], np.int64) if out is None else out
    tmp = np.empty(rows.shape[1], np.float64) if tmp is None else tmp
    shift = None
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite columns become NaN later
        for i, row in enumerate(rows):
            tmp[:] = row
            if scale is not None:
                tmp *= scale
            else:  # float64 denormals: powers beyond float64's normal range
                if shift is None:
                    shift = np.where((exps == EMPTY) | (exps == NONFINITE), 0,
                                     FRACTION_BITS - exps.astype(np.int64))
                np.ldexp(tmp, shift, out=tmp)
            tmp += _MAGIC  # |tmp| <= 2^F < 2^51: its low mantissa bits are the integer
            if i:
                acc += tmp.view(np.int64)
            else:
                acc[:] = tmp.view(np.int64)
    acc -= (len(rows) * _MAGIC_BITS + 2 ** 63) % 2 ** 64 - 2 ** 63  # modulo 2^64
    return acc


def from_fixed(sums: np.ndarray, exps: np.ndarray, out: np.ndarray | None = None,
               unscale: np.ndarray | None = None) -> np.ndarray:
    """Inverse of ``to_fixed``'s scaling (float64); NaN where a contribution was not finite.
    ``unscale``: 2^(E - F) if known."""
    if unscale is None:
        powers = _powers_of_two(exps)
        unscale = None if powers is None else powers[1]
    out = np.empty(sums.shape, np.float64) if out is None else out
    out[:] = sums  # EMPTY columns summed to 0
    if unscale is not None:
        out *= unscale
    else:
        np.ldexp(out, np.where((exps == EMPTY) | (exps == NONFINITE), 0,
                               exps.astype(np.int64) - FRACTION_BITS), out=out)
    out[exps == NONFINITE] = np.nan
    return out


def _scratch(node: Any, n: int) -> tuple[np.ndarray, ...]:
    """int16 exponents [n], int64 sums [n + 1], float64 [n] and int64 [n] temporaries, kept in
    the node's state across steps (fresh multi-megabyte buffers page-fault on every call)."""
    state = getattr(node, "state", {})
    bufs = state.get("exact_scratch")
    if bufs is None or bufs[0].size != n:
        bufs = (np.empty(n, np.int16), np.empty(n + 1, np.int64), np.empty(n, np.float64),
                np.empty(n, np.int64))
        state["exact_scratch"] = bufs
    return bufs


def exact_allreduce(comm: Any, node: Any, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The ``exact`` AllReduce kernel (every backend): sum or mean over all micro-batches of
    all ranks, bit-identical whatever the rank count."""
    stacked = node.facts.stacked
    mats, k = _matrices(inputs, stacked)
    bounds = np.cumsum([0] + [m.shape[1] for m in mats])
    exps, sums, tmp, ints = _scratch(node, int(bounds[-1]))
    for m, lo, hi in zip(mats, bounds[:-1], bounds[1:]):
        exps[lo:hi] = local_exponents(m)
    distributed = comm.size > 1
    if distributed:
        comm.allreduce(exps, node, op="max").wait()
    powers = _powers_of_two(exps, ints)
    scale, unscale = powers if powers is not None else (None, None)
    if k <= 1 << HEADROOM:  # else the sums are garbage, and every rank raises below
        for m, lo, hi in zip(mats, bounds[:-1], bounds[1:]):
            to_fixed(m, exps[lo:hi], sums[lo:hi], tmp[lo:hi],
                     None if scale is None else scale[lo:hi])
    sums[-1] = k
    if distributed:
        comm.allreduce(sums, node).wait()
    total = int(sums[-1])
    if total > 1 << HEADROOM:
        raise CommError(f"exact AllReduce '{getattr(node, 'name', node)}': {total} "
                        f"micro-batches in one step, more than the {1 << HEADROOM} its int64 "
                        "fixed point can sum exactly; use a larger micro-batch")
    out = from_fixed(sums[:-1], exps, tmp, unscale)
    if node.attributes["reduction"] == "mean":
        out /= total
    return [out[lo:hi].reshape(x.shape[1:] if stacked else x.shape).astype(x.dtype)
            for x, lo, hi in zip(inputs, bounds[:-1], bounds[1:])]
