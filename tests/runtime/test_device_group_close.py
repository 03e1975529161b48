"""A trainer on a device placement closes the device group it made (an NcclGroup's
communicator) when it closes, once; a group it was given, or the host group, stays open.

No GPU here: the CUDA placement's values are made on the CPU (its ``value`` patched) and the
device group is a host group standing in for an NcclGroup that records ``close``. The
trainer is only built and closed (its sessions, made at the first step, are never asked for).
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import ngdist
from ngdist import zoo
from ngdist.comm.local import LocalGroup
from ngdist.passes.pipeline import rewrite
from ngdist.runtime import trainer as trainer_module
from ngdist.runtime.sessions import Placement


def _local_step():
    return rewrite(ngdist.to_training_model(zoo.mlp((8, 4, 3), seed=0),
                                            optimizer=ngdist.optim.SGD(lr=0.1)), "local")


class RecordingGroup(LocalGroup):
    """A one-rank group standing in for an NcclGroup: counts its ``close`` calls."""

    def __init__(self) -> None:
        super().__init__(30.0)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def _values_on_the_cpu(self: Placement, array: np.ndarray, onnx_type: int | None = None
                       ) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(array)


@pytest.fixture
def device_trainer(monkeypatch):
    made: list[RecordingGroup] = []

    def device_group(host, comm, device_id, compute_stream=None):
        made.append(RecordingGroup())
        return made[-1]

    monkeypatch.setattr(trainer_module, "device_group", device_group)
    monkeypatch.setattr(Placement, "value", _values_on_the_cpu)
    model = _local_step()
    tr = trainer_module.Trainer(model, group=LocalGroup(30.0), device=Placement("cuda"),
                                intra_op_threads=1)
    return tr, made


def test_close_closes_the_device_group_the_trainer_made(device_trainer):
    tr, made = device_trainer
    assert len(made) == 1 and tr.group is made[0] and made[0].closed == 0
    tr.close()
    assert made[0].closed == 1


def test_a_cpu_trainer_closes_no_group(monkeypatch):
    closed: list[int] = []
    monkeypatch.setattr(LocalGroup, "close", lambda self: closed.append(1), raising=False)
    model = _local_step()
    tr = trainer_module.Trainer(model, group=LocalGroup(30.0), intra_op_threads=1)
    tr.close()
    assert closed == []  # the group was given, not made: the caller's to close
