"""Training with gradient buckets reduced through symmetric memory (comm/shared.py): the
segment that makes a bucket writes it into the memory its AllReduce asked for, and the
result is the same as with MPI's own AllReduce.

The same script runs with ``NGDIST_SHM_ALLREDUCE`` on and off (separate launches) on 2 and 4
ranks: a digits MLP with SGD, with momentum and without (whose state is the reduced gradient
itself, a step output: such a bucket takes two memories in turn), buckets small enough that
some are flat (Concat) and some hold one large gradient. Each rank saves its parameters and
optimizer state after the steps, the AllReduce calls that went through shared memory and the
update's results written in place into reduced buckets; then it trains one trainer on every
rank's batches together, the oracle.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

STEPS = 5

# every script: the names of the AllReduce nodes whose buckets went through shared memory,
# and how many buckets each call through it reduced
COUNT_CALLS = r"""
import json
import numpy as np
from ngdist.comm import shared

calls, batches = [], []
run = shared.SharedAllreduceWork._run
def counted(self, gentle):
    names = [w.name for w in self.what]  # (the nodes of the call, all in shared memory)
    calls.extend(names if len(names) == len(self.entries) else ["some of " + str(names)])
    batches.append(len(self.entries))
    return run(self, gentle)
shared.SharedAllreduceWork._run = counted
"""

SCRIPT = COUNT_CALLS + r"""
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp((64, 512, 512, 10), seed=0), loss="softmax_cross_entropy",
                    labels="y", optimizer=ngdist.optim.SGD(lr=0.05, momentum=%(momentum)s),
                    bucket_bytes=16_000, intra_op_threads=1, overlap=False)
B = 12
for s in range(%(steps)d):
    lo = (s * tr.size + tr.rank) * B
    tr.step({"x": x[lo:lo + B], "y": y[lo:lo + B]})
np.savez(f"params_{tr.rank}.npz", **tr.state_dict())
nodes = [n.name for n in tr.executor.comm_nodes.values()]
reduced = {o for n in tr.executor.comm_nodes.values() for o in n.outputs}
# results the update writes into the memory of a reduced bucket
into_reduced = sorted(r for plans in tr.executor.planner.assigned.values() for plan in plans.values()
                      for r, (buf, _) in plan.items() if buf in reduced)
json.dump({"calls": calls, "batches": batches, "nodes": nodes, "into_reduced": into_reduced},
          open(f"report_{tr.rank}.json", "w"))
tr.close()
# the oracle: one trainer on the combined batch of every rank, no communication
one = ngdist.compile(zoo.mlp((64, 512, 512, 10), seed=0), loss="softmax_cross_entropy",
                     labels="y", optimizer=ngdist.optim.SGD(lr=0.05, momentum=%(momentum)s),
                     strategy="local", intra_op_threads=1)
for s in range(%(steps)d):
    lo = s * tr.size * B
    one.step({"x": x[lo:lo + tr.size * B], "y": y[lo:lo + tr.size * B]})
