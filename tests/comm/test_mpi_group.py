"""MpiGroup (comm/mpi.py) under the real mpiexec, on 2 and 4 ranks.

One script exercises every operation once per rank count; each rank writes what it saw to
``rank<r>.npz`` (arrays) and ``rank<r>.json`` (everything else) and the tests below check
those files against what numpy computes from every rank's inputs. The inputs of rank r come
from ``inputs(r, size)``, which the script and the tests share (the script imports this file).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from ngdist.comm.group import divide

pytestmark = pytest.mark.mpi

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "float64", "int64")


def inputs(rank: int, size: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s inputs. ``exact_*`` hold multiples of 1/8 below 2**10, so any order of
    summation is exact in float32 and the sum can be compared with numpy's bit for bit."""
    rng = np.random.default_rng(1000 + rank)
    out: dict[str, np.ndarray] = {}
    for dt in DTYPES:
        if dt == "int64":
            out[f"exact_{dt}"] = rng.integers(-2**40, 2**40, (3, 5), dtype=np.int64)
        else:
            out[f"exact_{dt}"] = (rng.integers(-8000, 8000, (3, 5)) / 8).astype(dt)
        out[f"random_{dt}"] = (rng.standard_normal(37) * 1e3).astype(dt) if dt != "int64" \
            else rng.integers(-1000, 1000, 37, dtype=np.int64)
    out["bcast"] = np.full((2, 3), 10.0 * rank + 0.5, np.float64)
    out["reduce"] = (np.arange(6, dtype=np.float64) + 100 * rank).reshape(2, 3)
    out["gather"] = np.array([[rank, rank + 0.25, -rank]], np.float32).repeat(2, axis=0)
    out["scatter"] = (np.arange(2 * size, dtype=np.int64) * (rank + 1)).reshape(size, 2)
    return out


