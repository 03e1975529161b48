"""``strategy="local"`` inside a multi-rank job: a local trainer made on one rank communicates
with nobody (no start-up collectives), trains and evaluates while the other ranks wait at a
barrier, and ends with the bytes of the same local trainer in a process of its own. The job's
NGDIST_CHECKPOINT_* and NGDIST_TIMELINE belong to its distributed trainer: the local one writes
neither."""
from __future__ import annotations

import numpy as np
import pytest

SCRIPT = r"""
import numpy as np
import ngdist
from ngdist.data import load_digits
from ngdist.zoo import mlp

x, y = load_digits()[:2]
if ngdist.rank() == 0:
    trainer = ngdist.compile(mlp((64, 16, 10), seed=0), strategy="local", timeout=60,
                             intra_op_threads=1, optimizer=ngdist.optim.SGD(lr=0.1))
    assert (trainer.rank, trainer.size) == (0, 1)
    for i in range(5):
        trainer.step({"x": x[32 * i:32 * (i + 1)], "y": y[32 * i:32 * (i + 1)]})
    result = trainer.evaluate({"x": x[:200], "y": y[:200]})
    np.savez("local.npz", loss=np.float64(result.loss), **trainer.parameters())
    trainer.close()
ngdist.barrier(timeout=60)
print(f"rank {ngdist.rank()} passed the barrier", flush=True)
"""


@pytest.mark.mpi
def test_a_local_trainer_on_one_rank_of_a_4_rank_job(ranks, tmp_path):
    env = {"NGDIST_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "NGDIST_CHECKPOINT_EVERY": "1",
           "NGDIST_TIMELINE": str(tmp_path / "trace.json")}
    proc = ranks(4, SCRIPT, timeout=180, env=env)
    for r in range(4):
        assert f"rank {r} passed the barrier" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "trace.json").exists()
    got = dict(np.load(tmp_path / "local.npz"))

    import ngdist
    from ngdist.data import load_digits
    from ngdist.zoo import mlp

    x, y = load_digits()[:2]
    alone = ngdist.compile(mlp((64, 16, 10), seed=0), strategy="local", intra_op_threads=1,
                           optimizer=ngdist.optim.SGD(lr=0.1), timeline=False)
    for i in range(5):
        alone.step({"x": x[32 * i:32 * (i + 1)], "y": y[32 * i:32 * (i + 1)]})
    expected = alone.parameters()
    assert sorted(expected) == sorted(k for k in got if k != "loss")
    for name, value in expected.items():
        assert got[name].tobytes() == value.tobytes(), name
    assert got["loss"] == alone.evaluate({"x": x[:200], "y": y[:200]}).loss
    from onnx import numpy_helper

    initial = {t.name: numpy_helper.to_array(t) for t in mlp((64, 16, 10), seed=0).graph
               .initializer}
    assert np.abs(expected["fc0.weight"] - initial["fc0.weight"]).max() > 1e-3  # it trained
