"""``ngdist train --lr-schedule``: the schedule runs on every rank (2 ranks under mpiexec), and
a wrong spec is refused before any rank starts."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import ngdist_train


@pytest.mark.mpi
def test_a_step_decay_schedule_sets_the_lr_of_every_step(train_files):
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "digits.npz", "-n", "2",
                        "--batch-size", "32", "--optimizer", "sgd:lr=0.1",
                        "--lr-schedule", "step_decay:step_size=4,gamma=0.5", "--save",
                        "trained.onnx")
    assert proc.returncode == 0, proc.stderr
    alg = onnx.load(train_files / "trained.onnx").training_info[0].algorithm
    values = {t.name: numpy_helper.to_array(t) for t in alg.initializer}
    assert int(values["ngdist.step"]) == 10  # 640 samples, 64 a global batch
    # the last step (9 done before it) ran at 0.1 * 0.5 ** (9 // 4)
    assert values["ngdist.lr"] == np.float32(np.float32(0.1) * 0.25)


def test_a_wrong_schedule_is_refused_before_the_ranks_start(train_files):
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "digits.npz", "-n", "2",
                        "--lr-schedule", "warmup_linear:warmpu=3")
    assert proc.returncode != 0
    assert "unknown key 'warmpu' for lr schedule 'warmup_linear' in 'warmup_linear:warmpu=3'" \
        "; did you mean 'warmup'? Valid keys of warmup_linear: total, warmup" in proc.stderr
    assert "rank" not in proc.stderr.lower()
