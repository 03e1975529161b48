"""Steps/s of ngdist (allreduce) next to PyTorch on the same CNN, data and settings.

``zoo.digits_cnn()``: Conv3x3(32) - Relu - Conv3x3(64) - Relu - MaxPool2x2 - Flatten -
Gemm(128) - Relu - Gemm(10) on the bundled digits as 1 x 8 x 8 images, batch 128 per rank,
SGD with momentum 0.9, one intra-op thread per rank. Same harness as
``benchmarks/mlp_allreduce.py``: eager PyTorch on 1 rank, DistributedDataParallel (gloo) on
more, both launched by the same mpiexec in one run, best of ``--repeats`` alternating runs.

    python benchmarks/cnn_allreduce.py [--steps 100] [--warmup 10] [--ranks 1 2] [--repeats 3]
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_allreduce import Bench, main  # noqa: E402


def _onnx_cnn() -> Any:
    from ngdist import zoo

    return zoo.digits_cnn(seed=0)


def _torch_cnn() -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))


CNN = Bench("CNN conv32-conv64-pool-fc128 (zoo.digits_cnn)", str(Path(__file__).resolve()),
            _onnx_cnn, _torch_cnn, images=True)

if __name__ == "__main__":
    main(CNN)
