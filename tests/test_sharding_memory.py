"""A rank's memory limit (runtime/sessions.py, runtime/segments.py) under real mpiexec:
``NGDIST_CPU_ARENA_MAX_MB`` caps onnxruntime's CPU arena, one arena shared by a process's
sessions; a step that needs more stops every rank with an ``OutOfMemoryError`` naming the
segment, the limit and what to do (not onnxruntime's raw allocator message); under a limit the
step fits, the losses are the same bytes as without one; a malformed limit is refused."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ngdist.errors import NgdistError
from ngdist.runtime.sessions import arena_limit_mb

SCRIPT = r"""
import json, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.errors import ExecutionError, OutOfMemoryError

rank = ngdist.rank()
rng = np.random.default_rng(rank)
feed = {"x": rng.random((8, 64)).astype(np.float32), "y": rng.integers(0, 10, 8)}
out = {}
try:
    tr = ngdist.compile(zoo.mlp((64, 512, 512, 10), seed=0), strategy="allreduce",
                        optimizer=ngdist.optim.AdamW(lr=1e-3), intra_op_threads=1, timeout=60,
                        shard=sys.argv[1])
    out["losses"] = np.array([tr.step(feed).loss for _ in range(3)], np.float32).tobytes().hex()
    tr.close()
except OutOfMemoryError as exc:
    out["error"] = str(exc)
    out["is_memory_error"] = isinstance(exc, MemoryError) and isinstance(exc, ExecutionError)
with open(f"out.{rank}.json", "w") as f:
    json.dump(out, f)
