"""The ProcessGroup contract: one set of cases run on every group x array module.

Every collective (allreduce sum/mean/max/min in place, allreduce_coalesced, broadcast, reduce
in place and not, allgather, gather, reduce_scatter, grouped exchange, split, dup) on float32,
float16, int64 and bfloat16 (bfloat16 moves as bits on host groups; NCCL reduces it too), at
0, 1, 1000 elements and a few 64 MiB buffers. The oracle is numpy on every rank's input (each
rank can make every rank's data): on 2 ranks random floats (one addition is correctly rounded
in any order), on 4 integer-valued floats (every sum exact), and results are compared byte
for byte. Groups: ``LocalGroup`` (in this process), ``MpiGroup`` on 2 and 4 ranks (one mpiexec
per rank count runs every group there), ``HostStagedGroup`` over both with numpy and over MPI
with the fake cupy, and ``NcclGroup`` over the fake ``cupy.cuda.nccl`` (tests/comm/fake_nccl.py:
pointer-level calls over MPI on host memory). Then timeouts (the poll raises; the watchdog
aborts the communicator, then the job) and a dead peer. On a GPU (marked ``gpu``) the same
cases run ``NcclGroup`` and ``HostStagedGroup`` with real cupy.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
BIG = 16 << 20  # float32 elements: 64 MiB
COUNTS = (0, 1, 1000)
DTYPES = ("float32", "float16", "int64", "bfloat16")
MOVES = ("broadcast", "allgather", "gather", "exchange")  # (cases that move bytes only)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@functools.lru_cache(maxsize=None)
def data(rank: int, size: int, count: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: random floats on 1-2 ranks, integer values on more. Made once
    per process (every rank makes every rank's input for its oracle, in every group) and
    read-only: a case writes to a copy (``Ctx.dev``)."""
    rng = np.random.default_rng(1000 * rank + 17 * salt + count)
    if dtype == "int64":
        out = rng.integers(-50, 50, count).astype(np.int64)
    elif size <= 2:
        out = rng.standard_normal(count).astype(np.float32).astype(_np_dtype(dtype))
    else:
        out = rng.integers(-8, 8, count).astype(_np_dtype(dtype))
    out.flags.writeable = False
    return out


_SUMS: dict[tuple[int, ...], tuple[list[np.ndarray], np.ndarray]] = {}


def _sum(parts: list[np.ndarray]) -> np.ndarray:
    """The exact sum (float64 or int64), rounded once to the parts' dtype; once per process
    for read-only parts (``data``'s: the cache keeps them, so their ids name them)."""
    key = tuple(map(id, parts)) if not any(p.flags.writeable for p in parts) else None
    if key in _SUMS:
        return _SUMS[key][1]
    total = parts[0].astype(np.int64 if parts[0].dtype.kind in "iu" else np.float64)
    for p in parts[1:]:
        total = total + p.astype(total.dtype)
    total = total.astype(parts[0].dtype)
    if key is not None:
        total.flags.writeable = False
        _SUMS[key] = (list(parts), total)
    return total


def _mean(total: np.ndarray, n: int) -> np.ndarray:
    """The sum's mean as every group defines it: floor division for integers; for floats
    the sum divided by n (exact here: n is 1, 2 or 4)."""
    if total.dtype.kind in "iu":
        return total // n
    return (total.astype(np.float64) / n).astype(total.dtype)


