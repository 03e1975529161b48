"""What the sharding tests read back from their ranks: each rank's ``<stem><rank>.npz``,
checked to hold the same bytes on every rank (the gathered parameters)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def same_on_every_rank(tmp_path: Path, n: int, stem: str = "params") -> dict[str, np.ndarray]:
    """Rank 0's arrays of ``<stem><rank>.npz``, after checking every rank's are the same
    bytes."""
    got = [dict(np.load(tmp_path / f"{stem}{r}.npz")) for r in range(n)]
    for key, value in got[0].items():
        for r, other in enumerate(got[1:], 1):
            assert other[key].tobytes() == value.tobytes(), f"{key}: rank {r} differs"
    return got[0]
