"""Ray SGD's strategies under real mpiexec: every all_reduce_alg, ``simple`` and ``ps``
(co-located and dedicated servers) train the digits MLP exactly like allreduce/mpi on 2, 3 and
4 ranks; the algorithms sum awkward buffers exactly and identically on every rank; a frozen
or killed parameter server ends the job with an error, never a hang."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.mpi

EQUIVALENCE = r'''
import hashlib, json, os, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.comm import world_group
from ngdist.kernels import CommNode, allreduce_algs, get_kernel

out, only_mpi = sys.argv[1], len(sys.argv) > 2
rank, size = ngdist.rank(), ngdist.size()
X, Y, _, _ = load_digits()
B, STEPS = 12, 20
digests = {}

if not only_mpi:  # 1. the algorithms alone: exact sums of awkward buffers, on every rank alike
    comm = world_group(timeout=120)
    kernel = get_kernel("AllReduce")
    allreduce_algs.CHUNK_BYTES = 4096  # several chunks per ring segment
    errors = {}
    for per_host in ("", "2"):  # one host (shared-memory split), then "hosts" of 2 ranks
        os.environ["NGDIST_RANKS_PER_HOST"] = per_host
        for alg in ("mpi", "ring", "recursive_doubling", "hierarchical", "exact"):
            for n in (1, 3, 1001, 100003):
                for dtype in (np.float32, np.float64, np.int64):
                    data = [(np.random.default_rng(1000 * q + n).standard_normal(n) * 100
                             ).astype(dtype) for q in range(size)]
                    node = CommNode("AllReduce", f"test/{alg}", {"algorithm": alg,
                                                                  "reduction": "sum"})
                    got = kernel(comm, node, [data[rank].reshape(-1, 1)])[0].reshape(-1)
                    exact = np.sum(np.stack(data).astype(np.float64), axis=0)
                    key = f"{alg}/{per_host or 'shm'}/{n}/{np.dtype(dtype).name}"
                    errors[key] = float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))
                    digests[key] = hashlib.sha256(got.tobytes()).hexdigest()
    os.environ["NGDIST_RANKS_PER_HOST"] = ""
    json.dump(errors, open(f"{out}/alg_errors_{size}_{rank}.json", "w"))

def train(name, strategy, env=None, **kw):
    os.environ.update(env or {})
    if strategy == "allreduce":  # an option of allreduce only: another strategy refuses it
        kw.setdefault("bucket_bytes", 8192)
    tr = ngdist.compile(zoo.mlp(seed=0), loss="softmax_cross_entropy",
                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9), strategy=strategy,
                        timeout=120, **kw)
    W = tr.num_workers
    for i in range(STEPS):
        g = slice(i * W * B, (i + 1) * W * B)
        for xb, yb in tr.shard([(X[g], Y[g])]):
            tr.step({"x": xb, "y": yb}, fetch_stats=False)
    tr.close()
    for k in env or {}:
        os.environ.pop(k)
    np.savez(f"{out}/{name}_{size}_{rank}.npz", **tr.parameters())

train("mpi", "allreduce", all_reduce_alg="mpi")
if not only_mpi:
    for alg in ("ring", "recursive_doubling", "hierarchical", "exact"):
        train(alg, "allreduce", all_reduce_alg=alg)
    train("reproducible", "allreduce", reproducible_micro_batch=4)  # 3 micro-batches/worker
    train("hierarchical_hosts_of_2", "allreduce", {"NGDIST_RANKS_PER_HOST": "2"},
          all_reduce_alg="hierarchical")
    train("simple", "simple")
    train("ps_colocated", "ps", grad_shard_bytes=4096)
    train("allreduce_2_devices", "allreduce", devices_per_worker=2)
    train("ps_2_devices", "ps", devices_per_worker=2, grad_shard_bytes=4096)
    train("ps_1_server", "ps", servers=1, grad_shard_bytes=4096)  # graph option
    if size == 4:
        train("ps_2_servers", "ps", {"NGDIST_PS_SERVERS": "2"}, grad_shard_bytes=4096)  # launcher
json.dump(digests, open(f"{out}/digests_{size}_{rank}.json", "w"))
'''

SAME_WORKERS = ["ring", "recursive_doubling", "hierarchical", "hierarchical_hosts_of_2", "simple",
                "ps_colocated", "allreduce_2_devices", "ps_2_devices", "exact", "reproducible"]


def load(out: Path, name: str, n: int, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"{name}_{n}_{rank}.npz") as f:
        return dict(f)


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in b)


def test_every_strategy_and_algorithm_equals_allreduce_mpi(ranks, tmp_path):
    script = tmp_path / "equivalence.py"
    script.write_text(EQUIVALENCE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, str(script), str(tmp_path), "only-mpi"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert single.returncode == 0, single.stderr  # the 1-worker reference (no mpiexec)
    for n in (2, 3, 4):
        ranks(n, EQUIVALENCE, timeout=240, args=[str(tmp_path)])
    for n in (2, 3, 4):
        errors = json.loads((tmp_path / f"alg_errors_{n}_0.json").read_text())
        assert len(errors) == 2 * 5 * 4 * 3
        assert max(errors.values()) <= 1e-6, {k: v for k, v in errors.items() if v > 1e-6}
        digests = [json.loads((tmp_path / f"digests_{n}_{r}.json").read_text())
                   for r in range(n)]
        assert all(d == digests[0] for d in digests), f"ranks differ after an allreduce ({n})"
        ref = load(tmp_path, "mpi", n, 0)
        for name in SAME_WORKERS:
            for r in range(n):  # every rank holds bit-for-bit the same parameters
                got = load(tmp_path, name, n, r)
                assert all(np.array_equal(got[k], load(tmp_path, name, n, 0)[k]) for k in got)
            assert max_rel(load(tmp_path, name, n, 0), ref) <= 1e-5, (name, n)
        # dedicated servers: n-1 (or n-2) workers train like allreduce/mpi on that many ranks;
        # the servers end with the same final parameters as the workers
        for name, workers in [("ps_1_server", n - 1)] + ([("ps_2_servers", 2)] if n == 4 else []):
            first = load(tmp_path, name, n, 0)
            for r in range(n):
                got = load(tmp_path, name, n, r)
                assert all(np.array_equal(got[k], first[k]) for k in got), (name, n, r)
            assert max_rel(first, load(tmp_path, "mpi", workers, 0)) <= 1e-5, (name, n)


KILL = r'''
import os, signal, sys, threading, time
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

X, Y, _, _ = load_digits()
rank, size = ngdist.rank(), ngdist.size()
if rank == size - 1:  # the dedicated server freezes (SIGSTOP) or dies (SIGKILL) mid-training
    sig = signal.SIGSTOP if sys.argv[1] == "stop" else signal.SIGKILL
    threading.Timer(2.0, lambda: os.kill(os.getpid(), sig)).start()
tr = ngdist.compile(zoo.mlp((64, 32, 10)), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                    strategy="ps", grad_shard_bytes=2000)
start = time.time()
while time.time() - start < 60 and tr.role == "worker":
    for xb, yb in tr.shard([(X[:32], Y[:32])]):
        tr.step({"x": xb, "y": yb})
    time.sleep(0.01)
print(f"rank {rank}: training finished", flush=True)
'''


@pytest.mark.parametrize("mode", ["stop", "kill"])
def test_lost_parameter_server_fails_the_workers_not_hangs(tmp_path, mode):
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "ngdist", "run", "-n", "3", "--servers", "1",
                               "--timeout", "4", "--", sys.executable, str(script), mode],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=90)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-f", str(script)], check=False)
        pytest.fail("the workers hung after their parameter server was lost")
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "training finished" not in output, output
    assert elapsed < 45, elapsed  # 2 s of training, then the 4 s timeout, not the 60 s loop
    # the shard a worker is waiting for depends on where in its round the server stopped
    message = re.compile(r"CommTimeoutError: ngdist\.PSPushPull 'ngdist/ps: update of shard "
                         r"\d+ from parameter server rank 2' did not complete within 4 s on rank ")
    gone = re.compile(r"CommError: ngdist\.PSPushPull 'ngdist/ps: update of shard \d+ from "
                      r"parameter server rank 2' cannot complete on rank ")
    if mode == "stop":  # a frozen server (its process is still there): a worker times out
        assert message.search(output), output
    else:  # a dead one: a worker sees it gone or times out, unless MPICH's launcher tore the
        # job down first
        assert message.search(output) or gone.search(output) or \
            "Killed (signal 9)" in output, output


BN_SIMPLE = r'''
import sys, numpy as np, ngdist
from ngdist import zoo
from ngdist.data import load_digits
X, Y, _, _ = load_digits(images=True)
for strategy in ("allreduce", "simple"):
    tr = ngdist.compile(zoo.cnn(channels=(4, 4), seed=0), loss="softmax_cross_entropy",
                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9), strategy=strategy,
                        timeout=60)
    for i in range(5):
        g = slice(i * 16, (i + 1) * 16)
        for xb, yb in tr.shard([(X[g], Y[g])]):
            tr.step({"x": xb, "y": yb}, fetch_stats=False)
    np.savez(f"{strategy}_{tr.rank}.npz", **tr.state_dict())
    tr.close()
'''


def test_simple_averages_batchnorm_statistics_like_allreduce(ranks, tmp_path):
    """``simple`` must equal ``allreduce`` for a model with buffers too: the BatchNorm running
    statistics are averaged over the ranks, so they are the same on both ranks and equal to
    allreduce's (each rank's own shard statistics differ)."""
    ranks(2, BN_SIMPLE, timeout=120)
    ref = dict(np.load(tmp_path / "allreduce_0.npz"))
    got = [dict(np.load(tmp_path / f"simple_{r}.npz")) for r in range(2)]
    assert set(got[0]) == set(ref) and "bn1.running_mean" in ref
    for k in ref:
        assert np.array_equal(got[0][k], got[1][k]), k
        assert np.allclose(got[0][k], ref[k], rtol=1e-5, atol=1e-7), k


PS_SYNC = r'''
import sys, numpy as np, ngdist
from ngdist import zoo
from ngdist.data import load_digits
X, Y, _, _ = load_digits()
servers = int(sys.argv[1])
tr = ngdist.compile(zoo.mlp(seed=0), loss="softmax_cross_entropy",
                    optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9), strategy="ps",
                    servers=servers, grad_shard_bytes=4096, timeout=60)
W, B = tr.num_workers, 8
def train(lo, hi):
    for i in range(lo, hi):
        g = slice(i * W * B, (i + 1) * W * B)
        for xb, yb in tr.shard([(X[g], Y[g])]):
            tr.step({"x": xb, "y": yb})
train(0, 3)
tr.save("stale.onnx")  # rank 0 only; logs that the optimizer state is not the live one
tr.sync_state()        # every rank (a dedicated server returns at once)
tr.save("mid.onnx")
train(3, 6)
tr.sync_state()
tr.save("final.onnx")
tr.close()
'''


def _file_values(path: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    inits = list(model.graph.initializer) + [t for ti in model.training_info
                                             for t in ti.algorithm.initializer]
    return {t.name: numpy_helper.to_array(t) for t in inits}


@pytest.mark.parametrize("servers", [0, 1])
def test_ps_sync_state_puts_the_owners_optimizer_state_in_the_saved_file(ranks, tmp_path,
                                                                         servers):
    """Under ps the momentum lives with the shard owners: ``save()`` alone writes the
    start-up momentum (and says so), ``sync_state()`` then ``save()`` writes the live one,
    equal to one process trained on the combined batch; training continues unchanged."""
    import ngdist
    from ngdist import zoo
    from ngdist.data import load_digits

    proc = ranks(2 + servers, PS_SYNC, timeout=120, args=[str(servers)])
    assert "call trainer.sync_state() on every worker before save()" in proc.stderr
    x, y, _, _ = load_digits()
    ref = ngdist.compile(zoo.mlp(seed=0), loss="softmax_cross_entropy",
                         optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9), strategy="local")
    want = {}
    for i in range(6):
        ref.step({"x": x[16 * i:16 * (i + 1)], "y": y[16 * i:16 * (i + 1)]})
        want[i + 1] = ref.state_dict()
    stale, mid, final = (_file_values(tmp_path / f"{n}.onnx") for n in ("stale", "mid", "final"))
    momenta = [n for n in want[3] if n.endswith(".momentum")]
    assert len(momenta) == 4 and all(not stale[n].any() for n in momenta)  # start-up state
    for got, step in ((mid, 3), (final, 6)):
        for n in momenta + [n[:-len(".momentum")] for n in momenta]:
            assert np.allclose(got[n], want[step][n], rtol=1e-5, atol=1e-6), (n, step)
