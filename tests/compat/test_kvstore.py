"""ngdist.kvstore: MXNet-KVStore semantics, on real MPI ranks.

Oracles: a single-process numpy loop on the concatenated batch (hand-written softmax-regression
gradients and momentum SGD, independent of the store's ONNX updater), exact sums of
integer-valued arrays, and the arithmetic mean that push-sum gossip must reach.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import ngdist
from ngdist import kvstore, zoo
from ngdist.compat.kvstore import KVStoreError

TRAIN_LOOP = r"""
import sys
import numpy as np
from mpi4py import MPI
import ngdist
from ngdist import kvstore
from ngdist.data import load_digits

KIND = sys.argv[1]
# exactly representable in float32: ONNX's Momentum takes alpha as a float32 attribute
LR, MOMENTUM, STEPS, PER_RANK = 0.5, 0.875, 25, 16

def grads(w, b, x, y, total):
    # softmax cross-entropy, summed over this shard and divided by the GLOBAL batch size
    z = x @ w + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return x.T @ p / total, p.sum(0) / total

x_all, y_all, _, _ = load_digits()
x_all = x_all.astype(np.float64)
rng = np.random.default_rng(0)
w0, b0 = rng.normal(scale=0.01, size=(64, 10)), np.zeros(10)

kv = kvstore.create(KIND, timeout=60)
rank, n = kv.rank, kv.num_workers
assert n == MPI.COMM_WORLD.Get_size() == 4, n
kv.init([0, "bias"], [w0 if rank == 0 else np.full_like(w0, 7.0), b0])  # rank 0's init wins
kv.set_optimizer(ngdist.optim.SGD(lr=LR, momentum=MOMENTUM))
w, b = np.empty_like(w0), np.empty_like(b0)
kv.pull([0, "bias"], out=[w, b])
assert np.array_equal(w, w0)
G = PER_RANK * n
for step in range(STEPS):
    lo = step * G + rank * PER_RANK
    gw, gb = grads(w, b, x_all[lo:lo + PER_RANK], y_all[lo:lo + PER_RANK], G)
    kv.push([0, "bias"], [gw, gb])
    kv.pull([0, "bias"], out=[w, b])

# the single-process loop on the concatenated batch, numpy momentum SGD (ONNX Momentum,
# beta = 1: v <- momentum * v + g, x <- x - lr * v)
ws, bs, vw, vb = w0.copy(), b0.copy(), np.zeros_like(w0), np.zeros_like(b0)
for step in range(STEPS):
    gw, gb = grads(ws, bs, x_all[step * G:(step + 1) * G], y_all[step * G:(step + 1) * G], G)
    vw, vb = MOMENTUM * vw + gw, MOMENTUM * vb + gb
    ws, bs = ws - LR * vw, bs - LR * vb
np.testing.assert_allclose(w, ws, rtol=1e-9, atol=1e-12)
np.testing.assert_allclose(b, bs, rtol=1e-9, atol=1e-12)
assert not np.allclose(w, w0, atol=1e-3)  # it trained

# bit-for-bit the same parameters on every rank
mine = np.concatenate([w.ravel(), b.ravel()])
table = np.empty((n, mine.size))
MPI.COMM_WORLD.Allgather(mine, table)
assert all(np.array_equal(table[r], table[0]) for r in range(n))
kv.barrier()
print(f"rank {rank} OK {KIND}", flush=True)
"""


@pytest.mark.parametrize("kind", ["dist_sync", "dist_allreduce"])
def test_numpy_loop_on_4_ranks_equals_single_process_loop(ranks, kind):
    proc = ranks(4, TRAIN_LOOP, args=[kind], timeout=180, env={"NGDIST_TIMEOUT": "60"})
    assert sorted(re.findall(rf"rank \d OK {kind}", proc.stdout)) == \
        [f"rank {r} OK {kind}" for r in range(4)]


SEMANTICS = r"""
import numpy as np
from mpi4py import MPI
import ngdist
from ngdist import kvstore
from ngdist.errors import CommError