class Ctx:
    """A group and its array module (``xp``: numpy, the fake cupy or cupy)."""

    def __init__(self, group: Any, xp: Any) -> None:
        self.g, self.xp = group, xp
        self.rank, self.size = group.rank, group.size

    def dev(self, host: np.ndarray) -> Any:
        if self.xp is np:
            return host.copy()
        return self.xp.asarray(host)

    def host(self, x: Any) -> np.ndarray:
        return x.copy() if self.xp is np else self.xp.asnumpy(x)

    def mine(self, count: int, dtype: str, salt: int = 0) -> np.ndarray:
        return data(self.rank, self.size, count, dtype, salt)

    def all(self, count: int, dtype: str, salt: int = 0) -> list[np.ndarray]:
        return [data(r, self.size, count, dtype, salt) for r in range(self.size)]

    @property
    def bf16(self) -> bool:
        """Whether bfloat16 arrays go to the group as they are: NCCL takes them, on the fake
        cupy (cupy has no bfloat16; MPI no bfloat16 type)."""
        return self.g.backend == "nccl" and getattr(self.xp, "__name__", "") != "cupy"

    def bits(self, dtype: str) -> bool:
        """bfloat16 moves as uint16 bits where the group cannot take the dtype."""
        return dtype == "bfloat16" and not self.bf16


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    assert got.tobytes() == want.tobytes(), \
        f"{what}: bytes differ (first {got.reshape(-1)[:4]} vs {want.reshape(-1)[:4]})"


def _as_sent(c: Ctx, a: np.ndarray, dtype: str) -> np.ndarray:
    return a.view(np.uint16) if c.bits(dtype) else a


def case_allreduce(c: Ctx, dtype: str, count: int, op: str = "sum") -> None:
    buf = c.dev(c.mine(count, dtype))
    c.g.allreduce(buf, "contract allreduce", op=op).wait()
    parts = c.all(count, dtype)
    want = {"sum": lambda: _sum(parts), "mean": lambda: _mean(_sum(parts), c.size),
            "max": lambda: np.maximum.reduce(parts), "min": lambda: np.minimum.reduce(parts)}[op]()
    same(c.host(buf), want, f"allreduce {op}")


def case_mean(c, dtype, count):
    case_allreduce(c, dtype, count, "mean")


def case_max_min(c, dtype, count):
    case_allreduce(c, dtype, count, "max")
    case_allreduce(c, dtype, count, "min")


def case_coalesced(c: Ctx, dtype: str, count: int) -> None:
    for op in ("sum", "mean"):
        counts = (count, count + 3, 1)
        bufs = [c.dev(c.mine(n, dtype, salt=i)) for i, n in enumerate(counts)]
        c.g.allreduce_coalesced(bufs, "contract coalesced", op=op).wait()
        for i, (n, b) in enumerate(zip(counts, bufs)):
            total = _sum(c.all(n, dtype, salt=i))
            same(c.host(b), total if op == "sum" else _mean(total, c.size), f"coalesced {op} {i}")


def case_broadcast(c: Ctx, dtype: str, count: int) -> None:
    root = c.size - 1
    buf = c.dev(_as_sent(c, c.mine(count, dtype), dtype))
    c.g.broadcast(buf, root, "contract broadcast").wait()
    same(c.host(buf), _as_sent(c, c.all(count, dtype)[root], dtype), "broadcast")


def case_reduce(c: Ctx, dtype: str, count: int) -> None:
    want = _sum(c.all(count, dtype))
    send = c.dev(c.mine(count, dtype))
    recv = c.dev(np.zeros(count, _np_dtype(dtype))) if c.rank == 0 else None
    c.g.reduce(send, recv, 0, "contract reduce").wait()
    if c.rank == 0:
        same(c.host(recv), want, "reduce")
    same(c.host(send), c.mine(count, dtype), "reduce leaves send")
    buf = c.dev(c.mine(count, dtype))  # in place on the root
    c.g.reduce(buf, buf if c.rank == 0 else None, 0, "contract reduce in place").wait()
    if c.rank == 0:
        same(c.host(buf), want, "reduce in place")


def case_allgather(c: Ctx, dtype: str, count: int) -> None:
    mine = _as_sent(c, c.mine(count, dtype), dtype)
    recv = c.dev(np.zeros((c.size, count), mine.dtype))
    c.g.allgather(c.dev(mine), recv, "contract allgather").wait()
    same(c.host(recv), np.stack([_as_sent(c, a, dtype) for a in c.all(count, dtype)]),
         "allgather")


