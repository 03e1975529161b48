"""``ngdist.DistributedSGD`` under real mpiexec: checkpoints continue bit-for-bit
(also with sharded ps optimizer state and dedicated servers), a 2-rank checkpoint restores
exactly on 3 ranks and trains on like the uninterrupted run (within 1e-5 in ordinary mode;
bit-for-bit on 1, 2, 3 and 4 ranks in reproducible mode, through DistributedSGD and through
a Trainer's saved model, with every micro-batch's gradients bit-identical whichever rank and
rank count computes them), devices_per_worker replicas equal one replica with the whole batch,
and fetch_stats=False adds no collective."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ngdist.comm import shared

pytestmark = pytest.mark.mpi

COMMON = r'''
import hashlib, json, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.compat.ray import DistributedSGD, Model
from ngdist.runtime import ps_server

out = sys.argv[1]
X, Y, _, _ = load_digits()
G = 24  # samples per step over all workers and replicas
rank, size = ngdist.rank(), ngdist.size()

def creator(workers, devices, start=0):
    b = G // (workers * devices)
    def make(w, d):
        def data():
            i = start
            while True:
                lo = i * G + (w * devices + d) * b
                yield {"x": X[lo:lo + b], "y": Y[lo:lo + b]}
                i += 1
        return Model(zoo.mlp(seed=0), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                     data=data())
    return make

def session(strategy, workers, devices=1, start=0, **kw):
    if strategy == "ps":  # an option of ps only: another strategy refuses it
        kw.setdefault("grad_shard_bytes", 4096)
    return DistributedSGD(creator(workers, devices, start), num_workers=workers,
                          devices_per_worker=devices, strategy=strategy, timeout=120, **kw)

def state(sgd):
    """Everything a checkpoint holds, with ps's optimizer state gathered from the owners."""
    values = sgd.trainer.state_dict()
    values.update(ps_server.gather_state(sgd.trainer) or {})
    return values

def bitwise(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)

def save(name, values):
    np.savez(f"{out}/{name}_{size}_{rank}.npz", **values)

M = 2  # reproducible mode: micro-batches of 2 samples, 12 per global batch

def global_batches(first, last):
    for i in range(first, last):
        yield X[i * G:(i + 1) * G], Y[i * G:(i + 1) * G]

def spy_micro_batches(digests, offset):
    """Digest of each micro-batch's row (gradients, loss) at the next exact AllReduce, keyed
    by the micro-batch's index in the global batch; returns the undo."""
    from ngdist.kernels import KERNELS
    import dataclasses
    inner = KERNELS["AllReduce"]
    def kernel(comm, node, inputs):
        if node.facts.stacked and not digests:
            for j in range(inputs[0].shape[0]):
                row = b"".join(np.ascontiguousarray(x[j]).tobytes() for x in inputs)
                digests[offset + j] = hashlib.sha256(row).hexdigest()
        return inner(comm, node, inputs)
    KERNELS["AllReduce"] = dataclasses.replace(inner, fn=kernel)
    return lambda: KERNELS.update(AllReduce=inner)

