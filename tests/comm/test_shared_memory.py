"""Symmetric memory and the AllReduce through it (comm/shared.py), under the real mpiexec.

The script makes one symmetric memory on the world group and reduces buffers that lie in it
(several dtypes, sizes below and above the rank count, an offset inside the buffer, sum, max,
min and mean, each call writing the buffer right after the previous one), then one buffer outside
it; each rank writes what it got.
The tests compare every result with numpy's reduction of all ranks' inputs, bit for bit
(``exact`` inputs: multiples of 1/8 far below 2**24, so any order of summation is exact).
"""
from __future__ import annotations

import json
import mmap
import os
import time

import numpy as np
import pytest

from ngdist.comm import LocalGroup, shared
from ngdist.comm.group import divide
from ngdist.errors import CommError

CASES = [("float32", 1, 0), ("float32", 3, 0), ("float32", 37, 64), ("float64", 100, 8),
         ("int64", 5, 0), ("float32", 1000, 0)]
OPS = ("sum", "max", "min", "mean")
# (byte offset in the symmetric memory, dtype, count): the buffers of one coalesced call; the
# last two lie outside the memory
COALESCED = [(0, "float32", 1000), (4096, "float64", 37), (8192, "float32", 3),
             (None, "float32", 300), (None, "float64", 5)]


