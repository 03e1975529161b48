"""``DistributedSampler``: every rank derives the same global order of the samples and takes
its contiguous slice of each global batch, as ``trainer.shard`` slices a global batch.

``DistributedSampler(n_samples, batch_size, shuffle=True, seed=0, drop_last=False)``, with
``batch_size`` samples per rank (a global batch of ``batch_size * size``), yields this rank's
index arrays, one per step; ``set_epoch(e)`` reshuffles (the order of epoch ``e`` is a
permutation drawn from ``numpy.random.default_rng([seed, e])``: the same on every rank, every
machine and every run). Iterating ``global_batches()`` gives the global index arrays that the
ranks' slices make up: N ranks with the sampler train as one process on those global batches.

The end of an epoch: with ``drop_last=True`` only whole global batches; with ``False`` (torch's
default) every sample at least once: the order is padded, as torch's ``DistributedSampler``
pads, by repeating its first samples until its length is a multiple of the rank count, and the
last global batch is the shorter rest, split evenly.

How it differs from ``torch.utils.data.DistributedSampler``: torch deals samples out strided
(rank r takes every N-th index) and shuffles with ``torch.randperm``; here each global batch is
a contiguous run of the order and the permutation is numpy's, so the global batches equal those
of a one-process loader over the same order (what ``trainer.shard`` of global batches gives).

``torch_loader(dataset, sampler, **kwargs)``: a ``torch.utils.data.DataLoader`` whose batches
are this rank's (``batch_sampler=``); call ``sampler.set_epoch(e)`` before each epoch.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ngdist.errors import InputError

__all__ = ["DistributedSampler", "torch_loader"]


class DistributedSampler:
    """See the module docstring. ``rank`` / ``size``: this rank among the training ranks
    (default: the job's, as ``ngdist.rank()`` / ``ngdist.size()``; with dedicated parameter
    servers pass the worker's index and the number of workers)."""

    def __init__(self, n_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int | None = None,
                 size: int | None = None) -> None:
        if rank is None or size is None:
            from ngdist.comm import world_rank_size

            job_rank, job_size = world_rank_size()
            rank = job_rank if rank is None else rank
            size = job_size if size is None else size
        for name, value, low in (("n_samples", n_samples, 1), ("batch_size", batch_size, 1),
                                 ("size", size, 1), ("rank", rank, 0)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise InputError(f"DistributedSampler: {name} must be an integer of at least "
                                 f"{low}, got {value!r}")
        if rank >= size:
            raise InputError(f"DistributedSampler: rank {rank} is not below size {size}")
        if drop_last and n_samples < batch_size * size:
            raise InputError(f"DistributedSampler: {n_samples} samples make no whole global "
                             f"batch of {batch_size} x {size} ranks with drop_last=True; "
                             "use drop_last=False or a smaller batch_size")
        if not drop_last and n_samples < size:
            raise InputError(f"DistributedSampler: {n_samples} samples cannot give each of "
                             f"{size} ranks one")
        self.n_samples, self.batch_size = int(n_samples), int(batch_size)
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.rank, self.size = int(rank), int(size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration gives (torch's ``set_epoch``)."""
        self.epoch = int(epoch)

    def order(self) -> np.ndarray:
        """The epoch's order of every sample index (int64), the same on every rank."""
        if not self.shuffle:
            return np.arange(self.n_samples, dtype=np.int64)
        rng = np.random.default_rng([self.seed, self.epoch])
        return rng.permutation(self.n_samples).astype(np.int64)

    def global_batches(self) -> Iterator[np.ndarray]:
        """The epoch's global batches (index arrays); the ranks' slices make them up."""
        order, full = self.order(), self.batch_size * self.size
        if self.drop_last:
            order = order[:len(order) - len(order) % full]
        else:
            pad = -len(order) % self.size
            order = np.concatenate([order, np.resize(order, pad)]) if pad else order
        for start in range(0, len(order), full):
            yield order[start:start + full]

    def __iter__(self) -> Iterator[np.ndarray]:
        for batch in self.global_batches():
            share = len(batch) // self.size  # whole, see the padding above
            yield batch[self.rank * share:(self.rank + 1) * share]

    def __len__(self) -> int:
        full = self.batch_size * self.size
        if self.drop_last:
            return self.n_samples // full
        return -(-self.n_samples // full)


class _TorchBatches:
    """The sampler as torch's ``batch_sampler``: lists of int indices."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.sampler:
            yield batch.tolist()

    def __len__(self) -> int:
        return len(self.sampler)


def torch_loader(dataset: Any, sampler: DistributedSampler, **kwargs: Any) -> Any:
    """A ``torch.utils.data.DataLoader`` over ``dataset`` giving this rank's batches of
    ``sampler``; ``kwargs`` go to the DataLoader (``num_workers``, ``collate_fn``, ...; not
    ``batch_size``, ``shuffle``, ``sampler`` or ``drop_last``: the sampler decides those)."""
    taken = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(kwargs))
    if taken:
        raise InputError(f"torch_loader: {', '.join(taken)} come(s) from the "
                         "DistributedSampler; set them there")
    if len(dataset) != sampler.n_samples:
        raise InputError(f"torch_loader: the dataset holds {len(dataset)} samples, the sampler "
                         f"was made for {sampler.n_samples}")
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_sampler=_TorchBatches(sampler), **kwargs)
