"""Ray SGD's strategies and knobs, the single-process part: the ``ps`` and ``simple``
rewrites, the shard-update graph against onnx.reference, devices_per_worker, stats, the
DistributedSGD checkpoint file, the CLI options and the error messages."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import CommError, GraphError, InputError, NgdistError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.ir.model import load_proto, save_proto, split_training_model
from ngdist.kernels.ps import make_layout, resolve_servers
from ngdist.passes.pipeline import rewrite
from ngdist.compat.ray import DistributedSGD, Model

X, Y, _, _ = load_digits()
SGD = ngdist.optim.SGD(lr=0.1, momentum=0.9)


def training(optimizer=SGD, sizes=(64, 32, 10)) -> onnx.ModelProto:
    return ngdist.to_training_model(zoo.mlp(sizes, seed=0), optimizer=optimizer)


def comm_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.training_info[0].algorithm.node if n.domain == "ngdist"]


def train(strategy: str, steps: int = 20, batch: int = 16, optimizer=SGD, **kw
          ) -> tuple[dict, list]:
    tr = ngdist.compile(zoo.mlp((64, 32, 10), seed=0), optimizer=optimizer, strategy=strategy,
                        **kw)
    losses = [tr.step({"x": X[i * batch:(i + 1) * batch], "y": Y[i * batch:(i + 1) * batch]}).loss
              for i in range(steps)]
    params = tr.parameters()
    tr.close()
    return params, losses


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k]))) for k in b)


# --------------------------------------------------------------------------- the ps rewrite

def test_ps_rewrite_moves_the_optimizer_into_pspushpull(tmp_path):
    out = rewrite(training(), "ps", grad_shard_bytes=4096)
    onnx.checker.check_model(out)
    (node,) = comm_nodes(out)
    params = ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"]
    assert node.op_type == "PSPushPull"
    assert list(node.input) == ["ngdist.lr", "ngdist.step", *params,
                                *(f"{p}.grad" for p in params),
                                *(f"{p}.momentum" for p in params)]
    assert list(node.output) == [f"{p}.new" for p in params]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["grad_shard_bytes"] == 4096 and attrs["servers"] == 0
    update = attrs["update"]
    assert [i.name for i in update.input] == ["ngdist.ps.lr", "ngdist.ps.t", "ngdist.ps.x",
                                              "ngdist.ps.g", "ngdist.ps.state0"]
    assert not any(n.domain == PREVIEW_TRAINING for n in update.node)  # lowered
    info = out.training_info[0]
    # the workers no longer update the optimizer state: its binding is gone, the params' stays
    assert {kv.key for kv in info.update_binding} == {*params, "ngdist.step"}
    assert not any(n.domain == PREVIEW_TRAINING for n in info.algorithm.node)
    save_proto(out, tmp_path / "ps.onnx")
    again = load_proto(tmp_path / "ps.onnx")  # checker, round trip through onnx_ir
    _, step = split_training_model(again)
    assert [n.op_type for n in step.graph if n.domain == "ngdist"] == ["PSPushPull"]


@pytest.mark.parametrize("optimizer", [
    ngdist.optim.SGD(lr=0.1, momentum=0.9),
    ngdist.optim.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
    ngdist.optim.Adam(lr=1e-3, weight_decay=0.001),
    ngdist.optim.Adagrad(lr=0.1, lr_decay=0.01),
])
def test_shard_update_graph_matches_onnx_reference_optimizer(optimizer):
    """The owner's update on a flat slice equals ONNX's own optimizer op on that slice, as
    onnx.reference evaluates it (an implementation independent of ngdist's lowering)."""
    out = rewrite(training(optimizer), "ps")
    (node,) = comm_nodes(out)
    update = next(a.g for a in node.attribute if a.name == "update")
    kinds = len(update.input) - 4
    rng = np.random.default_rng(0)
    n = 37
    x, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    states = [np.abs(rng.standard_normal(n)).astype(np.float32) for _ in range(kinds)]
    lr, t = np.array(optimizer.lr, np.float32), np.array(3, np.int64)
    model = helper.make_model(update, opset_imports=[helper.make_opsetid("", 18)],
                              ir_version=10)
    ours = ReferenceEvaluator(model).run(None, dict(zip([i.name for i in update.input],
                                                        [lr, t, x, g, *states])))
    names = ["R", "T", "X", "G", *[f"S{i}" for i in range(kinds)]]
    ref_node = helper.make_node(optimizer.op_type, names, ["X2", *[f"S{i}2" for i in range(kinds)]],
                                domain=PREVIEW_TRAINING, **optimizer.attributes())
    ref = ReferenceEvaluator(ref_node).run(None, dict(zip(names, [lr, t, x, g, *states])))
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_simple_rewrite_one_central_reduce():
    out = rewrite(training(), "simple")
    onnx.checker.check_model(out)
    (node,) = comm_nodes(out)
    assert node.op_type == "CentralReduce"
    assert sorted(node.input) == sorted(f"{p}.grad" for p in
                                        ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"])
    alg = out.training_info[0].algorithm
    readers = [n for n in alg.node if any(i.endswith(".grad") for i in n.input)]
    assert readers == [node]  # the update reads the averaged gradients only


def test_layout_shards_are_bounded_contiguous_and_dealt_round_robin():
    lay = make_layout(total=1000, itemsize=4, grad_shard_bytes=256, size=4, servers=0)
    assert all((hi - lo) * 4 <= 256 for lo, hi in lay.bounds)
    assert [b[0] for b in lay.bounds[1:]] == [b[1] for b in lay.bounds[:-1]]
    assert lay.bounds[0][0] == 0 and lay.bounds[-1][1] == 1000 and len(lay.bounds) == 16
    assert lay.owners == [0, 1, 2, 3] * 4
    lay = make_layout(total=10, itemsize=4, grad_shard_bytes=0, size=5, servers=2)
    assert lay.workers == 3 and lay.servers == [3, 4] and lay.owners == [3, 4]
    lay = make_layout(total=3, itemsize=4, grad_shard_bytes=4, size=6, servers=0)
    assert lay.bounds == [(0, 1), (1, 2), (2, 3)]  # never an empty shard


def test_server_count_errors(monkeypatch):
    monkeypatch.setenv("NGDIST_PS_SERVERS", "2")
    assert resolve_servers(0, 4) == 2
    with pytest.raises(CommError, match=r"the model asks for 1 parameter server rank\(s\) but "
                                        r"NGDIST_PS_SERVERS=2"):
        resolve_servers(1, 4)
    with pytest.raises(CommError, match=r"2 parameter server rank\(s\) need more than 2 ranks, "
                                        r"and this job has 2; launch e.g. `ngdist run -n 4 "
                                        r"--servers 2 -- \.\.\.`"):
        resolve_servers(0, 2)
    with pytest.raises(CommError, match="need more than 2 ranks, and this job has 1"):
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, strategy="ps")
    with pytest.raises(GraphError, match=r"NGDIST_PS_SERVERS=2 \(ngdist run --servers\) asks for "
                                         r"dedicated parameter servers, but the strategy is not "
                                         r"'ps'"):
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, strategy="allreduce")