SCRIPT = r"""
import json, os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_mpi_group import inputs
from ngdist.comm import world_group
from ngdist.comm.mpi import MpiGroup
from ngdist.errors import CommError

world = world_group(timeout=60)
rank, size = world.rank, world.size
x = inputs(rank, size)
arrays, info = {}, {"backend": world.backend, "type": type(world).__name__, "rank": rank,
                    "size": size, "local_size": world.local_size,
                    "world_ranks": world.world_ranks(), "bytes_after_start": world.bytes_sent}

# allreduce: sum, max and mean, three dtypes, in place
for kind in ("exact", "random"):
    for dt in ("float32", "float64", "int64"):
        for op in ("sum", "max", "mean"):
            buf = x[f"{kind}_{dt}"].copy()
            address = buf.__array_interface__["data"][0]
            work = world.allreduce(buf, f"allreduce {kind} {dt} {op}", op=op)
            work.wait()
            assert buf.__array_interface__["data"][0] == address
            arrays[f"allreduce_{kind}_{dt}_{op}"] = buf

# broadcast from the last rank
buf = x["bcast"].copy()
work = world.broadcast(buf, size - 1, "bcast")
info["bcast_peers"] = work.peers
work.wait()
arrays["bcast"] = buf

# reduce to rank 1: in place at the root (send is recv), and into a separate buffer
buf = x["reduce"].copy()
world.reduce(buf, buf if rank == 1 else None, 1, "reduce in place").wait()
arrays["reduce_inplace"] = buf
recv = np.zeros_like(x["reduce"]) if rank == 1 else None
send = x["reduce"].copy()
world.reduce(send, recv, 1, "reduce").wait()
arrays["reduce_send_after"] = send
if recv is not None:
    arrays["reduce_recv"] = recv

# allgather, gather to rank 1, reduce_scatter
recv = np.zeros((2 * size, 3), np.float32)
world.allgather(x["gather"], recv, "allgather").wait()
arrays["allgather"] = recv
recv = np.zeros((2 * size, 3), np.float32) if rank == 1 else None
world.gather(x["gather"], recv, 1, "gather").wait()
if recv is not None:
    arrays["gather"] = recv
recv = np.zeros(2, np.int64)
world.reduce_scatter(x["scatter"], recv, "reduce_scatter").wait()
arrays["reduce_scatter"] = recv

# exchange around the ring: tag 2 is received first, tag 1 sent first
right, left = (rank + 1) % size, (rank - 1) % size
got1, got2 = np.zeros(4, np.int64), np.zeros(4, np.int64)
w2 = world.exchange([], [(got2, left)], 2, "ring tag 2 recv")
w1 = world.exchange([(np.full(4, 10 * rank + 1, np.int64), right)], [(got1, left)], 1, "ring 1")
w3 = world.exchange([(np.full(4, 10 * rank + 2, np.int64), right)], [], 2, "ring tag 2 send")
for w in (w1, w2, w3):
    w.wait()
info["exchange_peers"] = [w1.peers, w2.peers, w3.peers]
arrays["ring_tag1"], arrays["ring_tag2"] = got1, got2

# barrier: the last rank arrives 0.5 s late; nobody leaves before it arrived
if rank == size - 1:
    time.sleep(0.5)
info["barrier_enter"] = time.time()
world.barrier("barrier").wait()
info["barrier_leave"] = time.time()

# split: even/odd, a reversed key, and color None on rank 0
evens_odds = world.split(rank % 2, rank, "split parity")
info["parity"] = {"rank": evens_odds.rank, "size": evens_odds.size,
                  "world_ranks": evens_odds.world_ranks(), "bytes": evens_odds.bytes_sent,
                  "timeout": evens_odds.timeout}
buf = np.array([rank], np.int64)
evens_odds.allreduce(buf, "parity sum").wait()
info["parity"]["sum"] = int(buf[0])
reverse = world.split(0, size - rank, "split reversed")
info["reversed"] = {"rank": reverse.rank, "world_ranks": reverse.world_ranks()}
partial = world.split(None if rank == 0 else 7, rank, "split without rank 0")
info["partial"] = None if partial is None else {"rank": partial.rank, "size": partial.size,
                                                "world_ranks": partial.world_ranks()}

# dup: the parent's message (sent first) must not match the dup's receive (posted first)
dup = world.dup("dup")
info["dup"] = {"rank": dup.rank, "size": dup.size, "world_ranks": dup.world_ranks(),
               "distinct": dup.comm != world.comm}
if rank == 0:
    on_dup, on_parent = np.zeros(3), np.zeros(3)
    wd = dup.exchange([], [(on_dup, 1)], 7, "dup recv")
    wp = world.exchange([], [(on_parent, 1)], 7, "parent recv")
    wd.wait(); wp.wait()
    arrays["dup_recv"], arrays["parent_recv"] = on_dup, on_parent
elif rank == 1:
    world.exchange([(np.full(3, 1.0), 0)], [], 7, "parent send").wait()
    dup.exchange([(np.full(3, 2.0), 0)], [], 7, "dup send").wait()

# host groups, by consecutive pairs and by shared memory
for name, per_host in (("pairs", 2), ("shared", 0)):
    local, leaders = world.host_groups(f"hosts {name}", ranks_per_host=per_host)
    buf = np.array([rank + 1], np.int64)
    local.allreduce(buf, "local sum").wait()
    entry = {"local": [local.rank, local.size, local.world_ranks()], "local_sum": int(buf[0]),
             "leaders": None if leaders is None else
             [leaders.rank, leaders.size, leaders.world_ranks()]}
    if leaders is not None:
        buf = np.array([rank + 1], np.int64)
        leaders.allreduce(buf, "leaders sum").wait()
        entry["leaders_sum"] = int(buf[0])
    info[f"hosts_{name}"] = entry

# bytes_sent, per call, on a fresh dup
g = world.dup("counters")
counts = [g.bytes_sent]
g.allreduce(np.zeros(10, np.float32), "c").wait(); counts.append(g.bytes_sent)
g.broadcast(np.zeros(3, np.float64), 0, "c").wait(); counts.append(g.bytes_sent)
g.reduce(np.zeros(5, np.int64), np.zeros(5, np.int64) if rank == 0 else None, 0, "c").wait()
counts.append(g.bytes_sent)
g.allgather(np.zeros(2, np.float32), np.zeros(2 * size, np.float32), "c").wait()
counts.append(g.bytes_sent)
g.gather(np.zeros(4, np.int32), np.zeros(4 * size, np.int32) if rank == 0 else None, 0,
         "c").wait()
counts.append(g.bytes_sent)
g.reduce_scatter(np.zeros(3 * size, np.float64), np.zeros(3, np.float64), "c").wait()
counts.append(g.bytes_sent)
g.exchange([(np.zeros(6, np.int8), (rank + 1) % size)], [(np.zeros(6, np.int8),
           (rank - 1) % size)], 0, "c").wait()
counts.append(g.bytes_sent)
g.barrier().wait(); counts.append(g.bytes_sent)
info["bytes"] = counts
info["world_bytes"] = world.bytes_sent

# check_same: equal payloads pass; then odd ranks hold another payload
world.check_same(b"the same graph", "step graph")
try:
    world.check_same(b"graph B" if rank % 2 else b"graph A", "step graph")
    info["check_same"] = None
except CommError as exc:
    info["check_same"] = str(exc)

# broadcast_arrays from the last rank, in place, an empty array among them
arrs = [np.full(5, rank, np.float32), np.zeros(0, np.int64), np.full((2, 2), -rank, np.int64)]
ids = [a.__array_interface__["data"][0] for a in arrs]
world.broadcast_arrays(arrs, root=size - 1)
assert [a.__array_interface__["data"][0] for a in arrs] == ids
arrays.update({f"bcast_arrays_{i}": a for i, a in enumerate(arrs)})

# a second world group shares the job (no second start-up exchange)
again = world_group(timeout=30)
info["again"] = [type(again).__name__, again.rank, again.size, again.bytes_sent,
                 again.local_size]

np.savez(f"rank{rank}.npz", **arrays)
with open(f"rank{rank}.json", "w") as fh:
    json.dump(info, fh)
"""


