"""A steady-state allreduce step on CPU copies no parameter or gradient in Python code.

Two real ranks train an MLP whose buckets include several flat (Concat) buckets and single-
gradient buckets. After warm-up steps the test records, during further steps:
* every AllReduce node's call (alone or in one call with the buckets next to it): its input was donated (made in the step for it alone) and the
  kernel returned that very array, reduced in place: the same memory went to MPI and on to
  the next segment;
* every value the trainer holds after the step (parameters, momentum) is memory that a
  segment's IOBinding output produced, not an array made by Python;
* ``OrtValue.ortvalue_from_numpy`` is called only for the two batch inputs;
* tracemalloc's peak (numpy data allocations included) stays below 48 KiB, less than any
  weight matrix but the 10-class one (64 KiB and more): none of them, nor a bucket holding
  them, was copied by Python (the small ones are covered by the checks above).
"""
from __future__ import annotations

import json

import pytest

SCRIPT = r"""
import dataclasses, json, sys, tracemalloc
import numpy as np, onnxruntime as ort
import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.kernels import KERNELS
from ngdist.runtime import executor as ex

x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp((64, 256, 256, 10), seed=0), loss="softmax_cross_entropy",
                    labels="y", optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                    bucket_bytes=16_000, intra_op_threads=1)
B = 16
feed = lambda s: {"x": x[s * B:(s + 1) * B], "y": y[s * B:(s + 1) * B]}
for s in range(3):
    tr.step(feed(s))

calls, produced, wrapped = [], set(), [0]
inner = KERNELS["AllReduce"]
def spy_batch(group, nodes, inputs_list):  # consecutive buckets: one call for several
    ptrs = [[a.__array_interface__["data"][0] for a in inputs] for inputs in inputs_list]
    outs_list = inner.batch(group, nodes, inputs_list)
    for node, inputs, outs, p in zip(nodes, inputs_list, outs_list, ptrs):
        calls.append({"donated": list(node.facts.donated), "n_in": len(inputs),
                      "same": [o is i for o, i in zip(outs, inputs)],
                      "ptr_same": [o.__array_interface__["data"][0] == q
                                   for o, q in zip(outs, p)]})
    return outs_list
def spy(group, node, inputs):
    return spy_batch(group, [node], [inputs])[0]
KERNELS["AllReduce"] = dataclasses.replace(inner, fn=spy, batch=spy_batch)
for e in [tr.executor]:
    e.kernels.update({i: KERNELS["AllReduce"] for i, k in e.kernels.items()
                      if k.op_type == "AllReduce"})
run_segment = ex.Executor.run_segment
def record(self, seg, env):
    outs = run_segment(self, seg, env)
    produced.update(o.numpy().__array_interface__["data"][0] for o in outs)
    return outs
ex.Executor.run_segment = record
from_numpy = ort.OrtValue.ortvalue_from_numpy
def counted(*a, **k):
    wrapped[0] += 1
    return from_numpy(*a, **k)
ort.OrtValue.ortvalue_from_numpy = staticmethod(counted)

smallest = sorted(v.nbytes for v in tr.parameters().values() if v.ndim == 2)[1]
tracemalloc.start()
tracemalloc.reset_peak()
for s in range(3, 5):
    tr.step(feed(s), fetch_stats=False)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
held = {n: v.numpy().__array_interface__["data"][0] for n, v in tr.values.items()
        if n in tr.meta.binding}
json.dump({"calls": calls, "peak": peak, "smallest": smallest, "wrapped": wrapped[0],
           "not_produced": [n for n, p in held.items() if p not in produced]},
          open(f"report_{ngdist.rank()}.json", "w"))
"""


@pytest.mark.mpi
def test_steady_state_allreduce_step_copies_nothing_in_python(ranks, tmp_path):
    ranks(2, SCRIPT, timeout=180)
    from ngdist import zoo
    from ngdist.passes.pipeline import rewrite
    import ngdist
    graph = rewrite(ngdist.to_training_model(zoo.mlp((64, 256, 256, 10), seed=0),
                                             optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9)),
                    "allreduce", bucket_bytes=16_000).training_info[0].algorithm
    assert any(n.op_type == "Concat" for n in graph.node)  # some buckets are flat (Concat)
    for r in range(2):
        rep = json.loads((tmp_path / f"report_{r}.json").read_text())
        calls = rep["calls"]
        assert len(calls) >= 2 * 3, calls  # two steps, several buckets each
        assert all(c["n_in"] == 1 for c in calls)  # flat buckets and single large tensors
        for c in calls:
            assert c["donated"] == [True], c
            assert c["same"] == [True] and c["ptr_same"] == [True], c
        assert rep["not_produced"] == []
        assert rep["wrapped"] == 2 * 2  # x and y of each of the two steps
        assert rep["smallest"] >= 64 << 10
        assert rep["peak"] < 48 << 10, rep["peak"]