# --------------------------------------------------------------------------- one process

def test_single_process_strategies_equal_local():
    ref, ref_losses = train("local")
    for strategy, kw in [("simple", {}), ("ps", {"grad_shard_bytes": 1000}),
                         ("allreduce", {"all_reduce_alg": "ring"})]:
        params, losses = train(strategy, **kw)
        assert max_rel(params, ref) <= 1e-6, strategy
        assert np.allclose(losses, ref_losses, rtol=1e-6), strategy


def test_devices_per_worker_equals_one_replica_with_the_whole_batch():
    ref, ref_losses = train("allreduce")
    for devices in (2, 3):  # 16 samples: 8+8, and 6+5+5 (weighted by slice size)
        params, losses = train("allreduce", devices_per_worker=devices)
        assert max_rel(params, ref) <= 1e-5, devices
        assert np.allclose(losses, ref_losses, rtol=1e-5), devices
    params, _ = train("ps", devices_per_worker=2, grad_shard_bytes=2000)
    assert max_rel(params, ref) <= 1e-5
    # the replicas average gradients, not updates: Adam (not linear in g) agrees too
    adam = ngdist.optim.Adam(lr=1e-2)
    for strategy in ("allreduce", "pushsum"):
        ref, _ = train(strategy, optimizer=adam)
        params, _ = train(strategy, optimizer=adam, devices_per_worker=2)
        assert max_rel(params, ref) <= 1e-5, strategy
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, devices_per_worker=4)
    assert len(tr.executor.towers) == 4  # one onnxruntime session per replica
    with pytest.raises(InputError, match=r"a batch of 3 sample\(s\) cannot feed 4 replicas "
                                         r"\(devices_per_worker\)"):
        tr.step({"x": X[:3], "y": Y[:3]})


def test_fetch_stats():
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD)
    assert tr.step({"x": X[:8], "y": Y[:8]}, fetch_stats=False) is None
    stats = tr.step({"x": X[:8], "y": Y[:8]})
    assert stats.samples == 8 and stats.samples_per_s > 0 and np.isfinite(stats.loss)
    assert stats.compute_time > 0 and stats.comm_time >= 0 and stats.bytes_sent == 0
    assert tr.steps_done == 2


def test_unknown_all_reduce_alg():
    with pytest.raises(NgdistError, match=r"unknown all_reduce_alg 'rong'; choose one of "
                                          r"\['mpi', 'ring', 'recursive_doubling', "
                                          r"'hierarchical', 'exact'\]"):
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=SGD, all_reduce_alg="rong")


# --------------------------------------------------------------------------- DistributedSGD

def creator(start: int = 0, batch: int = 16):
    def make(worker: int, device: int) -> Model:
        def data():
            i = start
            while True:
                yield {"x": X[i * batch:(i + 1) * batch], "y": Y[i * batch:(i + 1) * batch]}
                i += 1
        return Model(zoo.mlp((64, 32, 10), seed=0), optimizer=SGD, data=data())
    return make


