"""The ``dist_sync`` key-value store on the parameter-server round of kernels/ps.py.

Each key is one shard, owned round-robin in ``init`` order; a push reduces the workers'
gradients on the owner (a sum: MXNet's semantics), the update runs there alone, and the owner's
value reaches every worker. A dead owner makes the others fail, naming the key and the rank.
"""
from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from ngdist.errors import CommError
from ngdist.kernels.ps import Layout, finish_owner_round, make_layout

OWNER_ONLY = r"""
import json
import numpy as np
from mpi4py import MPI
import ngdist
from ngdist import kvstore

kv = kvstore.create("dist_sync", timeout=60)
rank, n = kv.rank, kv.num_workers
assert n == 4, n
KEYS = ["a", 1, "c", 3, "e"]  # owners 0, 1, 2, 3, 0
DTYPES = [np.float32, np.float64, np.int64, np.float32, np.float64]
SHAPES = [(3,), (2, 2), (4,), (2,), (5,)]
kv.init(KEYS, [np.zeros(s, d) for s, d in zip(SHAPES, DTYPES)])
calls = []

def updater(key, grad, weight):
    calls.append([key, weight.dtype.name, grad.dtype.name])
    return weight + grad

kv.set_optimizer(updater)
for step in range(3):  # every worker pushes (its rank + 1 + step) to every key
    kv.push(KEYS, [np.full(s, rank + 1 + step, d) for s, d in zip(SHAPES, DTYPES)])
# a key twice in one push: both pushes apply, in order
kv.push(["a", "a"], [np.ones(3, np.float32), np.full(3, 2.0, np.float32)])
values = kv.pull(KEYS)

# ngdist's optimizer: its state (momentum) exists only on each key's owner
opt = kvstore.create("dist_sync", timeout=60)
opt.init(["w0", "w1", "w2", "w3", "w4", "w5"], [np.ones(6, np.float32)] * 6)
opt.set_optimizer(ngdist.optim.SGD(lr=0.5, momentum=0.875), rescale_grad=0.25)
for step in range(2):
    opt.push(["w0", "w1", "w2", "w3", "w4", "w5"], [np.full(6, rank + 1.0, np.float32)] * 6)
w = opt.pull("w4")
mine = np.concatenate([v.astype(np.float64).ravel() for v in [*values, w]])
table = np.empty((n, mine.size))
MPI.COMM_WORLD.Allgather(mine, table)
records = MPI.COMM_WORLD.gather({"calls": calls, "states": sorted(opt._updater.states),
                                 "values": [v.tolist() for v in values], "w4": w.tolist(),
                                 "same": all(np.array_equal(table[r], table[0])
                                             for r in range(n))}, root=0)
if rank == 0:
    with open("records.json", "w") as fh:
        json.dump(records, fh)
opt.barrier()
"""


@pytest.mark.mpi
def test_update_runs_only_on_the_owner_and_every_worker_gets_its_value(ranks, tmp_path):
    ranks(4, OWNER_ONLY, timeout=120, env={"NGDIST_TIMEOUT": "60"})
    records = json.loads((tmp_path / "records.json").read_text())
    owned = {0: ["a", "e"], 1: [1], 2: ["c"], 3: [3]}
    dtypes = {"a": "float32", 1: "float64", "c": "int64", 3: "float32", "e": "float64"}
    for rank, rec in enumerate(records):
        want = [[k, dtypes[k], dtypes[k]] for _ in range(3) for k in owned[rank]]
        if rank == 0:
            want += [["a", "float32", "float32"]] * 2
        assert rec["calls"] == want, (rank, rec["calls"])
        # the SGD state of w0..w5 (owners 0, 1, 2, 3, 0, 1) lives on the owner alone
        assert rec["states"] == sorted({0: ["w0", "w4"], 1: ["w1", "w5"], 2: ["w2"],
                                        3: ["w3"]}[rank]), (rank, rec["states"])
        assert rec["same"], rank  # bit-for-bit the owner's values on every worker
    # summed, not averaged: sum over 3 steps of sum over ranks of (rank + 1 + step) = 42
    values = records[0]["values"]
    assert values[0] == [42.0 + 4 + 8] * 3  # then 4 * 1 and 4 * 2 in two more pushes
    assert values[1] == [[42.0, 42.0], [42.0, 42.0]]
    assert values[2] == [42] * 4 and values[3] == [42.0] * 2 and values[4] == [42.0] * 5
    # momentum SGD on the summed gradient times rescale_grad: g = 0.25 * (1+2+3+4) = 2.5
    g, v1 = 2.5, 2.5
    v2 = 0.875 * v1 + g
    assert records[0]["w4"] == pytest.approx([1.0 - 0.5 * v1 - 0.5 * v2] * 6, rel=1e-6)


