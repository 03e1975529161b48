"""Data for the ranks: ``DistributedSampler`` and ``torch_loader`` (data/sampler.py), and
bundled real data.

``digits.npz``: the 1,797 8x8 handwritten digits (UCI ML "Optical Recognition of Handwritten
Digits", Alpaydin & Kaynak 1998, as distributed with scikit-learn as ``load_digits``), pixel
values 0..16, labels 0..9. Bundled so that the demo and tests need no download.
"""
from __future__ import annotations

from importlib import resources

import numpy as np

from ngdist.data.sampler import DistributedSampler, torch_loader

__all__ = ["DistributedSampler", "load_digits", "torch_loader"]


def load_digits(test_fraction: float = 0.2, seed: int = 0, images: bool = False
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x scaled to [0, 1] float32, y int64.

    ``images=True`` gives x as N x 1 x 8 x 8 (for CNNs) instead of N x 64.
    The split is a fixed permutation from ``seed``, the same on every rank.
    """
    with resources.files(__package__).joinpath("digits.npz").open("rb") as fh:
        data = np.load(fh)
        x = data["images"].astype(np.float32) / 16.0
        y = data["labels"].astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    if images:
        x = x.reshape(-1, 1, 8, 8)
    n_test = int(round(len(x) * test_fraction))
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]