def case_gather(c: Ctx, dtype: str, count: int) -> None:
    mine = _as_sent(c, c.mine(count, dtype), dtype)
    recv = c.dev(np.zeros((c.size, count), mine.dtype)) if c.rank == 0 else None
    c.g.gather(c.dev(mine), recv, 0, "contract gather").wait()
    if c.rank == 0:
        same(c.host(recv), np.stack([_as_sent(c, a, dtype) for a in c.all(count, dtype)]),
             "gather")


def case_reduce_scatter(c: Ctx, dtype: str, count: int) -> None:
    send = c.dev(c.mine(count * c.size, dtype))
    recv = c.dev(np.zeros(count, _np_dtype(dtype)))
    c.g.reduce_scatter(send, recv, "contract reduce_scatter").wait()
    total = _sum(c.all(count * c.size, dtype))
    same(c.host(recv), total[c.rank * count:(c.rank + 1) * count], "reduce_scatter")


def case_exchange(c: Ctx, dtype: str, count: int) -> None:
    if c.size == 1:
        return
    nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    mine = _as_sent(c, c.mine(count, dtype), dtype)
    got = c.dev(np.zeros(count, mine.dtype))
    c.g.exchange([(c.dev(mine), nxt)], [(got, prv)], 11, "contract exchange").wait()
    same(c.host(got), _as_sent(c, c.all(count, dtype)[prv], dtype), "exchange")


def case_split_dup(c: Ctx, dtype: str, count: int) -> None:
    sub = c.g.split(c.rank % 2, -c.rank, "contract split")
    members = sorted((r for r in range(c.size) if r % 2 == c.rank % 2), reverse=True)
    assert sub.size == len(members) and sub.rank == members.index(c.rank)
    world = c.g.world_ranks()
    assert sub.world_ranks() == [world[r] for r in members]
    buf = c.dev(c.mine(count, dtype))
    sub.allreduce(buf, "contract split allreduce").wait()
    same(c.host(buf), _sum([data(r, c.size, count, dtype) for r in members]), "split")
    assert c.g.split(None, 0, "contract split none") is None
    dup = c.g.dup("contract dup")
    Ctx.__init__(c, dup, c.xp)
    case_allreduce(c, dtype, count)
    Ctx.__init__(c, c.g, c.xp)


CASES: dict[str, Callable[[Ctx, str, int], None]] = {
    "allreduce": case_allreduce, "mean": case_mean, "max_min": case_max_min,
    "coalesced": case_coalesced, "broadcast": case_broadcast, "reduce": case_reduce,
    "allgather": case_allgather, "gather": case_gather, "reduce_scatter": case_reduce_scatter,
    "exchange": case_exchange, "split_dup": case_split_dup}
BIG_CASES = ("allreduce",)  # the 64 MiB buffers (float32)


def run_contract(ctx: Ctx, cases: dict[str, Callable] = CASES) -> dict[str, str]:
    """``case/dtype/count`` -> "ok" or the error, for every case on one group (collective:
    every rank runs the same cases in the same order)."""
    results = {}
    for name, case in cases.items():
        for dtype in DTYPES:
            if dtype == "bfloat16" and name not in MOVES and not ctx.bf16:
                continue  # (MPI has no bfloat16 type; the runtime reduces it as float32)
            for count in COUNTS + ((BIG,) if name in BIG_CASES and dtype == "float32" else ()):
                try:
                    case(ctx, dtype, count)
                    results[f"{name}/{dtype}/{count}"] = "ok"
                except AssertionError as exc:
                    results[f"{name}/{dtype}/{count}"] = f"{type(exc).__name__}: {exc}"
    return results


# ---------------------------------------------------------------- one process: LocalGroup
def _local_groups() -> dict[str, Ctx]:
    from ngdist.comm.local import LocalGroup
    from ngdist.comm.staged import HostStagedGroup

    return {"local/numpy": Ctx(LocalGroup(30), np),
            "staged-local/numpy": Ctx(HostStagedGroup(LocalGroup(30)), np)}