DEAD_OWNER = r"""
import json, os, time
import numpy as np
from ngdist import kvstore

kv = kvstore.create("dist_sync", timeout=5)
rank = kv.rank
kv.init(["a", "b", "c", "d"], [np.zeros(3)] * 4)  # owners 0, 1, 2, 3
kv.set_optimizer(lambda key, grad, weight: weight - 0.1 * grad)
kv.push(["a", "b", "c", "d"], [np.ones(3)] * 4)  # one full round with every rank
if rank == 2:
    with open("pid2", "w") as fh:
        fh.write(str(os.getpid()))
    os._exit(0)  # the owner of key 'c' leaves without finalizing MPI
start = time.monotonic()
try:
    kv.push("c", np.ones(3))
    caught = None
except Exception as exc:
    caught = {"type": type(exc).__name__, "message": str(exc)}
with open(f"caught{rank}.json", "w") as fh:
    json.dump({"caught": caught, "elapsed": time.monotonic() - start}, fh)
os._exit(0)
"""

LABEL = "'kvstore dist_sync push: update of key 'c' from worker rank 2 (co-located shard owner)'"


def _failure(rank: int, pid: int) -> tuple[str, str]:
    """The two ways a survivor's wait for the dead owner may end: the dead-peer check (a few
    seconds) or, on a loaded machine, the 5 s timeout."""
    gone = (f"{LABEL} cannot complete on rank {rank}: the process of rank 2 (pid {pid}) has "
            "exited. Look at that rank's output for why it stopped")
    late = (f"{LABEL} did not complete within 5 s on rank {rank} (waiting for peers [2]); a "
            "rank has probably died or is running a different program. Check the other ranks' "
            "output; raise the limit with timeout= or NGDIST_TIMEOUT")
    return gone, late


@pytest.mark.mpi
def test_dead_owner_fails_the_others_naming_the_key_and_rank(ranks, tmp_path):
    """NGDIST_WAIT=poll: every survivor's push raises, within the timeout."""
    ranks(4, DEAD_OWNER, timeout=60, env={"NGDIST_WAIT": "poll"}, check=False)
    pid = int((tmp_path / "pid2").read_text())
    for rank in (0, 1, 3):
        got = json.loads((tmp_path / f"caught{rank}.json").read_text())
        assert got["caught"] is not None, rank
        gone, late = _failure(rank, pid)
        assert got["caught"] in ({"type": "CommError", "message": gone},
                                 {"type": "CommTimeoutError", "message": late}), got
        assert got["elapsed"] < 5 + 1, got


@pytest.mark.mpi
def test_dead_owner_aborts_the_job_naming_the_key_and_rank(ranks, tmp_path):
    """The default wait: the first survivor to notice prints the error and aborts the job."""
    start = time.monotonic()
    proc = ranks(4, DEAD_OWNER, timeout=60, check=False)
    out = proc.stdout + proc.stderr
    pid = int((tmp_path / "pid2").read_text())
    assert proc.returncode != 0, out[-3000:]
    found = re.search(r"ngdist: error on rank ([013]): (CommError|CommTimeoutError): (.*)", out)
    assert found, out[-3000:]
    rank = int(found.group(1))
    assert found.group(3) in _failure(rank, pid), out[-3000:]
    assert f"ngdist: rank {rank} aborts the MPI job" in out, out[-3000:]
    assert not list(tmp_path.glob("caught*.json"))  # no survivor's push returned
    assert time.monotonic() - start < 40


# ----------------------------------------------------------------------------- one process

def test_layout_deals_keys_round_robin_and_names_them():
    lay = Layout(0, [], [], 3, 3)
    assert [lay.append(n, f"key {k!r}") for k, n in [("a", 4), (7, 1), ("c", 2), ("d", 5)]] \
        == [0, 1, 2, 3]
    assert lay.owners == [0, 1, 2, 0] and lay.total == 12
    assert lay.bounds == [(0, 4), (4, 5), (5, 7), (7, 12)]
    assert [lay.name(k) for k in range(4)] == ["key 'a'", "key 7", "key 'c'", "key 'd'"]
    assert lay.owned(0) == [0, 3]
    # the ps strategy's layout: the same dealing over the owners, shards named by number
    ps = make_layout(total=10, itemsize=4, grad_shard_bytes=8, size=5, servers=2)
    assert ps.owners == [3, 4, 3, 4, 3] and ps.name(4) == "shard 4"


def test_unknown_reduction_is_refused():
    with pytest.raises(CommError) as exc:
        finish_owner_round(None, None, None, {}, lambda k, g: g, None, "avg")
    assert str(exc.value) == "parameter-server reduction 'avg': choose one of ['sum', 'mean']"
