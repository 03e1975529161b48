"""Do the ranks hold the same global batch? ``trainer.shard`` gives each rank a slice of the
global batch it is handed; when the ranks' loaders shuffle differently, each slice comes from a
different global batch and nothing else would notice. ``first_batch_checked(batches, group)``
passes the batches through and, on the first one, compares a digest of it across the ranks
(one 32-byte allgather per ``shard`` call), logging one warning per process when they differ.

The digest (``batch_digest``) is cheap: every array's dtype and shape, and its bytes when it
holds at most ``WHOLE_BYTES``, else ``ROWS`` rows spread evenly along axis 0.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

WHOLE_BYTES = 1 << 16
ROWS = 16
_warned = False


def batch_digest(batch: Any) -> bytes:
    """SHA-256 over the arrays of a (nested) batch: dtype, shape and sampled bytes."""
    h = hashlib.sha256()
    for name, leaf in _leaves(batch, ""):
        a = np.asarray(leaf)
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        if a.ndim and a.nbytes > WHOLE_BYTES:
            a = np.take(a, np.linspace(0, len(a) - 1, ROWS).astype(np.int64), axis=0)
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


def _leaves(batch: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(batch, Mapping):
        for k in sorted(batch, key=str):
            yield from _leaves(batch[k], f"{prefix}.{k}")
    elif isinstance(batch, (tuple, list)):
        for i, v in enumerate(batch):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, batch


def differing_ranks(group: Any, digest: bytes) -> list[int]:
    """The world ranks of ``group`` whose ``digest`` differs from its first rank's
    (collective)."""
    mine = np.frombuffer(digest, np.uint8).copy()
    table = np.empty((group.size, mine.size), np.uint8)
    group.allgather(mine, table, "comparison of the ranks' first global batch").wait()
    world = group.world_ranks()
    return [world[r] for r in range(group.size) if not np.array_equal(table[r], table[0])]


def first_batch_checked(batches: Iterable[Any], group: Any | None) -> Iterator[Any]:
    """``batches`` unchanged; the first one's digest compared across ``group`` (the training
    ranks; None or one rank: nothing to compare)."""
    global _warned
    first = True
    for batch in batches:
        if first and group is not None and group.size > 1:
            differ = differing_ranks(group, batch_digest(batch))
            if differ and not _warned:
                _warned = True
                logger.warning(
                    "the ranks hold different global batches (ranks %s differ from rank %d on "
                    "the first one): trainer.shard gives each rank a slice of the batch it is "
                    "handed, so each trains on a slice of a different batch. Shuffle with the "
                    "same seed on every rank, or give each rank its own slice with "
                    "ngdist.data.DistributedSampler", differ, group.world_ranks()[0])
        first = False
        yield batch
