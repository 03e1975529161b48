"""Cutting global batches into the ranks' shards: ``trainer.shard`` (a mixin of the Trainer).

Each rank takes a contiguous slice of every global batch (``np.array_split``'s, or whole
micro-batches in reproducible mode); an array with k rows per sample (per-token rows) gives
the k rows of each of the rank's samples. The first global batch's digest is compared across
ranks (ngdist/data/digest.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ngdist.data.digest import first_batch_checked
from ngdist.errors import InputError
from ngdist.runtime.batch_checks import batch_samples, leaf_sizes, sample_rows

logger = logging.getLogger(__name__)


class GlobalBatches:
    """``shard`` for a trainer with ``role``, ``num_workers``, ``rank``, ``micro_batch``,
    ``stats_group`` and ``timeline``."""

    _uneven_logged = False

    def shard(self, batches: Iterable[Any]) -> Iterator[Any]:
        """This rank's contiguous slice of every global batch (dict, tuple or array); nothing
        on a dedicated parameter-server rank. An array with k rows per sample (per-token rows)
        gives the k rows of each of this rank's samples."""
        if self.role == "server":
            return
        for batch in first_batch_checked(batches, self.stats_group):
            t0 = time.perf_counter()
            n = self._check_global_batch(batch)
            mine = self._slice(batch, n, self._sample_bounds(n))
            timeline = self.timeline
            if timeline is not None:
                timeline.record("feed", "shard batch", t0, time.perf_counter())
            yield mine

    def _check_global_batch(self, batch: Any) -> int:
        """Every array of a global batch holds the same number of samples (or a whole number of
        rows per sample), at least one per training rank; uneven shards are allowed and logged
        once. The number of samples."""
        sizes = leaf_sizes(batch)
        if not sizes:
            return 0
        n, w = batch_samples(sizes, "the global batch"), self.num_workers
        m = self.micro_batch
        if m and n % m == 0:  # whole micro-batches to every rank
            if n // m < w:
                raise InputError(f"the global batch has {n // m} micro-batch(es) of {m} samples "
                                 f"for {w} training ranks, so some rank's shard would be empty: "
                                 f"the global batch must have at least as many micro-batches as "
                                 f"ranks ({w * m} samples or more)")
            uneven = (n // m) % w != 0
        else:
            if n < w:
                raise InputError(f"the global batch has {n} sample(s) for {w} training ranks, so "
                                 f"some rank's shard would be empty: the global batch must have "
                                 f"at least as many samples as ranks ({w})")
            uneven = n % w != 0
        if uneven and not self._uneven_logged:
            self._uneven_logged = True
            logger.info("the global batch of %d samples does not divide evenly over %d ranks: "
                        "shards differ by up to %d sample(s) (np.array_split), and the averaged "
                        "gradient weighs a sample of a smaller shard slightly more (logged once)",
                        n, w, m or 1)
        return n

    def _sample_bounds(self, n: int) -> tuple[int, int]:
        """This rank's samples of a global batch of ``n``: whole micro-batches in reproducible
        mode, else the ``np.array_split`` shard."""
        w, r, m = self.num_workers, self.rank, self.micro_batch
        if m and n % m == 0:
            k = n // m
            return m * (k * r // w), m * (k * (r + 1) // w)
        q, extra = divmod(n, w)
        return r * q + min(r, extra), (r + 1) * q + min(r + 1, extra)

    def _slice(self, batch: Any, n: int, bounds: tuple[int, int]) -> Any:
        if isinstance(batch, Mapping):
            return {k: self._slice(v, n, bounds) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(self._slice(v, n, bounds) for v in batch)
        arr = np.asarray(batch)
        if not arr.ndim:
            raise InputError(f"a global batch holds a scalar ({arr!r}); trainer.shard() splits "
                             "arrays along axis 0: give every input one row per sample")
        return arr[sample_rows(arr.shape[0], n, *bounds)]