class Results:
    def __init__(self, size: int, where: Path) -> None:
        self.size = size
        self.arrays = [dict(np.load(where / f"rank{r}.npz")) for r in range(size)]
        self.info = [json.loads((where / f"rank{r}.json").read_text()) for r in range(size)]
        self.inputs = [inputs(r, size) for r in range(size)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def res(request, tmp_path_factory) -> Results:
    from conftest import run_ranks  # the helper behind the ``ranks`` fixture; module scope here

    where = tmp_path_factory.mktemp(f"mpi_group_{request.param}")
    run_ranks(request.param, SCRIPT, where, timeout=180, args=[str(HERE)])
    return Results(request.param, where)


def _same_on_every_rank(res: Results, key: str) -> np.ndarray:
    first = res.arrays[0][key]
    for r in range(1, res.size):
        got = res.arrays[r][key]
        assert got.dtype == first.dtype and got.tobytes() == first.tobytes(), (key, r)
    return first


def test_world_group_under_mpiexec(res):
    for r, info in enumerate(res.info):
        assert (info["type"], info["backend"], info["rank"], info["size"]) == \
            ("MpiGroup", "mpi", r, res.size)
        assert info["world_ranks"] == list(range(res.size))
        assert info["local_size"] == res.size  # every rank runs on this host
        assert info["bytes_after_start"] == 0  # the start-up exchange is not counted
        assert info["again"] == ["MpiGroup", r, res.size, 0, res.size]


@pytest.mark.parametrize("dt", DTYPES)
def test_allreduce_sum_is_numpy_sum_bit_for_bit(res, dt):
    got = _same_on_every_rank(res, f"allreduce_exact_{dt}_sum")
    want = np.sum([x[f"exact_{dt}"] for x in res.inputs], axis=0, dtype=dt)
    assert got.dtype == np.dtype(dt) and got.shape == (3, 5)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dt", DTYPES)
def test_allreduce_sum_of_random_values(res, dt):
    got = _same_on_every_rank(res, f"allreduce_random_{dt}_sum")  # identical bits everywhere
    want = np.sum([x[f"random_{dt}"].astype(np.float64) for x in res.inputs], axis=0)
    rtol = {"float32": 1e-5, "float64": 1e-12, "int64": 0}[dt]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 1e3)


