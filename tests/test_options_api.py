"""Typed options at the Python surfaces: ``ngdist.compile``, ``ngdist.DistributedSGD``,
``ngdist.kvstore.create`` and optimizer specs refuse unknown, misspelt, misplaced and
wrongly typed options with messages naming the valid ones; valid options still work."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import ngdist
from ngdist import kvstore, zoo
from ngdist.api import RuntimeOptions
from ngdist.compat.ray import DistributedSGD, Model
from ngdist.data import load_digits
from ngdist.optim import SGD, Adam, from_spec
from ngdist.passes.options import OptionError

X, Y, _, _ = load_digits()
OPT = SGD(lr=0.1)
RUNTIME = ", ".join(RuntimeOptions.names())  # timeout, intra_op_threads, overlap, ...
PUSHSUM = "graph, overlap, peers_per_itr, synch_freq"
ALLREDUCE = ("all_reduce_alg, bucket_bytes, compression, compression_error_feedback, "
             "reproducible_micro_batch, shard, shard_ranks")


def _comm_attributes(trainer: ngdist.Trainer) -> list[tuple[str, dict[str, object]]]:
    return [(n.op_type, {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute})
            for n in trainer.to_onnx().training_info[0].algorithm.node if n.domain == "ngdist"]


# --------------------------------------------------------------------------- ngdist.compile

@pytest.mark.parametrize("strategy, given, message", [
    ("pushsum", {"peers_per_iter": 2},
     "unknown option 'peers_per_iter' for strategy 'pushsum'; did you mean 'peers_per_itr'? "
     f"Valid options: {PUSHSUM}; runtime options: {RUNTIME}"),
    ("allreduce", {"reproducible_microbatch": 32},
     "unknown option 'reproducible_microbatch' for strategy 'allreduce'; did you mean "
     f"'reproducible_micro_batch'? Valid options: {ALLREDUCE}; runtime options: {RUNTIME}"),
    ("allreduce", {"all_reduce_algo": "ring"},
     "unknown option 'all_reduce_algo' for strategy 'allreduce'; did you mean "
     f"'all_reduce_alg'? Valid options: {ALLREDUCE}; runtime options: {RUNTIME}"),
    ("allreduce", {"timout": 5},  # a runtime option, misspelt
     "unknown option 'timout' for strategy 'allreduce'; did you mean 'timeout'? Valid "
     f"options: {ALLREDUCE}; runtime options: {RUNTIME}"),
    ("local", {"optimiser": OPT},  # one of compile's own keywords, misspelt
     "unknown option 'optimiser' for strategy 'local'; did you mean 'optimizer'? Valid "
     f"options: none; runtime options: {RUNTIME}"),
    ("pushsum", {"all_reduce_alg": "ring"},
     "all_reduce_alg is an option of the allreduce strategy, not of 'pushsum'; options of "
     f"'pushsum': {PUSHSUM}; runtime options: {RUNTIME}"),
    ("pushsum", {"bucket_bytes": 4096},
     "bucket_bytes is an option of the allreduce strategy, not of 'pushsum'; options of "
     f"'pushsum': {PUSHSUM}; runtime options: {RUNTIME}"),
    ("pushsum", {"peers_per_itr": "two"},
     "option 'peers_per_itr' of strategy 'pushsum' takes an int, got 'two' (str)"),
    ("allreduce", {"intra_op_threads": 1.5},
     "option 'intra_op_threads' of ngdist.compile takes an int or None, got 1.5 (float)"),
    ("allreduce", {"timeout": "5 s"},
     "option 'timeout' of ngdist.compile takes a number or None, got '5 s' (str)"),
])
def test_compile_refuses_bad_options(strategy, given, message):
    assert {"timeout", "intra_op_threads", "overlap", "devices_per_worker", "ps_serve"} <= \
        set(RuntimeOptions.names())
    with pytest.raises(OptionError) as exc:
        ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=OPT, strategy=strategy, **given)
    assert str(exc.value) == message


def test_compile_checks_options_before_building_a_framework_model():
    class Module:  # detected as a torch module by its class name and module, never exported
        pass
    Module.__module__ = "torch.nn.modules.module"
    fake = type("Net", (Module,), {})()
    with pytest.raises(OptionError, match=r"^unknown option 'peers_per_iter'"):
        ngdist.compile(fake, np.zeros((2, 64), np.float32), strategy="pushsum",
                       peers_per_iter=2)


def test_compile_passes_valid_options_to_the_strategy():
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=OPT, strategy="pushsum", graph="ring",
                        peers_per_itr=1, synch_freq=2, overlap=True, timeout=30.0,
                        intra_op_threads=1)
    assert _comm_attributes(tr) == [("PushSum", {"graph": b"ring", "peers_per_itr": 1,
                                                 "overlap": 1, "synch_freq": 2})]
    assert np.isfinite(tr.step({"x": X[:16], "y": Y[:16]}).loss)
    tr.close()
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=OPT, bucket_bytes=0,
                        all_reduce_alg="ring", overlap=False)  # overlap: the runtime's only
    assert [(op, attrs["algorithm"]) for op, attrs in _comm_attributes(tr)] == \
        [("AllReduce", b"ring")] * 4
    tr.close()
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=OPT, strategy="ps",
                        grad_shard_bytes=np.int64(4096))
    assert [(op, attrs["grad_shard_bytes"]) for op, attrs in _comm_attributes(tr)] == \
        [("PSPushPull", 4096)]
    tr.close()


def test_compile_defaults_apply_to_every_strategy():
    # no option given: each strategy gets its own comm nodes with its own defaults, and no
    # strategy is handed another strategy's default (bucket_bytes, ...)
    own = {"allreduce": [("AllReduce", {"algorithm": b"mpi"})],  # 25 MiB: one bucket
           "pushsum": [("PushSum", {"graph": b"exponential", "peers_per_itr": 1,
                                    "overlap": 0, "synch_freq": 0})],
           "ps": [("PSPushPull", {"grad_shard_bytes": 10_000_000, "servers": 0})],
           "simple": [("CentralReduce", {})], "local": []}
    for strategy, expected in own.items():
        tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=OPT, strategy=strategy)
        got = _comm_attributes(tr)
        tr.close()
        assert [op for op, _ in got] == [op for op, _ in expected], strategy
        for (_, attrs), (_, defaults) in zip(got, expected):
            assert {k: attrs[k] for k in defaults} == defaults, strategy


# --------------------------------------------------------------------------- DistributedSGD

def _creator(worker: int, device: int) -> Model:
    return Model(zoo.mlp((64, 8, 10), seed=0), optimizer=OPT,
                 data=iter([{"x": X[:16], "y": Y[:16]}] * 10))


def test_distributed_sgd_refuses_unknown_keywords():
    with pytest.raises(OptionError) as exc:
        DistributedSGD(_creator, num_workers=1, strategy="ps", grad_shard_byte=4096)
    assert str(exc.value) == (
        "unknown option 'grad_shard_byte' for ngdist.DistributedSGD; did you mean "
        "'grad_shard_bytes'? Valid options: all_reduce_alg, bucket_bytes, devices_per_worker, "
        "gpu, grad_shard_bytes, intra_op_threads, micro_batch, model_creator, num_workers, "
        "servers, strategy, timeout")


@pytest.mark.parametrize("strategy, given, message", [
    ("ps", {"all_reduce_alg": "ring"},
     "all_reduce_alg is an option of the allreduce strategy, not of 'ps'; options of 'ps': "
     "grad_shard_bytes, servers"),
    ("allreduce", {"grad_shard_bytes": 4096},
     "grad_shard_bytes is an option of the ps strategy, not of 'allreduce'; options of "
     f"'allreduce': {ALLREDUCE}"),
    ("simple", {"servers": 1},
     "servers is an option of the ps strategy, not of 'simple'; 'simple' takes no options"),
    ("ps", {"grad_shard_bytes": 1e7},  # Ray's default is a float; ngdist counts bytes
     "option 'grad_shard_bytes' of strategy 'ps' takes an int, got 10000000.0 (float)"),
])
def test_distributed_sgd_refuses_options_of_other_strategies(strategy, given, message):
    made = []
    with pytest.raises(OptionError) as exc:
        DistributedSGD(lambda w, d: made.append(w) or _creator(w, d), num_workers=1,
                       strategy=strategy, **given)
    assert str(exc.value) == message
    assert made == []  # refused before any model was built


def test_distributed_sgd_valid_options_still_work():
    sgd = DistributedSGD(_creator, 1, 1, False, "ps", 4096)  # Ray's positional order
    assert [(n.op_type, {a.name: a.i for a in n.attribute if a.name == "grad_shard_bytes"})
            for n in sgd.trainer.to_onnx().training_info[0].algorithm.node
            if n.domain == "ngdist"] == [("PSPushPull", {"grad_shard_bytes": 4096})]
    assert sgd.step(fetch_stats=True).loss > 0
    sgd.close()
    sgd = DistributedSGD(_creator, num_workers=1, strategy="allreduce", all_reduce_alg="ring",
                         bucket_bytes=0)
    assert {n.op_type for n in sgd.trainer.to_onnx().training_info[0].algorithm.node
            if n.domain == "ngdist"} == {"AllReduce"}
    sgd.close()


# --------------------------------------------------------------------------- kvstore.create

def test_kvstore_create_refuses_unknown_keywords():
    with pytest.raises(OptionError) as exc:
        kvstore.create("local", timout=5)
    assert str(exc.value) == ("unknown option 'timout' for ngdist.kvstore.create; did you mean "
                              "'timeout'? Valid options: name, timeout")
    with pytest.raises(OptionError) as exc:
        kvstore.create("dist_sync", optimizer=SGD())
    assert str(exc.value) == ("unknown option 'optimizer' for ngdist.kvstore.create. Valid "
                              "options: name, timeout")
    with pytest.raises(OptionError) as exc:
        kvstore.create("local", timeout="5 s")
    assert str(exc.value) == ("option 'timeout' of ngdist.kvstore.create takes a number or "
                              "None, got '5 s' (str)")


def test_kvstore_create_valid_options_still_work():
    kv = kvstore.create("local", 30)
    kv.init("w", np.ones(3, np.float32))
    kv.push("w", np.full(3, 2, np.float32))
    out = np.zeros(3, np.float32)
    kv.pull("w", out=out)
    assert out.tolist() == [2, 2, 2]  # no optimizer: a push assigns
    assert kvstore.create(name="dist_allreduce", timeout=10).type == "dist_allreduce"


# --------------------------------------------------------------------------- optimizer specs

@pytest.mark.parametrize("spec, message", [
    ("sgd:learning_rate=0.1",
     "unknown key 'learning_rate' for optimizer 'sgd' in 'sgd:learning_rate=0.1'; did you mean "
     "'lr'? Valid keys of sgd: dampening, lr, maximize, momentum, nesterov, "
     "scheduled_momentum, weight_decay"),
    ("sgd:lr=0.1,momentun=0.9",
     "unknown key 'momentun' for optimizer 'sgd' in 'sgd:lr=0.1,momentun=0.9'; did you mean "
     "'momentum'? Valid keys of sgd: dampening, lr, maximize, momentum, nesterov, "
     "scheduled_momentum, weight_decay"),
    ("adam:gamma=2",
     "unknown key 'gamma' for optimizer 'adam' in 'adam:gamma=2'. Valid keys of adam: betas, "
     "eps, lr, maximize, weight_decay"),
    ("sgd:lr=fast", "optimizer spec 'sgd:lr=fast': lr='fast' is not a number"),
    ("sgd:lr", "optimizer spec 'sgd:lr': 'lr' has no value; write lr=VALUE"),
    ("sgd:nesterov=maybe",
     "optimizer spec 'sgd:nesterov=maybe': nesterov='maybe' is not 1, 0, true or false"),
    ("adam:betas=0.9", "optimizer spec 'adam:betas=0.9': betas='0.9' is not two numbers as "
                       "BETA1/BETA2"),
    ("lbfgs:lr=0.1",
     "unknown optimizer 'lbfgs' in 'lbfgs:lr=0.1'; choose one of ['adadelta', 'adagrad', "
     "'adam', 'adamax', 'adamw', 'keras_adadelta', 'keras_adagrad', 'keras_adamax', "
     "'keras_adamw', 'keras_nadam', 'keras_rmsprop', 'keras_sgd', 'nadam', 'radam', 'rmsprop', "
     "'sgd', 'torch_adam']"),
])
def test_optimizer_spec_errors_name_the_valid_keys(spec, message):
    with pytest.raises(OptionError) as exc:
        from_spec(spec)
    assert str(exc.value) == message


def test_optimizer_specs_still_parse():
    assert from_spec("sgd:lr=0.1,momentum=0.9,nesterov=1") == \
        SGD(lr=0.1, momentum=0.9, nesterov=True)
    assert from_spec("adam:lr=1e-3,betas=0.8/0.99, eps=1e-7") == \
        Adam(lr=1e-3, betas=(0.8, 0.99), eps=1e-7)
    assert from_spec("SGD") == SGD()


def test_compile_names_an_allocation_it_was_refused(monkeypatch):
    """A MemoryError while the model is built or split (numpy, protobuf, Python) ends as an
    OutOfMemoryError naming the limit in force and what to do, as a step's does."""
    import resource

    from ngdist import api
    from ngdist.errors import OutOfMemoryError

    def refused(*args, **kwargs):
        raise MemoryError("Unable to allocate 1.00 GiB")

    monkeypatch.setattr(api, "split_training_model", refused)
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    limit = "this process has no more memory" if soft == resource.RLIM_INFINITY else \
        f"this process's address space is limited to {soft >> 20} MiB (RLIMIT_AS)"
    with pytest.raises(OutOfMemoryError) as info:
        ngdist.compile(zoo.mlp((64, 8, 10), seed=0), optimizer=OPT, strategy="local")
    assert str(info.value) == (f"out of memory in ngdist.compile: {limit} and the step asked "
                               "for more; raise the limit, shard the parameters over the ranks "
                               "(shard='parameters'), or use smaller batches")
    assert isinstance(info.value.__cause__, MemoryError)