np.savez(f"oracle_{tr.rank}.npz", **one.state_dict())
"""


def _run(ranks, tmp_path, n: int, flag: str, momentum: float) -> tuple[list[dict], list[dict]]:
    ranks(n, SCRIPT % {"steps": STEPS, "momentum": momentum}, timeout=180,
          env={"NGDIST_SHM_ALLREDUCE": flag})
    params = [dict(np.load(tmp_path / f"params_{r}.npz")) for r in range(n)]
    reports = [json.loads((tmp_path / f"report_{r}.json").read_text()) for r in range(n)]
    return params, reports


def _same_on_every_rank(params: list[dict]) -> None:
    for p in params[1:]:
        assert p.keys() == params[0].keys()
        for k in p:
            assert p[k].tobytes() == params[0][k].tobytes(), k


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("n", [2, 4])
def test_buckets_reduced_in_shared_memory_train_as_mpi_does(ranks, tmp_path, n, momentum):
    on, on_rep = _run(ranks, tmp_path, n, "1", momentum)
    off, off_rep = _run(ranks, tmp_path, n, "0", momentum)
    _same_on_every_rank(on)
    _same_on_every_rank(off)
    nodes = on_rep[0]["nodes"]
    assert len(nodes) >= 3  # flat buckets and single large gradients
    for rep in on_rep:
        # the first call of each bucket goes through MPI and asks for the memory; every
        # later one finds its input there
        assert sorted(rep["calls"]) == sorted(nodes * (STEPS - 1)), rep
        # comm in program order: the buckets of the one stage, one after another, are
        # reduced in one call, between one pair of barriers
        assert rep["batches"] == [len(nodes)] * (STEPS - 1), rep
    assert all(rep["calls"] == [] for rep in off_rep)
    # the update writes a result into the reduced fc1 weight gradient's memory (its symmetric
    # memory, or the buffer MPI reduced in place); without momentum that gradient is the
    # state the step returns, which no result may be written over
    for rep in (*on_rep, *off_rep):
        assert bool(rep["into_reduced"]) == bool(momentum), rep
    oracle = dict(np.load(tmp_path / "oracle_0.npz"))
    states = [k for k in on[0] if k.endswith(".momentum")]
    assert len(states) == 6  # a weight and a bias per layer
    for k in oracle:  # parameters and optimizer state (plain SGD's: the last mean gradient)
        np.testing.assert_allclose(on[0][k], oracle[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for k in on[0]:
        if n == 2:  # a sum of two is the same in any order: bit for bit
            assert on[0][k].tobytes() == off[0][k].tobytes(), k
        else:  # four ranks: MPI sums in its own order
            np.testing.assert_allclose(on[0][k], off[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
    for k in (*states, *(k for k in oracle if k.endswith((".weight", ".bias")))):
        assert not np.array_equal(on[0][k], np.zeros_like(on[0][k])), k


STATE_SCRIPT = COUNT_CALLS + r"""
from onnx import TensorProto, helper
from ngdist.comm import world_group
from ngdist.ir.domain import DOMAIN
from ngdist.runtime.executor import Executor
from ngdist.runtime.sessions import CPU

# s_new = mean over the ranks of s transposed: the state the step returns is the AllReduce's
# result, and the next step's input to it is made from that state by a Transpose, which
# must not write into the memory it reads
f = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [16, 16])
graph = helper.make_graph(
    [helper.make_node("Transpose", ["s"], ["g"], name="turn"),
     helper.make_node("AllReduce", ["g"], ["s_new"], name="ngdist/allreduce/bucket0",
                      domain=DOMAIN, reduction="mean", bucket=0)],
    "step", [f("s")], [f("s_new")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(DOMAIN, 1)])
model.ir_version = 10
group = world_group(timeout=60)
ex = Executor(model, group, overlap=False, donate={"s": "s_new"})
s = CPU.value((np.arange(256, dtype=np.float32).reshape(16, 16) * (group.rank + 1)))
values, addresses = [], []
for _ in range(%(steps)d):
    s = ex.run({"s": s})["s_new"]
    values.append(s.numpy().copy())
    addresses.append(s.numpy().__array_interface__["data"][0])
np.save(f"values_{group.rank}.npy", np.stack(values))
json.dump({"calls": calls, "batches": batches, "addresses": addresses}, open(f"report_{group.rank}.json", "w"))
"""


@pytest.mark.parametrize("n", [2, 4])
def test_a_reduced_state_the_next_step_reads_takes_two_memories_in_turn(ranks, tmp_path, n):
    steps = 6
    ranks(n, STATE_SCRIPT % {"steps": steps}, timeout=120)
    start = np.arange(256, dtype=np.float32).reshape(16, 16)
    want, s = [], np.mean([start * (r + 1) for r in range(n)], axis=0)
    for _ in range(steps):
        s = s.T
        want.append(s)
    for r in range(n):
        got = np.load(tmp_path / f"values_{r}.npy")
        np.testing.assert_array_equal(got, np.stack(want))
        rep = json.loads((tmp_path / f"report_{r}.json").read_text())
        # the first call goes through MPI and makes the first memory; every later call
        # reduces in shared memory, alternating between two
        assert rep["calls"] == ["ngdist/allreduce/bucket0"] * (steps - 1)
        assert rep["batches"] == [1] * (steps - 1)
        later = rep["addresses"][1:]
        assert len(set(later)) == 2 and later[0::2] == [later[0]] * len(later[0::2]), later
