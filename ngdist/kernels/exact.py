"""AllReduce ``algorithm="exact"``: a sum that does not depend on grouping or order.

A floating-point sum depends on the order of its additions, so an ordinary allreduce of
per-rank gradients gives different bits on 2 and on 3 ranks. This kernel sums in per-element
fixed point instead, where addition is exact and associative:

1. Each input is a stack of *micro-batch values* ``[k, *shape]`` (``node.state["stacked"]``,
   set by runtime/microbatch.py), or one value per rank (``k = 1``).
2. Per element ``j``: ``E_j`` = the largest binary exponent (``np.frexp``) over all
   micro-batches of all ranks, through one ``MAX`` Iallreduce of int16 exponents. Zeros count
   as ``EMPTY`` (the int16 minimum, neutral for MAX), so a zero never costs precision;
   a non-finite value as ``NONFINITE`` (the int16 maximum): that element's result is NaN.
3. Every micro-value ``x`` (``|x| < 2^E_j``) becomes ``rint(x * 2^(F - E_j))``, an int64 of
   magnitude at most ``2^F`` with ``F = 62 - HEADROOM``: ``ldexp`` only moves the exponent
   (exact for float32 and float64 inputs, denormals included), and negative values round
   symmetrically. The integers are summed locally and with one ``SUM`` Iallreduce of int64
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
collectives instead of one.
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


def _rows(inputs: Sequence[np.ndarray], stacked: bool) -> tuple[np.ndarray, int]:
    """The inputs as one float64 matrix [micro-batches, elements] and the micro-batch count."""
    k = int(inputs[0].shape[0]) if stacked else 1
    if stacked and any(x.ndim == 0 or x.shape[0] != k for x in inputs):
        raise CommError(f"exact AllReduce: stacked inputs disagree on the number of "
                        f"micro-batches: {[x.shape for x in inputs]}")
    rows = np.empty((k, sum(x.size // k for x in inputs)), np.float64)
    offset = 0
    for x in inputs:
        n = x.size // k
        rows[:, offset:offset + n] = x.reshape(k, n)
        offset += n
    return rows, k


def local_exponents(rows: np.ndarray) -> np.ndarray:
    """Per column: the largest frexp exponent of its nonzero values (int16), ``EMPTY`` for an
    all-zero column, ``NONFINITE`` where some value is inf or NaN."""
    finite = np.isfinite(rows)
    _, exps = np.frexp(np.where(finite, rows, 0.0))
    exps = np.where(rows == 0, EMPTY, exps)
    out = exps.max(axis=0, initial=EMPTY).astype(np.int16)
    out[~finite.all(axis=0)] = NONFINITE
    return out


def to_fixed(rows: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """Column sums of ``rows`` in fixed point relative to ``exps`` (int64, exact)."""
    usable = (exps != EMPTY) & (exps != NONFINITE)
    shift = np.where(usable, FRACTION_BITS - exps.astype(np.int64), 0)
    values = np.where(np.isfinite(rows), rows, 0.0)
    fixed = np.rint(np.ldexp(values, shift)).astype(np.int64)
    return fixed.sum(axis=0, dtype=np.int64)


def from_fixed(sums: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """Inverse of ``to_fixed``'s scaling (float64); NaN where a contribution was not finite."""
    out = np.ldexp(sums.astype(np.float64), exps.astype(np.int64) - FRACTION_BITS)
    out[exps == EMPTY] = 0.0
    out[exps == NONFINITE] = np.nan
    return out


def exact_allreduce(comm: Any, node: Any, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The ``exact`` AllReduce kernel (every backend): sum or mean over all micro-batches of
    all ranks, bit-identical whatever the rank count."""
    from_name = getattr(node, "name", node)
    rows, k = _rows(inputs, bool(node.state.get("stacked")))
    exps = local_exponents(rows)
    distributed = comm.size > 1 and comm.world is not None
    if distributed:
        from mpi4py import MPI

        comm.wait(comm.world.Iallreduce(MPI.IN_PLACE, exps, op=MPI.MAX), node)
        comm.bytes_sent += exps.nbytes
    sums = np.empty(rows.shape[1] + 1, np.int64)
    sums[:-1] = to_fixed(rows, exps)
    sums[-1] = k
    if distributed:
        comm.wait(comm.world.Iallreduce(MPI.IN_PLACE, sums, op=MPI.SUM), node)
        comm.bytes_sent += sums.nbytes
    total = int(sums[-1])
    if total > 1 << HEADROOM:
        raise CommError(f"exact AllReduce '{from_name}': {total} micro-batches in one step, "
                        f"more than the {1 << HEADROOM} its int64 fixed point can sum "
                        "exactly; use a larger micro-batch")
    out = from_fixed(sums[:-1], exps)
    if node.attributes.get("reduction", "mean") == "mean":
        out /= total
    results, offset = [], 0
    for x in inputs:
        shape = x.shape[1:] if node.state.get("stacked") else x.shape
        n = int(np.prod(shape, dtype=np.int64))
        results.append(out[offset:offset + n].reshape(shape).astype(x.dtype))
        offset += n
    return results