"""

MESSAGE = re.compile(
    r"out of memory in segment \d+ \(\d+ nodes, .+\): onnxruntime's CPU arena is limited to "
    r"1 MiB \(NGDIST_CPU_ARENA_MAX_MB\) and the step asked for \d+ bytes more; raise the "
    r"limit, shard the parameters over the ranks \(shard='parameters'\), or use smaller "
    r"batches")


def _run(ranks, tmp_path, n: int, shard: str, limit: str | None) -> list[dict]:
    env = {"NGDIST_CPU_ARENA_MAX_MB": limit} if limit is not None else {}
    ranks(n, SCRIPT, args=[shard], env=env, timeout=100)
    return [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(n)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shard", ["none", "parameters"])
def test_arena_limit_stops_every_rank_with_the_limit_named(ranks, tmp_path, shard):
    got = _run(ranks, tmp_path, 2, shard, "1")
    for out in got:
        assert "losses" not in out
        assert MESSAGE.fullmatch(out["error"]), out["error"]
        assert out["is_memory_error"]


@pytest.mark.timeout(200)
def test_a_limit_the_step_fits_trains_the_same_bytes(ranks, tmp_path):
    limited = _run(ranks, tmp_path, 2, "none", "64")
    free = _run(ranks, tmp_path, 2, "none", None)
    assert [o["losses"] for o in limited] == [o["losses"] for o in free]
    assert all("error" not in o for o in limited)


@pytest.mark.parametrize("text", ["abc", "0", "-5", "1.5"])
def test_a_malformed_limit_is_refused(monkeypatch, text):
    monkeypatch.setenv("NGDIST_CPU_ARENA_MAX_MB", text)
    with pytest.raises(NgdistError) as info:
        arena_limit_mb()
    assert str(info.value) == (f"NGDIST_CPU_ARENA_MAX_MB={text!r}: give a whole number of "
                               "MiB (at least 1), or unset it for an arena without a limit")


def test_no_limit_when_unset(monkeypatch):
    monkeypatch.delenv("NGDIST_CPU_ARENA_MAX_MB", raising=False)
    assert arena_limit_mb() is None


def test_the_executors_step_proto_leaves_the_values_out():
    """The step proto the executor's plan keeps (and whose graph ranks compare) holds the
    structure and the constants, not the values of the parameters, optimizer state and
    hyperparameters (rank 0's are broadcast; the trainer feeds them), copied field by field
    from the step proto (no whole copy of it)."""
    import onnx
    import onnx_ir as ir
    from onnx import numpy_helper

    import ngdist
    from ngdist import zoo

    tr = ngdist.compile(zoo.mlp((64, 256, 10), seed=0), strategy="local",
                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    proto = ir.to_proto(tr.step_model)
    held = {n for n, role in tr.meta.roles.items() if role != "data"}
    def fingerprint(p):
        return tr._without_values(ir.from_proto(p)).SerializeToString(deterministic=True)

    before = fingerprint(proto)
    assert len(before) < 20_000  # the 64 x 256 weight alone is 65 KB
    for t in proto.graph.initializer:
        if t.name in held:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + 1, t.name))
    assert fingerprint(proto) == before
    proto.graph.node[0].attribute.append(onnx.helper.make_attribute("alpha", 2.0))
    assert fingerprint(proto) != before
    tr.close()


def _data_bytes(t) -> int:
    return len(t.raw_data) + 4 * (len(t.float_data) + len(t.int32_data)) + \
        8 * (len(t.int64_data) + len(t.double_data))


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_trainers_keep_no_whole_copy_of_their_values(shard):
    """Every trainer (not only sharded ones) drops the data of the values it holds from its
    templates (the inference model; the step graph's tensors read the current values when
    used), hyperparameters aside; what it saves, predicts and schedules is filled from its
    values: the same bytes as the values."""
    import numpy as np
    from onnx import numpy_helper

    import ngdist
    from ngdist import zoo

    tr = ngdist.compile(zoo.mlp((64, 256, 10), seed=0), strategy="allreduce", shard=shard,
                        optimizer=ngdist.optim.AdamW(lr=0.01), intra_op_threads=1, timeout=60)
    held = {n for n, r in tr.meta.roles.items() if r not in ("data", "hyper")}
    assert held and held <= set(tr.values)
    assert all(_data_bytes(t) == 0 for t in tr.inference.graph.initializer if t.name in held)
    import onnx_ir as ir

    lazy = {n: v.const_value for n, v in tr.step_model.graph.initializers.items() if n in held}
    assert lazy and all(isinstance(t, ir.LazyTensor) for t in lazy.values())  # no data held
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((8, 64)).astype(np.float32), "y": rng.integers(0, 10, 8)}
    tr.set_lr_schedule(lambda s: 0.5)  # its base rate read from the step graph
    for _ in range(3):
        tr.step(feed)
    assert tr.lr == {0: pytest.approx(0.005)}
    state = tr.state_dict()
    step = tr.to_onnx()
    saved = {t.name: numpy_helper.to_array(t) for t in step.graph.initializer}
    for t in step.training_info[0].algorithm.initializer:
        saved[t.name] = numpy_helper.to_array(t)
    assert set(state) <= set(saved)
    for name, t in lazy.items():  # the step graph's tensors read the current values
        assert t.numpy().tobytes() == tr.values[name].numpy().tobytes(), name
    for name, value in state.items():
        assert saved[name].tobytes() == value.tobytes(), name
    sess = ngdist.runtime.sessions.make_session(tr.inference_model())
    assert np.array_equal(tr.predict({"x": feed["x"]})[0], sess.run(None, {"x": feed["x"]})[0])
    tr.close()


def test_gathered_parameters_are_freed_at_their_last_use_not_held_between_steps(monkeypatch):
    """ZeRO-3 (one process: the gathers run as comm items): each AllGather's parameters are
    views of one gathered buffer (no copy), and once a step is over no buffer gathered in it
    is alive: neither a segment's binding nor the executor holds it until the next step."""
    import gc
    import weakref

    import numpy as np

    import ngdist
    from ngdist import zoo
    from ngdist.kernels import collectives

    buffers: list[weakref.ref] = []
    views: list[bool] = []
    original = collectives.cut_views

    def recording(flat, dims, ndims):
        out = original(flat, dims, ndims)
        buffers.append(weakref.ref(flat.base if flat.base is not None else flat))
        views.extend(np.shares_memory(v, flat) for v in out)
        return out

    monkeypatch.setattr(collectives, "cut_views", recording)
    tr = ngdist.compile(zoo.mlp((64, 256, 256, 10), seed=0), strategy="allreduce",
                        shard="parameters", optimizer=ngdist.optim.AdamW(lr=0.01),
                        intra_op_threads=1, timeout=60, bucket_bytes=100_000)
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((8, 64)).astype(np.float32), "y": rng.integers(0, 10, 8)}
    for _ in range(2):
        tr.step(feed)
    gc.collect()
    assert len(buffers) >= 8 and views and all(views), (len(buffers), views)
    alive = [r for r in buffers if r() is not None]
    assert not alive, f"{len(alive)} of {len(buffers)} gathered buffers outlive their step"
    tr.close()


LIMITED = r"""
import json, resource, sys
from pathlib import Path
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.errors import OutOfMemoryError

model = zoo.mlp((64, 3072, 3072, 3072, 10), seed=0)  # 19.1 M parameters, AdamW
size = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmSize:"))
cap = size * 1024 + int(sys.argv[2]) * 2**20  # what the process spans now, and the headroom
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
rank = ngdist.rank()
rng = np.random.default_rng(rank)
feed = {"x": rng.random((8, 64)).astype(np.float32), "y": rng.integers(0, 10, 8)}
out = {"cap": cap >> 20}
try:
    tr = ngdist.compile(model, strategy="allreduce", optimizer=ngdist.optim.AdamW(lr=1e-3),
                        intra_op_threads=1, timeout=60, shard=sys.argv[1])
    out["losses"] = [tr.step(feed).loss for _ in range(5)]
    tr.close()
except OutOfMemoryError as exc:
    out["error"] = str(exc)
with open(f"limited.{rank}.json", "w") as f:
    json.dump(out, f)
"""