@pytest.mark.parametrize("group", ["local/numpy", "staged-local/numpy"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_contract_in_one_process(group, case):
    results = run_contract(_local_groups()[group], {case: CASES[case]})
    assert results and all(v == "ok" for v in results.values()), \
        {k: v for k, v in results.items() if v != "ok"}


# ---------------------------------------------------------------- ranks under mpiexec
GROUPS_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["CONTRACT_DIR"])
import numpy as np
import fake_nccl
import test_group_contract as C
from ngdist.comm.mpi import MpiGroup
from ngdist.comm.nccl import NcclGroup
from ngdist.comm.staged import HostStagedGroup

world = MpiGroup(60)
out = {}
groups = {
    "mpi/numpy": lambda: C.Ctx(world.dup("mpi"), np),
    "staged-mpi/numpy": lambda: C.Ctx(HostStagedGroup(world.dup("staged")), np),
    "staged-mpi/fake-cupy": lambda: C.Ctx(HostStagedGroup(world.dup("staged2")),
                                          fake_nccl.cupy),
    "nccl/fake-cupy": lambda: C.Ctx(NcclGroup(world.dup("nccl"), 0,
                                              modules=fake_nccl.MODULES), fake_nccl.cupy),
    # waits order the caller's stream after the comm event instead of blocking the host
    "nccl-overlap/fake-cupy": lambda: C.Ctx(NcclGroup(
        world.dup("nccl-o"), 0, overlap=True, modules=fake_nccl.MODULES), fake_nccl.cupy),
}
for name, make in groups.items():
    t0 = time.perf_counter()
    out[name] = C.run_contract(make())
    print(f"rank {world.rank}: {name} {time.perf_counter() - t0:.1f} s", flush=True)
out["record"] = {k: len(v) for k, v in fake_nccl.RECORD.items()}
out["groups"] = sorted(set(fake_nccl.RECORD["groups"]))
json.dump(out, open(f"contract_{world.rank}.json", "w"))
world.barrier().wait()
os._exit(0)  # (the fake's stream threads are daemons; nothing is pending)
"""
GROUP_NAMES = ("mpi/numpy", "staged-mpi/numpy", "staged-mpi/fake-cupy", "nccl/fake-cupy",
               "nccl-overlap/fake-cupy")


@pytest.fixture(scope="module")
def contract_runs(tmp_path_factory):
    """One mpiexec per rank count (cached): every group's results on every rank."""
    from conftest import run_ranks

    done: dict[int, list[dict]] = {}

    def get(n: int) -> list[dict]:
        if n not in done:
            tmp = tmp_path_factory.mktemp(f"contract{n}")
            (tmp / "ids").mkdir()
            run_ranks(n, GROUPS_SCRIPT, tmp, timeout=240,
                      env={"CONTRACT_DIR": str(HERE), "NGDIST_FAKE_NCCL_DIR": str(tmp / "ids")})
            done[n] = [json.loads((tmp / f"contract_{r}.json").read_text()) for r in range(n)]
        return done[n]
    return get


@pytest.mark.mpi
@pytest.mark.timeout(280)
@pytest.mark.parametrize("group", GROUP_NAMES)
@pytest.mark.parametrize("n", [2, 4])
def test_contract_under_mpiexec(contract_runs, n, group):
    for rank, rep in enumerate(contract_runs(n)):
        results = rep[group]
        assert len(results) >= 90, len(results)
        failed = {k: v for k, v in results.items() if v != "ok"}
        assert not failed, (rank, failed)
        if group.startswith("nccl"):
            rec = rep["record"]
            assert rec["no_device"] == 0 and rec["device_syncs"] == 0, rec
            assert rec["aborts"] == 0, rec
            assert max(rep["groups"]) >= 3, rep["groups"]  # coalesced: one NCCL group


FAIL_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["CONTRACT_DIR"])
import numpy as np
import fake_nccl
from ngdist.comm.mpi import MpiGroup
from ngdist.comm.nccl import NcclGroup
from ngdist.comm.staged import HostStagedGroup

