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


# The device path (values handed to kernels as DLPack views in the placement's array module,
# results wrapped back from DLPack) on the CPU: a stand-in array module over numpy whose arrays
# are not numpy arrays, so the runtime takes exactly the branches it takes with cupy.
DEVICE_SCRIPT = r"""
import ctypes, json
import numpy as np, onnxruntime as ort
import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.runtime import comm_runner, executor


class FakeDevice:
    '''An array module whose arrays are device arrays to the runtime (not numpy arrays).'''
    made = 0

    class Array:
        def __init__(self, a):
            self.a = a
            FakeDevice.made += 1
        def __array_namespace__(self):
            return FakeDevice
        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)
        def __dlpack_device__(self):
            return self.a.__dlpack_device__()
        def reshape(self, *shape):
            return FakeDevice.Array(self.a.reshape(*shape))
        def __setitem__(self, key, value):
            self.a[key] = value.a if isinstance(value, FakeDevice.Array) else value
        shape = property(lambda self: self.a.shape)
        dtype = property(lambda self: self.a.dtype)
        flags = property(lambda self: self.a.flags)
        nbytes = property(lambda self: self.a.nbytes)
        size = property(lambda self: self.a.size)

    @staticmethod
    def from_dlpack(value):  # (writable, as cupy's: numpy's own import is read-only)
        ro = np.from_dlpack(value)
        if ro.nbytes == 0:
            return FakeDevice.Array(np.empty(ro.shape, ro.dtype))
        raw = (ctypes.c_char * ro.nbytes).from_address(ro.__array_interface__["data"][0])
        return FakeDevice.Array(np.frombuffer(raw, ro.dtype).reshape(ro.shape))
    @staticmethod
    def asnumpy(x):
        return x.a.copy()
    @staticmethod
    def asarray(h):
        return FakeDevice.Array(np.asarray(h))


x, y, _, _ = load_digits()
B = 16
feed = lambda s: {"x": x[s * B:(s + 1) * B], "y": y[s * B:(s + 1) * B]}
def trainer():
    return ngdist.compile(zoo.mlp((64, 32, 10), seed=0), loss="softmax_cross_entropy",
                          labels="y", optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                          bucket_bytes=2_000, intra_op_threads=1, overlap=False)
host = trainer()
for s in range(4):
    host.step(feed(s), fetch_stats=False)
for mod in (comm_runner, executor):
    mod.device_module = lambda placement: FakeDevice
dev = trainer()
assert dev.executor.plan.comm_nodes and all(
    n.facts.memory == "device" for n in dev.executor.plan.comm_nodes.values())
for s in range(3):
    dev.step(feed(s), fetch_stats=False)
counts = {"numpy": 0, "from_numpy": 0}
numpy, from_numpy = ort.OrtValue.numpy, ort.OrtValue.ortvalue_from_numpy
def spy_numpy(self, *a, **k):
    counts["numpy"] += 1
    return numpy(self, *a, **k)
def spy_from_numpy(*a, **k):
    counts["from_numpy"] += 1
    return from_numpy(*a, **k)
ort.OrtValue.numpy = spy_numpy
ort.OrtValue.ortvalue_from_numpy = staticmethod(spy_from_numpy)
made = FakeDevice.made
dev.step(feed(3), fetch_stats=False)
ort.OrtValue.numpy, ort.OrtValue.ortvalue_from_numpy = numpy, staticmethod(from_numpy)
same = {n: v.tobytes() == host.parameters()[n].tobytes() for n, v in dev.parameters().items()}
json.dump({**counts, "views": FakeDevice.made - made, "same": same},
          open(f"device_{ngdist.rank()}.json", "w"))
"""


@pytest.mark.mpi
def test_device_path_step_never_goes_through_numpy(ranks, tmp_path):
    """One step on the device path: parameters, optimizer state and gradients never go
    through numpy (``OrtValue.numpy`` is never called; ``ortvalue_from_numpy`` only for the
    two batch inputs), the kernels get DLPack views, and training matches the host path bit
    for bit."""
    ranks(2, DEVICE_SCRIPT, timeout=180)
    for r in range(2):
        rep = json.loads((tmp_path / f"device_{r}.json").read_text())
        assert rep["numpy"] == 0, rep
        assert rep["from_numpy"] == 2, rep  # x and y
        assert rep["views"] > 0, rep  # the kernels read device views (not host copies)
        assert rep["same"] and all(rep["same"].values()), rep


def test_a_device_array_result_is_wrapped_without_numpy():
    """A kernel's new device array (not an input handed back) becomes an OrtValue over the
    same memory through DLPack, on a device placement (no GPU needed: the wrap is the same)."""
    import ctypes

    import numpy as np
    import onnxruntime as ort

    from ngdist.runtime.comm_runner import CommRunner
    from ngdist.runtime.sessions import Placement

    class Device:  # an array that is not a numpy array, with DLPack
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    runner = CommRunner.__new__(CommRunner)
    runner.placement = Placement("cuda", 0)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    (value,) = runner.wrap([Device(a)], [], [])
    assert isinstance(value, ort.OrtValue) and value.shape() == [2, 3]
    assert value.data_ptr() == a.ctypes.data
    assert ctypes.c_float.from_address(value.data_ptr() + 4 * 5).value == 5.0