def continue_reproducible(workers):
    """From the 2-rank reproducible checkpoint (step 10): 10 steps through DistributedSGD, and
    10 through ngdist.compile of a Trainer's saved model; step 11's micro-batch digests."""
    digests = {}
    undo = spy_micro_batches(digests, rank * (G // workers) // M)
    sgd = session("allreduce", workers, start=10, micro_batch=M)
    sgd.restore_checkpoint(f"{out}/repro_2.onnx")
    for _ in range(10):
        sgd.step()
    save("repro_continued", state(sgd))
    sgd.close()
    undo()
    tr = ngdist.compile(f"{out}/trainer_repro_2.onnx", timeout=120)
    assert type(tr.executor).__name__ == "MicroBatchExecutor" and tr.micro_batch == M
    for xb, yb in tr.shard(global_batches(10, 20)):
        tr.step({"x": xb, "y": yb}, fetch_stats=False)
    save("trainer_continued", tr.state_dict())
    tr.close()
    json.dump(digests, open(f"{out}/micro_digests_{size}_{rank}.json", "w"))

def round_trip(strategy, workers, **kw):
    """10 steps, checkpoint, 10 steps; a new session restores and must end identical."""
    sgd = session(strategy, workers, **kw)
    for _ in range(10):
        sgd.step()
    path = sgd.save_checkpoint(f"{out}/{strategy}_{size}.onnx")
    at10 = state(sgd)
    for _ in range(10):
        sgd.step()
    at20 = state(sgd)
    sgd.close()
    again = session(strategy, workers, start=10, **kw)
    again.restore_checkpoint(path)
    restored = state(again)
    for _ in range(10):
        again.step()
    got = state(again)
    again.close()
    return path, at10, at20, restored, got, again.trainer.parameters()
'''

TWO_RANKS = COMMON + r'''
report = {}
for strategy in ("allreduce", "ps"):
    path, at10, at20, restored, got, _ = round_trip(strategy, 2)
    if rank == 0:
        report[strategy] = {"restored": bitwise(at10, restored), "continued": bitwise(at20, got),
                            "momentum_nonzero": bool(np.any(at20["fc0.weight.momentum"]))}
    save(f"{strategy}_at10", at10)
    save(f"{strategy}_at20", at20)

# reproducible mode, uninterrupted: DistributedSGD with a checkpoint at step 10, and a Trainer
# whose rewritten model (exact AllReduce, micro_batch=2) is saved at step 10
sgd = session("allreduce", 2, micro_batch=M)
for _ in range(10):
    sgd.step()
sgd.save_checkpoint(f"{out}/repro_2.onnx")
save("repro_at10", state(sgd))
for _ in range(10):
    stats = sgd.step(fetch_stats=True)
save("repro_at20", state(sgd))
report["repro_loss"] = stats.loss  # the global batch's loss, no extra collective
sgd.close()
tr = ngdist.compile(zoo.mlp(seed=0), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                    reproducible_micro_batch=M, timeout=120)
for xb, yb in tr.shard(global_batches(0, 10)):
    tr.step({"x": xb, "y": yb}, fetch_stats=False)
save("trainer_at10", tr.state_dict())
tr.save(f"{out}/trainer_repro_2.onnx")
tr.close()
continue_reproducible(2)

# devices_per_worker: 2 replicas of 6 samples per worker == 1 replica of 12
for devices in (1, 2):
    sgd = session("allreduce", 2, devices)
    for _ in range(20):
        sgd.step()
    save(f"devices{devices}", sgd.trainer.parameters())
    sgd.close()

class Counting:
    """Counts the MPI calls made on a communicator."""
    def __init__(self, inner):
        self.inner, self.calls = inner, []
    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if callable(attr):
            def call(*a, **k):
                self.calls.append(name)
                return attr(*a, **k)
            return call
        return attr

sgd = session("allreduce", 2)
sgd.step()
world, private = Counting(sgd.trainer.group.comm), Counting(sgd._group.comm)
sgd.trainer.group.comm, sgd._group.comm = world, private
assert sgd.step(fetch_stats=False) is None
quiet = (list(world.calls), list(private.calls))
batch = next(sgd.models[0].data)  # this rank's loss before the step, for the mean's oracle
sgd.models[0].data = iter([batch])
logits = sgd.trainer.predict({"x": batch["x"]})[0].astype(np.float64)
logp = logits - logits.max(1, keepdims=True)
logp -= np.log(np.exp(logp).sum(1, keepdims=True))
report["local_loss"] = float(-logp[np.arange(len(batch["y"])), batch["y"]].mean())
stats = sgd.step(fetch_stats=True)
loud = (world.calls[len(quiet[0]):], private.calls[len(quiet[1]):])
sgd.trainer.group.comm, sgd._group.comm = world.inner, private.inner
report["collectives"] = {"quiet": quiet, "loud": loud}
report["stats"] = {"loss": stats.loss, "samples": stats.samples,
                   "samples_per_s": stats.samples_per_s, "bytes_sent": stats.bytes_sent,
                   "comm_time": stats.comm_time, "compute_time": stats.compute_time}
sgd.close()
json.dump(report, open(f"{out}/report_{size}_{rank}.json", "w"))
'''

THREE_RANKS = COMMON + r'''
report = {}
# a 2-rank allreduce checkpoint, restored on 3 ranks, continues with the same global batches
sgd = session("allreduce", 3, start=10)
sgd.restore_checkpoint(f"{out}/allreduce_2.onnx")
report["restored_on_3"] = bitwise(state(sgd), dict(np.load(f"{out}/allreduce_at10_2_0.npz")))
for _ in range(10):
    stats = sgd.step(fetch_stats=True)
save("allreduce_3_from_2", sgd.trainer.parameters())
report["loss"] = stats.loss
sgd.close()
continue_reproducible(3)
# ps with one dedicated server (rank 2) in lockstep: round trip, twice in one script
for _ in range(2):
    path, at10, at20, restored, got, final = round_trip("ps", 2, servers=1)
    if rank == 0:
        report.setdefault("ps_server", []).append(
            {"restored": bitwise(at10, restored), "continued": bitwise(at20, got)})
    save("ps_server_at20", final)  # a server ends a session with the workers' parameters
sgd = session("ps", 2, servers=1)
stats = sgd.step(fetch_stats=True)  # the server serves the step and reports the workers' loss
report["ps_server_stats"] = {"loss": stats.loss, "samples": stats.samples,
                             "bytes_sent": stats.bytes_sent}
sgd.close()
json.dump(report, open(f"{out}/report_{size}_{rank}.json", "w"))
'''

REPRODUCIBLE = COMMON + r'''
continue_reproducible(size)
'''


def load(path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return dict(f)


def bitwise(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in b)


def test_distributed_sgd_checkpoints_devices_and_stats(ranks, tmp_path):
    ranks(2, TWO_RANKS, timeout=240, args=[str(tmp_path)])
    ranks(3, THREE_RANKS, timeout=240, args=[str(tmp_path)])
    for n in (1, 4):
        ranks(n, REPRODUCIBLE, timeout=240, args=[str(tmp_path)])

    two = json.loads((tmp_path / "report_2_0.json").read_text())
    for strategy in ("allreduce", "ps"):
        assert two[strategy] == {"restored": True, "continued": True,
                                 "momentum_nonzero": True}, strategy
        for name in ("at10", "at20"):  # both ranks agree bit for bit; under ps the optimizer
            # state lives with the shard owners and is gathered at rank 0 only
            a, b = (load(tmp_path / f"{strategy}_{name}_2_{r}.npz") for r in (0, 1))
            keys = [k for k in a if strategy == "allreduce" or not k.endswith(".momentum")]
            assert len(keys) >= 6 and all(np.array_equal(a[k], b[k]) for k in keys)
    assert max_rel(load(tmp_path / "devices2_2_0.npz"), load(tmp_path / "devices1_2_0.npz")) \
        <= 1e-5

    # fetch_stats=False: only the gradients' AllReduce (one bucket) on COMM_WORLD, nothing on
    # DistributedSGD's own communicator; fetch_stats=True adds one Iallreduce of the loss there
    for r in (0, 1):
        calls = json.loads((tmp_path / f"report_2_{r}.json").read_text())["collectives"]
        # the bucket travels through shared memory (both ranks on this host): the AllReduce
        # is its two barriers (comm/shared.py), flags in that memory where the machine's
        # stores are seen in order (no MPI call at all), else MPI's
        barriers = [] if shared.ORDERED_STORES else ["Ibarrier", "Ibarrier"]
        assert calls["quiet"] == [barriers, []], calls
        assert calls["loud"] == [barriers, ["Iallreduce"]], calls
    stats = two["stats"]
    mean = np.mean([json.loads((tmp_path / f"report_2_{r}.json").read_text())["local_loss"]
                    for r in (0, 1)])
    assert abs(stats["loss"] - mean) <= 1e-5 * mean  # the loss is the mean over the workers
    assert stats["samples"] == 12 and stats["samples_per_s"] > 0 and stats["bytes_sent"] > 0
    assert stats["comm_time"] > 0 and stats["compute_time"] > 0

    three = [json.loads((tmp_path / f"report_3_{r}.json").read_text()) for r in range(3)]
    assert three[0]["restored_on_3"] is True
    assert len({t["loss"] for t in three}) == 1  # the mean over workers, the same everywhere
    uninterrupted = load(tmp_path / "allreduce_at20_2_0.npz")
    params = load(tmp_path / "allreduce_3_from_2_3_0.npz")
    assert max_rel(params, {k: uninterrupted[k] for k in params}) <= 1e-5

    # reproducible mode: a 2-rank checkpoint continues bit-for-bit on 1, 2, 3 and 4 ranks
    # (parameters, momentum, step count, lr), through DistributedSGD and through ngdist.compile
    # of a Trainer's saved model; the Trainer and DistributedSGD train identically
    at10, at20 = load(tmp_path / "repro_at10_2_0.npz"), load(tmp_path / "repro_at20_2_0.npz")
    assert sorted(at20) == sorted(uninterrupted) and np.any(at20["fc0.weight.momentum"])
    assert not bitwise(at10, at20) and int(at20["ngdist.step"]) == 20
    assert bitwise(load(tmp_path / "trainer_at10_2_0.npz"), at10)
    for n in (1, 2, 3, 4):
        for r in range(n):
            for name in ("repro_continued", "trainer_continued"):
                assert bitwise(load(tmp_path / f"{name}_{n}_{r}.npz"), at20), (name, n, r)
    # the assumption behind it: a micro-batch's gradients have the same bits whichever rank
    # of whichever rank count computes them (12 micro-batches per global batch)
    digests = {n: {} for n in (1, 2, 3, 4)}
    for n in digests:
        for r in range(n):
            part = json.loads((tmp_path / f"micro_digests_{n}_{r}.json").read_text())
            assert len(part) == 12 // n and not set(part) & set(digests[n]), (n, r)
            digests[n].update(part)
    assert sorted(digests[2], key=int) == [str(i) for i in range(12)]
    assert len(set(digests[2].values())) == 12  # distinct micro-batches, distinct digests
    assert digests[1] == digests[2] == digests[3] == digests[4]
    assert two["repro_loss"] > 0
    assert three[0]["ps_server"] == [{"restored": True, "continued": True}] * 2
    served = [t["ps_server_stats"] for t in three]
    assert served[0]["loss"] == served[1]["loss"] == served[2]["loss"] > 0
    assert [s["samples"] for s in served] == [12, 12, 0]  # the server trains on no data
    assert all(s["bytes_sent"] > 0 for s in served)  # the server sent the updated shards
    worker = load(tmp_path / "ps_server_at20_3_0.npz")
    for r in (1, 2):
        other = load(tmp_path / f"ps_server_at20_3_{r}.npz")
        assert all(np.array_equal(worker[k], other[k]) for k in worker), r
    # dedicated server or co-located owners: the same training (2 workers, same batches)
    assert max_rel(worker, {k: uninterrupted[k] for k in worker}) <= 1e-5