kv = kvstore.create("dist_sync", timeout=60)
rank, n = kv.rank, kv.num_workers
# keys 0..3 are owned by ranks 0..3 (round-robin in init order)
kv.init(["a", 1, "c", 3], [np.zeros((2, 3), np.float32)] * 4)
# push of a list sums it (MXNet: one value per device), and the workers' pushes are summed
kv.push("a", [np.full((2, 3), rank + 1.0, np.float32), np.full((2, 3), 10.0 * rank, np.float32)])
outs = [np.zeros((2, 3), np.float32) for _ in range(3)]
kv.pull("a", out=outs)  # pull into a list fills each out
want = sum(r + 1.0 + 10.0 * r for r in range(n))
assert all(np.array_equal(o, np.full((2, 3), want, np.float32)) for o in outs), outs
# lists of keys, each with a list of values; the owner of key 3 is rank 3
kv.push([1, 3], [[np.ones((2, 3), np.float32)] * 2, np.full((2, 3), rank, np.float32)])
got = kv.pull([1, 3])
assert np.array_equal(got[0], np.full((2, 3), 2.0 * n)), got
assert np.array_equal(got[1], np.full((2, 3), n * (n - 1) / 2)), got
# server-side update: only the owner holds optimizer state; pushpull returns the update
kv.set_optimizer(lambda key, grad, weight: weight - 0.5 * grad)
out = np.zeros((2, 3), np.float32)
kv.pushpull("c", np.full((2, 3), 2.0, np.float32), out=out)
assert np.array_equal(out, np.full((2, 3), -0.5 * 2.0 * n)), out
# workers that disagree on a key get an error on every rank, not a hang
try:
    kv.init("x" if rank else "y", np.zeros(2))
except CommError as exc:
    assert "kvstore key" in str(exc) and "rank 0" in str(exc), str(exc)
else:
    raise AssertionError("mismatched init did not raise")

# pushsum: each rank adds its own delta once, then gossips; x / w tends to the mean
ps = kvstore.create("pushsum", timeout=60)
ps.init("p", np.full(5, 3.0))
ps.set_optimizer(lambda key, grad, weight: weight + grad)
deltas = np.arange(5) * (rank + 1.0)
for it in range(12):
    ps.push("p", deltas if it == 0 else np.zeros(5))
mean = 3.0 + np.arange(5) * np.mean(np.arange(1.0, n + 1))
np.testing.assert_allclose(ps.pull("p"), mean, rtol=1e-12)

