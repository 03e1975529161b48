"""Replicas and micro-batching (runtime/replicas.py, runtime/microbatch.py) place every value
they make on the trainer's placement: the towers' slices of the batch and the values crossing
to the rest go through ``Placement.value``, as the trainer's own values do."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import ngdist
from ngdist import zoo
from ngdist.passes.pipeline import rewrite
from ngdist.runtime.sessions import Placement
from ngdist.runtime.trainer import Trainer

MADE: list[tuple[int, ...]] = []


@dataclass(frozen=True)
class Counting(Placement):
    """The CPU placement, recording the shape of every value it makes."""

    def value(self, array, onnx_type=None):
        MADE.append(tuple(np.shape(array)))
        return super().value(array, onnx_type)


@pytest.mark.parametrize("options, devices, slices", [({}, 2, 2),
                                                      ({"reproducible_micro_batch": 4}, 1, 4)])
def test_towers_and_their_results_are_placed_by_the_placement(options, devices, slices):
    training = ngdist.to_training_model(zoo.mlp((8, 16, 3), seed=0),
                                        optimizer=ngdist.optim.SGD(lr=0.1))
    tr = Trainer(rewrite(training, "allreduce", **options), device=Counting(),
                 devices_per_worker=devices)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 8)).astype(np.float32),
             "y": rng.integers(0, 3, 16).astype(np.int64)}
    MADE.clear()
    tr.step(batch)
    # each tower's slice of x (and y), then the gradients and the loss crossing to the rest
    assert MADE.count((16 // slices, 8)) == slices, MADE
    assert (16, 8) in MADE or (8, 16) in MADE, MADE  # a gradient of the 8x16 weight
    tr.close()