scenario, kind = sys.argv[1], sys.argv[2]
world = MpiGroup(60)
host = world.dup("for the test")
host.timeout = 30.0 if scenario == "dead" else 1.5  # (a dead peer is seen within 3 s)
group = {"mpi": lambda: host, "staged": lambda: HostStagedGroup(host),
         "nccl": lambda: NcclGroup(host, 0, modules=fake_nccl.MODULES),
         "nccl-overlap": lambda: NcclGroup(host, 0, overlap=True, modules=fake_nccl.MODULES),
         }[kind]()
xp = fake_nccl.cupy if kind.startswith("nccl") else np
if world.rank == 1:
    if scenario != "dead":  # late past rank 0's 1.5 s deadline (until it has its result or
        end = time.monotonic() + 30  # the job is aborted), then gone
        while not os.path.exists("caught.json") and time.monotonic() < end:
            time.sleep(0.05)
    os._exit(0)
buf = xp.asarray(np.ones(8, np.float32))
if scenario == "overlap":  # the wait returns at once; the next call finds it past its deadline
    group.allreduce(buf, "grad-sum").wait()
    time.sleep(2.5)
    group.allreduce(buf, "next")
    time.sleep(30)
caught = None
try:
    group.allreduce(buf, "grad-sum").wait(gentle=scenario != "watchdog")
except Exception as exc:
    caught = {"type": type(exc).__name__, "message": str(exc)}
after = None
if kind == "nccl":
    try:
        group.allreduce(buf, "next").wait()
    except Exception as exc:
        after = str(exc)
with open("caught.part", "w") as fh:  # whole when rank 1 sees it
    json.dump({"caught": caught, "aborts": fake_nccl.RECORD["aborts"], "after": after}, fh)
