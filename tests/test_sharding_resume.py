"""Sharded checkpoints across levels and rank counts under real mpiexec: a ZeRO-3 trainer on
2 ranks saves a standard model (``trainer.save`` gathers parameters and optimizer state) that
resumes on 4 ranks under ZeRO-1 and ZeRO-3 and, saved again there, on one process; each
continues as the uninterrupted run does within 1e-6 (the same global batches; another rank
count sums in another order). ``state_dict()`` of a sharded trainer holds whole
per-parameter tensors, and ``load_state_dict`` of them into a fresh sharded trainer continues
bit for bit."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from sharding_ranks import same_on_every_rank

import ngdist
from ngdist.data import load_digits
from ngdist.ir.model import load_proto

GLOBAL = 32  # samples per step, cut into the ranks' shards

COMMON = r"""
import json
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()


def make(shard, model=None):
    return ngdist.compile(model or zoo.mlp((64, 32, 16, 10), seed=0), timeout=60,
                          loss="softmax_cross_entropy", labels="y", bucket_bytes=2048,
                          optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9), shard=shard)


def steps(t, first, count):
    for i in range(first, first + count):
        (mine,) = t.shard([(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])])
        t.step({"x": mine[0], "y": mine[1]})
"""

TWO = COMMON + r"""
t = make("parameters")
steps(t, 0, 10)
state = t.state_dict()  # (collective) whole tensors
t.save("two.onnx")
steps(t, 10, 10)
np.savez(f"two{t.rank}.npz", **t.parameters())
json.dump({k: list(v.shape) for k, v in state.items()}, open(f"state{t.rank}.json", "w"))
t.close()
u = make("parameters")
u.load_state_dict(state)
steps(u, 10, 10)
np.savez(f"loaded{u.rank}.npz", **u.parameters())
"""

FOUR = COMMON + r"""
out = {}
for level in ("optimizer", "parameters"):
    t = ngdist.compile("two.onnx", shard=level, timeout=60)
    steps(t, 10, 5)
    if level == "parameters":
        t.save("four.onnx")
    steps(t, 15, 5)
    out.update({f"{level}.{k}": v for k, v in t.parameters().items()})
    t.close()
np.savez(f"four{t.rank}.npz", **out)
"""


@pytest.mark.mpi
@pytest.mark.timeout(420)
def test_zero3_checkpoint_resumes_on_4_ranks_and_on_one(ranks, tmp_path):
    ranks(2, TWO, timeout=190)
    two = [same_on_every_rank(tmp_path, 2, "two")]
    loaded = [same_on_every_rank(tmp_path, 2, "loaded")]
    state = json.loads((tmp_path / "state0.json").read_text())
    for k, v in two[0].items():
        assert loaded[0][k].tobytes() == v.tobytes(), k  # load_state_dict: the same bits
        assert state[k] == list(v.shape) and state[f"{k}.momentum"] == list(v.shape), k
    assert not any("shard" in k for k in state), sorted(state)
    saved = load_proto(tmp_path / "two.onnx")  # a standard model: no shard, no comm op
    names = {t.name for t in saved.graph.initializer} | \
        {t.name for t in saved.training_info[0].algorithm.initializer}
    assert set(two[0]) | {f"{k}.momentum" for k in two[0]} <= names
    assert not any("shard" in n for n in names)
    assert not any(n.domain == "ngdist" for n in saved.training_info[0].algorithm.node)

    ranks(4, FOUR, timeout=190)
    four = [same_on_every_rank(tmp_path, 4, "four")]
    for level in ("optimizer", "parameters"):  # 2 -> 4 ranks
        for k, v in two[0].items():
            np.testing.assert_allclose(four[0][f"{level}.{k}"], v, rtol=0, atol=1e-6,
                                       err_msg=f"{level} {k}")
    x, y, _, _ = load_digits()  # 4 -> 1: the file saved on 4 ranks after step 15
    one = ngdist.compile(str(tmp_path / "four.onnx"), strategy="allreduce")
    for i in range(15, 20):
        one.step({"x": x[GLOBAL * i:GLOBAL * (i + 1)], "y": y[GLOBAL * i:GLOBAL * (i + 1)]})
    for k, v in one.parameters().items():
        np.testing.assert_allclose(v, four[0][f"parameters.{k}"], rtol=0, atol=1e-6,
                                   err_msg=k)
        np.testing.assert_allclose(v, two[0][k], rtol=0, atol=1e-6, err_msg=k)
    momentum = {t.name: onnx.numpy_helper.to_array(t)
                for t in load_proto(tmp_path / "four.onnx").training_info[0].algorithm.initializer}
    assert all(np.count_nonzero(momentum[f"{k}.momentum"]) > 0 for k in two[0])