@pytest.mark.parametrize("kind", ["exact", "random"])
@pytest.mark.parametrize("dt", DTYPES)
def test_allreduce_mean_is_the_sum_divided_by_the_size(res, dt, kind):
    # the same bits as the sum followed by divide() (floor division for integers)
    got = _same_on_every_rank(res, f"allreduce_{kind}_{dt}_mean")
    want = _same_on_every_rank(res, f"allreduce_{kind}_{dt}_sum").copy()
    divide(want, res.size)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    if kind == "exact":
        total = np.sum([x[f"exact_{dt}"] for x in res.inputs], axis=0, dtype=dt)
        np.testing.assert_array_equal(got, total // res.size if dt == "int64" else
                                      total / np.array(res.size, dt))


@pytest.mark.parametrize("kind", ["exact", "random"])
@pytest.mark.parametrize("dt", DTYPES)
def test_allreduce_max(res, dt, kind):
    got = _same_on_every_rank(res, f"allreduce_{kind}_{dt}_max")
    want = np.max([x[f"{kind}_{dt}"] for x in res.inputs], axis=0)
    np.testing.assert_array_equal(got, want)


def test_broadcast_from_the_last_rank(res):
    root = res.size - 1
    for r in range(res.size):
        np.testing.assert_array_equal(res.arrays[r]["bcast"], res.inputs[root]["bcast"])
        assert res.info[r]["bcast_peers"] == (None if r == root else [root])


def test_reduce_in_place_at_the_root(res):
    want = np.sum([x["reduce"] for x in res.inputs], axis=0)
    np.testing.assert_array_equal(res.arrays[1]["reduce_inplace"], want)
    for r in range(res.size):
        if r != 1:  # the other ranks' send buffers are left as they were
            np.testing.assert_array_equal(res.arrays[r]["reduce_inplace"],
                                          res.inputs[r]["reduce"])


def test_reduce_into_a_separate_buffer(res):
    want = np.sum([x["reduce"] for x in res.inputs], axis=0)
    np.testing.assert_array_equal(res.arrays[1]["reduce_recv"], want)
    for r in range(res.size):
        np.testing.assert_array_equal(res.arrays[r]["reduce_send_after"], res.inputs[r]["reduce"])
        assert ("reduce_recv" in res.arrays[r]) == (r == 1)


def test_allgather(res):
    want = np.concatenate([x["gather"] for x in res.inputs])
    got = _same_on_every_rank(res, "allgather")
    np.testing.assert_array_equal(got, want)


def test_gather_to_rank_1(res):
    want = np.concatenate([x["gather"] for x in res.inputs])
    np.testing.assert_array_equal(res.arrays[1]["gather"], want)


def test_reduce_scatter(res):
    total = np.sum([x["scatter"] for x in res.inputs], axis=0)
    for r in range(res.size):
        np.testing.assert_array_equal(res.arrays[r]["reduce_scatter"], total[r])


def test_exchange_around_a_ring_matches_by_tag(res):
    for r in range(res.size):
        left, right = (r - 1) % res.size, (r + 1) % res.size
        np.testing.assert_array_equal(res.arrays[r]["ring_tag1"], np.full(4, 10 * left + 1))
        np.testing.assert_array_equal(res.arrays[r]["ring_tag2"], np.full(4, 10 * left + 2))
        assert res.info[r]["exchange_peers"] == [sorted({left, right}), [left], [right]]


def test_barrier_waits_for_the_last_rank(res):
    last_in = max(info["barrier_enter"] for info in res.info)
    assert last_in - min(info["barrier_enter"] for info in res.info) > 0.3
    for info in res.info:
        assert info["barrier_leave"] >= last_in


def test_split_even_odd(res):
    for r, info in enumerate(res.info):
        members = list(range(r % 2, res.size, 2))
        p = info["parity"]
        assert p["world_ranks"] == members
        assert (p["rank"], p["size"]) == (members.index(r), len(members))
        assert p["sum"] == sum(members)
        assert p["bytes"] == 0 and p["timeout"] == 60