def test_distributed_sgd_checkpoint_single_process(tmp_path):
    sgd = DistributedSGD(creator(), num_workers=1, strategy="ps", grad_shard_bytes=2000)
    for _ in range(5):
        assert sgd.step() is None
    path = sgd.save_checkpoint(tmp_path)
    assert path == str(tmp_path / "model.onnx")
    for _ in range(5):
        sgd.step()
    want = sgd.trainer.state_dict()
    want.update(ngdist.runtime.ps_server.gather_state(sgd.trainer))
    sgd.close()
    # the file is a standard training model: ngdist.compile takes it under any strategy
    ckpt = load_proto(path)
    assert ckpt.training_info and not comm_nodes(ckpt)
    again = DistributedSGD(creator(start=5), num_workers=1, strategy="ps", grad_shard_bytes=2000)
    again.restore_checkpoint(path)
    for _ in range(5):
        again.step()
    got = again.trainer.state_dict()
    got.update(ngdist.runtime.ps_server.gather_state(again.trainer))
    assert want.keys() == got.keys()
    for k in want:  # parameters, momentum, step counter, lr: bit for bit
        assert np.array_equal(want[k], got[k]), k
    assert np.any(want["fc0.weight.momentum"] != 0)
    weights = again.foreach_model(lambda m: m.get_weights())
    assert len(weights) == 1 and np.array_equal(weights[0]["fc0.bias"], want["fc0.bias"])
    assert again.foreach_worker(lambda w: w.index) == [0]
    other = DistributedSGD(lambda w, d: Model(zoo.mlp((64, 16, 10)), optimizer=SGD),
                           num_workers=1, strategy="allreduce")
    with pytest.raises(NgdistError, match=r"model.onnx is not a checkpoint of this model: "
                                          r"'fc0.weight' is float32\[32, 64\] there, "
                                          r"float32\[16, 64\] here"):
        other.restore_checkpoint(path)


def test_distributed_sgd_argument_errors():
    with pytest.raises(NgdistError, match=r"DistributedSGD\(num_workers=4\) but this job has 1 "
                                          r"worker rank\(s\) \(1 rank\(s\), 0 server\(s\)\); "
                                          r"launch it with `ngdist run -n 4 -- python SCRIPT`"):
        DistributedSGD(creator(), num_workers=4, strategy="allreduce")
    with pytest.raises(NgdistError, match="DistributedSGD strategy must be one of"):
        DistributedSGD(creator(), num_workers=1, strategy="gossip")
    with pytest.raises(NgdistError, match="model_creator must return ngdist.compat.ray.Model"):
        DistributedSGD(lambda w, d: zoo.mlp(), num_workers=1, strategy="simple")
    with pytest.raises(NgdistError, match=r"^the ONNX model has no training step and no "
                                          r"optimizer was given: pass optimizer="):
        DistributedSGD(lambda w, d: Model(zoo.mlp((64, 8, 10))), num_workers=1,
                       strategy="simple")
    sgd = DistributedSGD(lambda w, d: Model(zoo.mlp((64, 8, 10)), optimizer=SGD),
                         num_workers=1, strategy="simple")
    with pytest.raises(NgdistError, match="this Model has no data: pass data="):
        sgd.step()


# --------------------------------------------------------------------------- CLI

def test_cli_rewrite_options_and_run_servers(cli, tmp_path, same_trajectory):
    onnx.save(zoo.mlp((64, 32, 10), seed=0), tmp_path / "mlp.onnx")
    opt = ["--optimizer", "sgd:lr=0.1,momentum=0.9"]
    proc = cli("rewrite", "mlp.onnx", "-o", "ps.onnx", "--strategy", "ps",
               "--grad-shard-bytes", "4096", *opt, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = cli("inspect", "ps.onnx", cwd=tmp_path)
    assert "PSPushPull" in proc.stdout and "grad_shard_bytes=4096" in proc.stdout
    assert "update=<graph ngdist_ps_update:" in proc.stdout
    proc = cli("rewrite", "mlp.onnx", "-o", "ring.onnx", "--all-reduce-alg", "ring", *opt,
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "algorithm=ring" in cli("inspect", "ring.onnx", cwd=tmp_path).stdout
    proc = cli("rewrite", "mlp.onnx", "-o", "x.onnx", "--all-reduce-alg", "rong", *opt,
               cwd=tmp_path)
    assert proc.returncode == 1 and "ngdist: error: unknown all_reduce_alg 'rong'" in proc.stderr
    proc = cli("run", "-n", "2", "--servers", "2", "--", sys.executable, "-c", "pass",
               cwd=tmp_path)
    assert proc.returncode == 1
    assert "ngdist: error: --servers 2 needs more ranks than servers (-n 2)" in proc.stderr
    # the rewritten ps file trains like ngdist.compile on the original (one process)
    a = ngdist.compile(str(tmp_path / "mlp.onnx"), optimizer=SGD, strategy="ps",
                       grad_shard_bytes=4096)
    b = ngdist.compile(str(tmp_path / "ps.onnx"))
    same_trajectory(a, b, X, Y, steps=5, batch=16)
