"""Training with gradient buckets reduced through symmetric memory (comm/shared.py): the
segment that makes a bucket writes it into the memory its AllReduce asked for, and the
result is the same as with MPI's own AllReduce.

The same script runs with ``NGDIST_SHM_ALLREDUCE`` on and off (separate launches) on 2 and 4
ranks: a digits MLP with SGD momentum, buckets small enough that some are flat (Concat) and
some hold one large gradient. Each rank saves its parameters after the steps, the number of
AllReduce calls that went through shared memory and the update's results written in place
into reduced buckets; then it trains one trainer on every rank's batches together, the oracle.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

STEPS = 5

SCRIPT = r"""
import json
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.comm import shared
from ngdist.data import load_digits

calls = []
run = shared.SharedAllreduceWork._run
def counted(self, gentle):
    calls.append(self.what.name)
    return run(self, gentle)
shared.SharedAllreduceWork._run = counted

x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp((64, 512, 512, 10), seed=0), loss="softmax_cross_entropy",
                    labels="y", optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                    bucket_bytes=16_000, intra_op_threads=1)
B = 12
for s in range(%(steps)d):
    lo = (s * tr.size + tr.rank) * B
    tr.step({"x": x[lo:lo + B], "y": y[lo:lo + B]})
params = {k: np.asarray(v) for k, v in tr.parameters().items()}
np.savez(f"params_{tr.rank}.npz", **params)
nodes = [n.name for n in tr.executor.comm_nodes.values()]
reduced = {o for n in tr.executor.comm_nodes.values() for o in n.outputs}
# results the update writes into the memory of a reduced bucket
into_reduced = sorted(r for plans in tr.executor._inplace.values() for plan in plans.values()
                      for r, (buf, _) in plan.items() if buf in reduced)
json.dump({"calls": calls, "nodes": nodes, "into_reduced": into_reduced},
          open(f"report_{tr.rank}.json", "w"))
tr.close()
# the oracle: one trainer on the combined batch of every rank, no communication
one = ngdist.compile(zoo.mlp((64, 512, 512, 10), seed=0), loss="softmax_cross_entropy",
                     labels="y", optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                     strategy="local", intra_op_threads=1)
for s in range(%(steps)d):
    lo = s * tr.size * B
    one.step({"x": x[lo:lo + tr.size * B], "y": y[lo:lo + tr.size * B]})
np.savez(f"oracle_{tr.rank}.npz", **{k: np.asarray(v) for k, v in one.parameters().items()})
""" % {"steps": STEPS}


def _run(ranks, tmp_path, n: int, flag: str) -> tuple[list[dict], list[dict]]:
    ranks(n, SCRIPT, timeout=180, env={"NGDIST_SHM_ALLREDUCE": flag})
    params = [dict(np.load(tmp_path / f"params_{r}.npz")) for r in range(n)]
    reports = [json.loads((tmp_path / f"report_{r}.json").read_text()) for r in range(n)]
    return params, reports


def _same_on_every_rank(params: list[dict]) -> None:
    for p in params[1:]:
        assert p.keys() == params[0].keys()
        for k in p:
            assert p[k].tobytes() == params[0][k].tobytes(), k


@pytest.mark.parametrize("n", [2, 4])
def test_buckets_reduced_in_shared_memory_train_as_mpi_does(ranks, tmp_path, n):
    on, on_rep = _run(ranks, tmp_path, n, "1")
    off, off_rep = _run(ranks, tmp_path, n, "0")
    _same_on_every_rank(on)
    _same_on_every_rank(off)
    nodes = on_rep[0]["nodes"]
    assert len(nodes) >= 3  # flat buckets and single large gradients
    for rep in on_rep:
        # the first call of each bucket goes through MPI and asks for the memory; every
        # later one finds its input there
        assert sorted(rep["calls"]) == sorted(nodes * (STEPS - 1)), rep
    assert all(rep["calls"] == [] for rep in off_rep)
    # the update writes a result into the reduced fc1 weight gradient's memory (its symmetric
    # memory, or the buffer MPI reduced in place)
    for rep in (*on_rep, *off_rep):
        assert rep["into_reduced"], rep
    oracle = dict(np.load(tmp_path / "oracle_0.npz"))
    for k in on[0]:
        np.testing.assert_allclose(on[0][k], oracle[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for k in on[0]:
        if n == 2:  # a sum of two is the same in any order: bit for bit
            assert on[0][k].tobytes() == off[0][k].tobytes(), k
        else:  # four ranks: MPI sums in its own order
            np.testing.assert_allclose(on[0][k], off[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert not np.array_equal(on[0][k], np.zeros_like(on[0][k]))