LIMIT_MESSAGE = re.compile(
    r"out of memory in .+: this process's address space is limited to (\d+) MiB \(RLIMIT_AS\) "
    r"and the step asked for (?:\d+ bytes )?more; raise the limit, shard the parameters over "
    r"the ranks \(shard='parameters'\), or use smaller batches")


@pytest.mark.mpi
@pytest.mark.timeout(280)
def test_a_model_allreduce_cannot_start_under_a_memory_limit_trains_sharded(ranks, tmp_path):
    """Every rank limited to its address space at start plus 725 MiB (RLIMIT_AS; glibc's
    per-thread malloc arenas, 64 MiB of address space each whatever they hold, limited to two):
    plain allreduce, whose ranks each hold the whole parameters, AdamW moments and gradients,
    stops in its first step on every rank with an OutOfMemoryError naming the limit and what
    to do; shard='parameters' on 4 ranks trains the same model and its loss goes down."""
    env = {"MALLOC_ARENA_MAX": "2"}
    got = {}
    for shard in ("none", "parameters"):
        ranks(4, LIMITED, args=[shard, "725"], env=env, timeout=120)
        got[shard] = [json.loads((tmp_path / f"limited.{r}.json").read_text())
                      for r in range(4)]
    for out in got["none"]:
        assert "losses" not in out, out
        found = LIMIT_MESSAGE.fullmatch(out["error"])
        assert found and int(found.group(1)) == out["cap"], out["error"]
    for out in got["parameters"]:
        losses = out.get("losses")
        assert losses and all(np.isfinite(losses)) and losses[-1] < losses[0], out


def test_out_of_memory_names_the_limit_in_force(monkeypatch):
    """An allocation refused by onnxruntime's capped arena, by numpy or by MPI is an
    OutOfMemoryError naming the limit in force (the arena's cap, else RLIMIT_AS) and how much
    was asked where it is known; any other error is not one."""
    import resource

    from ngdist.errors import OutOfMemoryError
    from ngdist.runtime.sessions import out_of_memory

    tail = ("; raise the limit, shard the parameters over the ranks (shard='parameters'), or "
            "use smaller batches")
    monkeypatch.setenv("NGDIST_CPU_ARENA_MAX_MB", "7")
    arena = out_of_memory("segment 3", RuntimeError("Available memory of 12 is smaller than "
                                                    "requested bytes of 4096"))
    assert isinstance(arena, OutOfMemoryError)
    assert str(arena) == ("out of memory in segment 3: onnxruntime's CPU arena is limited to 7 "
                          "MiB (NGDIST_CPU_ARENA_MAX_MB) and the step asked for 4096 bytes "
                          "more" + tail)
    monkeypatch.delenv("NGDIST_CPU_ARENA_MAX_MB")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = "this process has no more memory" if soft == resource.RLIM_INFINITY else \
        f"this process's address space is limited to {soft >> 20} MiB (RLIMIT_AS)"
    try:
        np.empty((1 << 40, 1 << 20), np.float32)
    except MemoryError as exc:
        numpy_error = exc
    assert str(out_of_memory("ngdist.AllGather 'g' on rank 1", numpy_error)) == (
        f"out of memory in ngdist.AllGather 'g' on rank 1: {limit} and the step asked for "
        f"{4 << 60} bytes more" + tail)
    mpi = RuntimeError("Other MPI error, error stack:\nMPIR_Iallreduce_impl(5185): \n"
                       "MPIR_Iallreduce_intra_sched_reduce_scatter_allgather(34): Out of memory")
    assert str(out_of_memory("ngdist.AllReduce 'b' on rank 0", mpi)) == (
        f"out of memory in ngdist.AllReduce 'b' on rank 0: {limit} and the step asked for more"
        + tail)
    assert out_of_memory("segment 1", RuntimeError("Invalid rank for input")) is None


def test_each_rank_cuts_the_slice_of_the_padded_flat_without_making_it():
    """rank_slice gives row r of the bucket's padded flat (ir/shards.py ``padded``), for
    slices that start and end inside a tensor, cover several, and hold padding only."""
    from ngdist.ir.shards import padded, rank_slice

    rng = np.random.default_rng(0)
    group = {"params": [{"count": 6}, {"count": 1}, {"count": 3}]}
    names = ["a", "b", "c"]
    full = {"a": rng.random((2, 3)), "c": rng.random(3)}  # b missing: zeros
    for ranks in (3, 4, 5):
        size = -(-10 // ranks)  # 10 elements padded to ranks * size
        whole = padded({**group, "size": size}, names, full, np.float32, ranks)
        for r in range(ranks):
            got = rank_slice({**group, "size": size}, names, full, np.float32, ranks, r)
            assert got.shape == (1, size) and got.dtype == np.float32
            assert got.tobytes() == whole[r * size:(r + 1) * size].tobytes(), (ranks, r)