os.replace("caught.part", "caught.json")
os._exit(0)
"""
HINT = ("; a rank has probably died or is running a different program. Check the other ranks' "
        "output; raise the limit with timeout= or NGDIST_TIMEOUT")


def _fail(ranks, tmp_path, scenario: str, kind: str):
    (tmp_path / "ids").mkdir()
    proc = ranks(2, FAIL_SCRIPT, args=[scenario, kind], timeout=60, check=False,
                 env={"CONTRACT_DIR": str(HERE), "NGDIST_FAKE_NCCL_DIR": str(tmp_path / "ids")})
    caught = tmp_path / "caught.json"
    return proc, proc.stdout + proc.stderr, json.loads(caught.read_text()) if caught.exists() \
        else None


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["mpi", "staged", "nccl"])
def test_timeout_raises_with_the_message_of_mpi_waits(ranks, tmp_path, kind):
    proc, out, rep = _fail(ranks, tmp_path, "timeout", kind)
    assert rep is not None, out[-3000:]
    assert rep["caught"] == {
        "type": "CommTimeoutError",
        "message": "'grad-sum' did not complete within 1.5 s on rank 0 (waiting for ranks 0..1)"
                   + HINT}, out[-3000:]
    if kind == "nccl":  # the communicator was aborted, and refuses what comes next
        assert rep["aborts"] == [0]
        assert rep["after"] == ("next: this rank's NCCL communicator was aborted after an "
                                "earlier failure; the job cannot go on")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["staged", "nccl"])
def test_dead_peer_fails_the_wait(ranks, tmp_path, kind):
    proc, out, rep = _fail(ranks, tmp_path, "dead", kind)
    assert rep is not None, out[-3000:]
    assert rep["caught"]["type"] == "CommError", rep
    assert rep["caught"]["message"].startswith(
        "'grad-sum' cannot complete on rank 0: the process of rank 1 (pid "), rep
    assert rep["aborts"] == ([0] if kind == "nccl" else [])


@pytest.mark.mpi
def test_watchdog_aborts_the_communicator_then_the_job(ranks, tmp_path):
    proc, out, rep = _fail(ranks, tmp_path, "watchdog", "nccl")
    assert proc.returncode != 0 and rep is None, out[-3000:]
    message = ("ngdist: error on rank 0: CommTimeoutError: 'grad-sum' did not complete within "
               "1.5 s on rank 0 (waiting for ranks 0..1)" + HINT)
    assert message in out, out[-3000:]
    assert "fake NCCL: ncclCommAbort on rank 0" in out, out[-3000:]
    assert out.index("fake NCCL: ncclCommAbort on rank 0") < out.index(message)


@pytest.mark.mpi
def test_an_overlapped_work_past_its_deadline_ends_the_job(ranks, tmp_path):
    """With overlap the host never waits for the event; the next call sees the Work still
    pending past the deadline and ends the job as the watchdog would."""
    proc, out, rep = _fail(ranks, tmp_path, "overlap", "nccl-overlap")
    assert proc.returncode != 0 and rep is None, out[-3000:]
    message = ("ngdist: error on rank 0: CommTimeoutError: 'grad-sum' did not complete within "
               "1.5 s on rank 0 (waiting for ranks 0..1)" + HINT)
    assert message in out, out[-3000:]
    assert out.index("fake NCCL: ncclCommAbort on rank 0") < out.index(message)


# ---------------------------------------------------------------- on a GPU
def _cupy_gpu() -> str | None:
    """Why the GPU cases cannot run here, or None."""
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401
    except ImportError as exc:
        return f"needs a GPU: cupy is not installed ({exc})"
    try:
        return None if cupy.cuda.runtime.getDeviceCount() > 0 else "needs a GPU: no CUDA device"
    except Exception as exc:  # noqa: BLE001 - no driver
        return f"needs a GPU: no CUDA device ({exc})"


# two ranks on one GPU: NCCL talks over loopback sockets, each rank its own host identity
# (set before NCCL starts; docs/gpu.md)
ONE_GPU_ENV = """os.environ.update(NCCL_HOSTID="ngdist-r" + os.environ.get("PMI_RANK", "0"),
    NCCL_NET="Socket", NCCL_SOCKET_IFNAME="lo", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
    NCCL_IB_DISABLE="1")
"""


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(_cupy_gpu() is not None, reason=str(_cupy_gpu()))
def test_contract_on_the_gpu(ranks, tmp_path):
    """NcclGroup and HostStagedGroup with cupy on 2 ranks of one GPU (NCCL over loopback
    sockets: NCCL_HOSTID per rank, docs/gpu.md)."""
    from ngdist.comm.nccl import NcclGroup  # noqa: F401  (import errors fail here, not in ranks)

    body = GROUPS_SCRIPT.replace("import fake_nccl\n", "import cupy\n").replace(
        "import json, os, sys, time\n", "import json, os, sys, time\n" + ONE_GPU_ENV)
    body = body[:body.index("groups = {")] + (
        'groups = {"nccl/cupy": lambda: C.Ctx(NcclGroup(world.dup("n")), cupy),\n'
        '          "staged-mpi/cupy": lambda: C.Ctx(HostStagedGroup(world.dup("s")), cupy)}\n'
        "for name, make in groups.items():\n    out[name] = C.run_contract(make())\n"
        'json.dump(out, open(f"contract_{world.rank}.json", "w"))\n'
        "world.barrier().wait()\nos._exit(0)\n")
    ranks(2, body, timeout=240, env={"CONTRACT_DIR": str(HERE)})
    for r in range(2):
        rep = json.loads((tmp_path / f"contract_{r}.json").read_text())
        for name, results in rep.items():
            failed = {k: v for k, v in results.items() if v != "ok"}
            assert results and not failed, (r, name, failed)