# dist_allreduce without optimizer: pushpull is an allreduce (sum)
ar = kvstore.create("dist_allreduce", timeout=60)
ar.init(7, np.zeros(4))
assert np.array_equal(ar.pushpull(7, np.full(4, rank + 1.0)), np.full(4, n * (n + 1) / 2))
kv.barrier()
print(f"rank {rank} OK", flush=True)
"""


def test_push_sums_pull_fills_pushsum_mean_on_4_ranks(ranks):
    proc = ranks(4, SEMANTICS, timeout=180, env={"NGDIST_TIMEOUT": "60"})
    assert sorted(re.findall(r"rank \d OK", proc.stdout)) == [f"rank {r} OK" for r in range(4)]


# ----------------------------------------------------------------------------- one process

def test_local_semantics_and_momentum_update():
    kv = kvstore.create("local")
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
    kv.init(3, np.ones((2, 2), np.float32))
    kv.push(3, [np.full((2, 2), 2.0), np.full((2, 2), 3.0)])  # no optimizer: assigns the sum
    outs = [np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32)]
    assert kv.pull(3, out=outs) is None
    assert all(np.array_equal(o, np.full((2, 2), 5.0)) for o in outs)
    kv.set_optimizer("sgd:lr=0.1,momentum=0.9,nesterov=1,weight_decay=0.01")
    x, v = np.full((2, 2), 5.0, np.float32), np.zeros((2, 2), np.float32)
    for g in (1.0, -2.0, 0.5):
        grad = np.full((2, 2), g, np.float32)
        kv.push(3, grad)
        gr = grad + np.float32(0.01) * x  # ONNX Momentum, nesterov mode
        v = np.float32(0.9) * v + gr
        x = x - np.float32(0.1) * (gr + np.float32(0.9) * v)
        np.testing.assert_allclose(kv.pull(3), x, rtol=1e-6)


def test_adam_update_equals_numpy_adam():
    kv = kvstore.create("local")
    kv.init("w", np.linspace(-1, 1, 6))
    kv.set_optimizer(ngdist.optim.Adam(lr=0.01), rescale_grad=0.5)
    x, m, h = np.linspace(-1, 1, 6), np.zeros(6), np.zeros(6)
    rng = np.random.default_rng(0)
    for t in range(1, 5):
        g = rng.normal(size=6)
        kv.push("w", g)
        g = 0.5 * g
        m, h = 0.9 * m + 0.1 * g, 0.999 * h + 0.001 * g * g
        lr = np.float64(np.float32(0.01)) * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        x = x - lr * m / (np.sqrt(h) + 1e-8)
        # the op's attributes are float32, so its constants (0.9, 0.999, 1e-8) are rounded
        np.testing.assert_allclose(kv.pull("w"), x, rtol=1e-7)


def test_error_messages():
    with pytest.raises(KVStoreError) as exc:
        kvstore.create("dist_async")
    assert str(exc.value) == ("unknown kvstore type 'dist_async'; choose one of ['local', "
                              "'dist_sync', 'dist_allreduce', 'pushsum']")
    kv = kvstore.create("dist_sync")  # one process: behaves as local
    kv.init([0, "w"], [np.zeros(3), np.zeros((2, 2))])
    with pytest.raises(KVStoreError) as exc:
        kv.init("w", np.ones((2, 2)))
    assert str(exc.value) == "key 'w' is already initialized; init each key once (push " \
                             "changes its value)"
    with pytest.raises(KVStoreError) as exc:
        kv.push("v", np.ones(3))
    assert str(exc.value) == ("push of key 'v', which was never initialized; call "
                              "init('v', value) first (initialized keys: 'w', 0)")
    with pytest.raises(KVStoreError) as exc:
        kv.pull(5, out=np.zeros(3))
    assert str(exc.value) == ("pull of key 5, which was never initialized; call init(5, value) "
                              "first (initialized keys: 'w', 0)")
    with pytest.raises(KVStoreError) as exc:
        kv.push(0, [np.ones(3), np.ones(4)])
    assert str(exc.value) == "push to key 0: a value has shape (4,), the key holds (3,)"
    with pytest.raises(KVStoreError) as exc:
        kv.pull(0, out=np.zeros(4))
    assert str(exc.value) == "pull of key 0: out must be a numpy array of shape (3,), got (4,)"
    with pytest.raises(KVStoreError) as exc:
        kv.push([0, "w"], [np.ones(3)])
    assert str(exc.value) == "push of 2 keys needs a list of 2 values (one per key), got 1"
    with pytest.raises(KVStoreError) as exc:
        kv.init(1.5, np.ones(3))
    assert str(exc.value) == "kvstore keys are ints or strings, got float 1.5"


def _comm_ops(trainer) -> set[str]:
    return {n.op_type for n in trainer.step_model.graph if n.domain == "ngdist"}


def test_compile_with_kvstore_picks_the_strategy_and_optimizer(monkeypatch):
    from ngdist.passes import pipeline

    model = zoo.mlp((8, 4, 3), seed=0)
    kv = kvstore.create("dist_sync")
    kv.set_optimizer(ngdist.optim.SGD(lr=0.3))
    trainer = ngdist.compile(model, kvstore=kv)
    assert _comm_ops(trainer) == {"AllReduce"}
    assert trainer.state_dict()["ngdist.lr"] == np.float32(0.3)
    trainer.close()
    sgd = ngdist.optim.SGD(lr=0.1)
    assert _comm_ops(ngdist.compile(model, kvstore=kvstore.create("dist_allreduce"),
                                    optimizer=sgd)) == {"AllReduce"}
    assert _comm_ops(ngdist.compile(model, kvstore=kvstore.create("pushsum"),
                                    optimizer=sgd)) == {"PushSum"}
    assert _comm_ops(ngdist.compile(model, kvstore=kvstore.create("local"),
                                    optimizer=sgd)) == set()
    with pytest.raises(KVStoreError) as exc:
        ngdist.compile(model, kvstore=kvstore.create("local"), strategy="pushsum")
    assert str(exc.value) == ("strategy='pushsum' conflicts with kvstore type 'local', which "
                              "uses 'local'; pass one of them")
    monkeypatch.delitem(pipeline.STRATEGIES, "pushsum")
    with pytest.raises(KVStoreError) as exc:
        ngdist.compile(model, kvstore=kvstore.create("pushsum"))
    assert str(exc.value).startswith("kvstore type 'pushsum' needs the 'pushsum' strategy, "
                                     "which is not available in this ngdist (strategies: [")