def exact(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(100 * rank + count)
    values = rng.integers(-8000, 8000, count)
    return (values if dtype == "int64" else values / 8).astype(dtype)


SCRIPT = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_shared_memory import CASES, COALESCED, OPS, exact
from ngdist.comm import world_group

world = world_group(timeout=60)
rank, size = world.rank, world.size
mem = world.symmetric(1 << 14, "buffers of the test")
report = {"made": mem is not None,
          "left": sorted(f for f in os.listdir("/dev/shm")
                         if f.startswith(f"ngdist-{os.getpid()}-"))}
results, kinds = {}, []
if mem is not None:
    for dtype, count, offset in CASES:
        for op in OPS:
            item = np.dtype(dtype).itemsize
            buf = mem.view(rank)[offset:offset + count * item].view(dtype)
            buf[:] = exact(rank, count, dtype)
            work = world.allreduce(buf, f"{dtype} {count} {op}", op=op, placed=mem.locate(buf))
            kinds.append(type(work).__name__)
            work.wait()
            results[f"{dtype}_{count}_{offset}_{op}"] = buf.copy()
if mem is not None:  # in symmetric memory but not placed: the group never looks it up
    buf = mem.view(rank)[:4 * 37].view(np.float32)
    buf[:] = exact(rank, 37, "float32")
    work = world.allreduce(buf, "a buffer in symmetric memory, not placed")
    kinds.append(type(work).__name__)
    work.wait()
    results["unplaced"] = buf.copy()
outside = exact(rank, 37, "float32")
work = world.allreduce(outside, "a buffer outside the symmetric memory")
kinds.append(type(work).__name__)
work.wait()
results["outside"] = outside
report["kinds"] = kinds
# one call for several buffers: three in the symmetric memory (two dtypes, one at an offset),
# two outside it; the barriers it takes are counted
from ngdist.comm import shared
barriers, barrier, flag_barrier = [], world.barrier, shared.Signals.barrier
world.barrier = lambda what="barrier": (barriers.append("mpi"), barrier(what))[1]
shared.Signals.barrier = lambda self, what: (barriers.append("flags"), flag_barrier(self, what))[1]
for op in ("sum", "mean"):
    inside = [] if mem is None else [
        mem.view(rank)[start:start + count * np.dtype(dtype).itemsize].view(dtype)
        for start, dtype, count in COALESCED[:3]]
    bufs = inside + [np.empty(count, dtype) for _, dtype, count in COALESCED[len(inside):]]
    for buf, (_, dtype, count) in zip(bufs, COALESCED):
        buf[:] = exact(rank, count, dtype)
    before = len(barriers)
    placed = [mem.locate(b) for b in inside] + [None] * (len(bufs) - len(inside))
    work = world.allreduce_coalesced(bufs, "several buffers", op=op, placed=placed)
    report[f"coalesced_{op}"] = [type(work).__name__] + \
        [type(w).__name__ for w in getattr(work, "works", [])]
    work.wait()
    report[f"coalesced_{op}_barriers"] = barriers[before:]
    for k, buf in enumerate(bufs):
        results[f"coalesced_{op}_{k}"] = buf.copy()
world.barrier = barrier
report["ordered_stores"] = shared.ORDERED_STORES
np.savez(f"rank{rank}.npz", **results)
with open(f"rank{rank}.json", "w") as fh:
    json.dump(report, fh)
"""


def _run(ranks, tmp_path, n: int, env: dict[str, str] | None = None) -> list[dict]:
    here = os.path.dirname(os.path.abspath(__file__))
    ranks(n, SCRIPT, args=[here], timeout=120, env=env)
    out = []
    for r in range(n):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        report["arrays"] = dict(np.load(tmp_path / f"rank{r}.npz"))
        out.append(report)
    return out


def _mean(values: np.ndarray, axis: int) -> np.ndarray:
    out = np.sum(values, axis=axis, dtype=values.dtype)  # then divide(), as MPI's path does
    divide(out, values.shape[axis])
    return out


REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "mean": _mean}


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_in_symmetric_memory_equals_numpy_on_every_rank(ranks, tmp_path, n):
    reports = _run(ranks, tmp_path, n)
    for r, rep in enumerate(reports):
        assert rep["made"], rep
        assert rep["left"] == []  # the files are unlinked once every rank has mapped them
        assert rep["kinds"] == ["SharedAllreduceWork"] * (len(CASES) * len(OPS)) + \
            ["MpiWork", "MpiWork"], rep["kinds"]
        for dtype, count, offset in CASES:
            everyone = np.stack([exact(j, count, dtype) for j in range(n)])
            for op in OPS:
                got = rep["arrays"][f"{dtype}_{count}_{offset}_{op}"]
                want = REDUCE[op](everyone, axis=0).astype(dtype)
                assert got.dtype == want.dtype
                assert got.tobytes() == want.tobytes(), (r, dtype, count, op)
        want = np.sum([exact(j, 37, "float32") for j in range(n)], axis=0, dtype=np.float32)
        np.testing.assert_array_equal(rep["arrays"]["outside"], want)
        np.testing.assert_array_equal(rep["arrays"]["unplaced"], want)  # exact values


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_a_coalesced_allreduce_reduces_every_buffer_with_one_pair_of_barriers(ranks, tmp_path,
                                                                               n):
    reports = _run(ranks, tmp_path, n)
    for r, rep in enumerate(reports):
        for op in ("sum", "mean"):
            # MPI's requests for the buffers outside, then the ones in symmetric memory
            assert rep[f"coalesced_{op}"] == ["WorkList", "MpiWork", "SharedAllreduceWork"], rep
            # for the three buffers inside: flags in the memory where the machine's stores are
            # seen in order (x86-64), else MPI's
            kind = "flags" if rep["ordered_stores"] else "mpi"
            assert rep[f"coalesced_{op}_barriers"] == [kind, kind], rep
            for k, (_, dtype, count) in enumerate(COALESCED):
                everyone = np.stack([exact(j, count, dtype) for j in range(n)])
                want = REDUCE[op](everyone, axis=0).astype(dtype)
                got = rep["arrays"][f"coalesced_{op}_{k}"]
                assert got.tobytes() == want.tobytes(), (r, op, k)


@pytest.mark.mpi
def test_switched_off_the_group_makes_no_symmetric_memory(ranks, tmp_path):
    reports = _run(ranks, tmp_path, 2, env={"NGDIST_SHM_ALLREDUCE": "0"})
    for rep in reports:
        assert rep["made"] is False
        assert rep["kinds"] == ["MpiWork"]
        for op in ("sum", "mean"):  # every buffer of a coalesced call goes to MPI
            assert rep[f"coalesced_{op}"] == ["MpiWork"], rep
            assert rep[f"coalesced_{op}_barriers"] == [], rep
            for k, (_, dtype, count) in enumerate(COALESCED):
                want = REDUCE[op](np.stack([exact(j, count, dtype) for j in range(2)]),
                                  axis=0).astype(dtype)
                assert rep["arrays"][f"coalesced_{op}_{k}"].tobytes() == want.tobytes()
        want = exact(0, 37, "float32") + exact(1, 37, "float32")
        np.testing.assert_array_equal(rep["arrays"]["outside"], want)


def test_the_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("NGDIST_SHM_ALLREDUCE", "yes")
    with pytest.raises(CommError) as err:
        shared.requested()
    assert str(err.value) == (
        "NGDIST_SHM_ALLREDUCE='yes': use 1 (AllReduce through shared memory when every rank "
        "runs on one host, the default) or 0 (always MPI's own AllReduce)")
    monkeypatch.setenv("NGDIST_SHM_ALLREDUCE", "0")
    assert shared.requested() is False
    monkeypatch.delenv("NGDIST_SHM_ALLREDUCE")
    assert shared.requested() is True


def test_blocks_start_on_cache_lines_and_cover_every_element():
    for count, itemsize, size in [(1, 4, 2), (3, 4, 4), (37, 4, 2), (1000, 8, 4), (15, 4, 2)]:
        bounds = shared.blocks(count, itemsize, size)
        assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == size + 1
        assert bounds == sorted(bounds)
        assert all(b % (shared.ALIGN // itemsize) == 0 for b in bounds[:-1] if b < count)


# rank 1 exits, or sleeps past the deadline, while rank 0 reduces a buffer in
# symmetric memory
WAITER = r"""
import json, os, sys, time
import numpy as np
from ngdist.comm import world_group

world = world_group(timeout=%(timeout)d)
mem = world.symmetric(4096, "buffers of the test")
if world.rank == 1:
    with open("pid1", "w") as fh:
        fh.write(str(os.getpid()))
    %(rank1)s
else:
    buf = mem.view(0)[:64].view(np.float32)
    start = time.monotonic()
    try:
        world.allreduce(buf, "grad-sum").wait()
        caught = None
    except Exception as exc:
        caught = {"type": type(exc).__name__, "message": str(exc)}
    with open("caught.json", "w") as fh:
        json.dump({"caught": caught, "elapsed": time.monotonic() - start}, fh)
    os._exit(0)
"""
DEAD = WAITER % {"timeout": 60, "rank1": "os._exit(0)"}
# alive, but past rank 0's deadline: until rank 0 has its result (at most 30 s)
LATE = WAITER % {"timeout": 2, "rank1": """end = time.monotonic() + 30
    while not os.path.exists("caught.json") and time.monotonic() < end:
        time.sleep(0.05)"""}


@pytest.mark.mpi
def test_a_dead_peer_fails_the_shared_allreduce_long_before_the_timeout(ranks, tmp_path):
    proc = ranks(2, DEAD, timeout=60, check=False, env={"NGDIST_WAIT": "poll"})
    seen = proc.stdout + proc.stderr
    result = json.loads((tmp_path / "caught.json").read_text())
    pid1 = int((tmp_path / "pid1").read_text())
    assert result["caught"] == {
        "type": "CommError",
        "message": f"'grad-sum' cannot complete on rank 0: the process of rank 1 (pid {pid1}) "
                   "has exited. Look at that rank's output for why it stopped"}, seen
    assert result["elapsed"] < 10, result


@pytest.mark.mpi
def test_a_dead_peer_ends_the_job_from_a_blocking_shared_allreduce(ranks, tmp_path):
    """The default wait (the watchdog's): rank 0 waits in the barrier of the AllReduce through
    symmetric memory for a rank that has exited; the watchdog ends the job, naming it."""
    start = time.monotonic()
    proc = ranks(2, DEAD, timeout=60, check=False)
    elapsed = time.monotonic() - start
    seen = proc.stdout + proc.stderr
    pid1 = int((tmp_path / "pid1").read_text())
    assert proc.returncode != 0
    assert (f"ngdist: error on rank 0: CommError: 'grad-sum' cannot complete on rank 0: the "
            f"process of rank 1 (pid {pid1}) has exited") in seen, seen
    assert not (tmp_path / "caught.json").exists()
    assert elapsed < 30, elapsed


@pytest.mark.mpi
def test_a_peer_that_never_arrives_fails_the_shared_allreduce_at_the_deadline(ranks, tmp_path):
    ranks(2, LATE, timeout=60, check=False, env={"NGDIST_WAIT": "poll"})
    result = json.loads((tmp_path / "caught.json").read_text())
    assert result["caught"]["type"] == "CommTimeoutError", result
    assert result["caught"]["message"].startswith(
        "'grad-sum' did not complete within 2 s on rank 0"), result
    assert 2 <= result["elapsed"] < 6, result


DISAGREE = r"""
import json, os
from ngdist.comm import world_group

world = world_group(timeout=60)
if world.rank == 1:
    os.environ["NGDIST_SHM_ALLREDUCE"] = "0"
try:
    world.symmetric(4096, "buffers of the test")
    caught = None
except Exception as exc:
    caught = {"type": type(exc).__name__, "message": str(exc)}
with open(f"caught{world.rank}.json", "w") as fh:
    json.dump(caught, fh)
"""


@pytest.mark.mpi
def test_ranks_that_disagree_on_the_switch_all_fail_saying_so(ranks, tmp_path):
    ranks(2, DISAGREE, timeout=60, env={"NGDIST_SHM_ALLREDUCE": "1"})
    for r in range(2):
        assert json.loads((tmp_path / f"caught{r}.json").read_text()) == {
            "type": "CommError",
            "message": "NGDIST_SHM_ALLREDUCE is 0 on some ranks and not on ranks [0]; set it "
                       "the same on every rank (mpiexec -genv NGDIST_SHM_ALLREDUCE=0, or not "
                       "at all)"}


def _memory(nbytes: int) -> shared.SymmetricMemory:
    """A one-rank symmetric memory over anonymous pages (the lookups need no other rank)."""
    return shared.SymmetricMemory(LocalGroup(timeout=5), nbytes, [mmap.mmap(-1, nbytes)])


def test_a_memory_locates_the_buffers_that_lie_in_it():
    a, b = _memory(4096), _memory(4096)
    inside = a.view(0)[128:128 + 400].view(np.float32)
    assert a.locate(inside) == shared.Placed(a, 128) and b.locate(inside) is None
    assert a.locate(inside[1:]) == shared.Placed(a, 132)
    assert b.locate(b.view(0)[64:]) == shared.Placed(b, 64)
    assert a.locate(np.zeros(100, np.float32)) is None


def test_parts_are_each_ranks_block_of_a_buffer():
    mem = _memory(4096)
    buf = mem.view(0)[256:256 + 4 * 100].view(np.float32)
    buf[:] = np.arange(100)
    (part,) = mem.parts(256, np.dtype(np.float32), 100)  # one rank: the whole buffer
    np.testing.assert_array_equal(part, np.arange(100))
    assert mem.parts(256, np.dtype(np.float32), 100)[0] is part  # made once
    # two ranks: block 1 starts on the first 64-byte line (16 floats) from the middle on
    assert shared.blocks(100, 4, 2) == [0, 64, 100]