def test_split_orders_by_key(res):
    for r, info in enumerate(res.info):
        assert info["reversed"] == {"rank": res.size - 1 - r,
                                    "world_ranks": list(range(res.size - 1, -1, -1))}


def test_split_with_color_none_gives_none(res):
    assert res.info[0]["partial"] is None
    for r in range(1, res.size):
        assert res.info[r]["partial"] == {"rank": r - 1, "size": res.size - 1,
                                          "world_ranks": list(range(1, res.size))}


def test_dup_messages_do_not_match_the_parents(res):
    for r, info in enumerate(res.info):
        assert info["dup"] == {"rank": r, "size": res.size, "world_ranks": list(range(res.size)),
                               "distinct": True}
    np.testing.assert_array_equal(res.arrays[0]["dup_recv"], np.full(3, 2.0))
    np.testing.assert_array_equal(res.arrays[0]["parent_recv"], np.full(3, 1.0))


def test_host_groups_by_pairs(res):
    for r, info in enumerate(res.info):
        h = info["hosts_pairs"]
        pair = [r - r % 2, r - r % 2 + 1]
        assert h["local"] == [r % 2, 2, pair]
        assert h["local_sum"] == pair[0] + pair[1] + 2
        leaders = list(range(0, res.size, 2))
        if r % 2 == 0:
            assert h["leaders"] == [r // 2, len(leaders), leaders]
            assert h["leaders_sum"] == sum(leader + 1 for leader in leaders)
        else:
            assert h["leaders"] is None


def test_host_groups_by_shared_memory(res):
    everyone = list(range(res.size))
    for r, info in enumerate(res.info):
        h = info["hosts_shared"]
        assert h["local"] == [r, res.size, everyone]
        assert h["local_sum"] == sum(q + 1 for q in everyone)
        assert h["leaders"] == ([0, 1, [0]] if r == 0 else None)


def test_bytes_sent_counts_what_each_rank_puts_on_the_wire(res):
    n = res.size
    for r, info in enumerate(res.info):
        root = r == 0
        steps = [40,                          # allreduce: 10 float32
                 24 if root else 0,           # broadcast from 0: only the root sends
                 0 if root else 40,           # reduce to 0: every rank but the root
                 4 * n,                       # allgather: half its 2n float32 (half an
                 0 if root else 16,           # gather to 0          allreduce on the wire)
                 12 * n,                      # reduce_scatter: half its 3n float64
                 6,                           # exchange: 6 int8 sent
                 0]                           # barrier
        assert info["bytes"] == [0, *np.cumsum(steps).tolist()], r
        assert info["world_bytes"] > 0  # the world group counts its own calls


def test_check_same_names_the_differing_ranks(res):
    a = hashlib.sha256(b"graph A").hexdigest()[:12]
    b = hashlib.sha256(b"graph B").hexdigest()[:12]
    odd = list(range(1, res.size, 2))
    want = (f"ranks {odd} hold a different step graph than rank 0 (sha256 {a} on rank 0, "
            f"{b} on rank 1); start every rank with the same model and options")
    for info in res.info:
        assert info["check_same"] == want
    assert re.fullmatch(r"ranks \[[\d, ]+\] hold a different step graph than rank 0 \(sha256 "
                        r"[0-9a-f]{12} on rank 0, [0-9a-f]{12} on rank \d+\); start every "
                        r"rank with the same model and options", want)


def test_broadcast_arrays_in_place(res):
    root = res.size - 1
    for r in range(res.size):
        np.testing.assert_array_equal(res.arrays[r]["bcast_arrays_0"], np.full(5, root))
        assert res.arrays[r]["bcast_arrays_0"].dtype == np.float32
        assert res.arrays[r]["bcast_arrays_1"].shape == (0,)
        np.testing.assert_array_equal(res.arrays[r]["bcast_arrays_2"], np.full((2, 2), -root))


def test_inputs_differ_between_ranks():
    """The oracle above would be blind if every rank fed the same values."""
    a, b = inputs(0, 2), inputs(1, 2)
    assert all(not np.array_equal(a[k], b[k]) for k in a if k != "scatter") and \
        not np.array_equal(a["scatter"], b["scatter"])
