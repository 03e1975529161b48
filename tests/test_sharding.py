"""Sharded data parallelism (passes/shard.py, runtime/sharding.py) under real mpiexec: ZeRO-1
(``shard="optimizer"``) and ZeRO-2 (``shard="gradients"``) on the digits MLP equal plain
allreduce after 20 steps (1e-5 with SGD and momentum, 1e-4 with AdamW) on 2 and 4 ranks, and
torch float64 on 2; the ranks' parameters are the same bytes; each rank's optimizer state is
1/N of allreduce's; the bytes a step sends; ZeRO-2's gradient bucket dropped after its
ReduceScatter; ``trainer.save`` writes a standard model that resumes under plain allreduce and
sharded on 2 ranks and on one process; parameter groups, BatchNorm buffers, ``join()`` and
``ngdist train --shard`` also under ZeRO-3 (``shard="parameters"``; its own tests are in
test_sharding_params.py); ``ngdist inspect --shard``; the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import ngdist
from conftest import ngdist_train, run_cli
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import OptionError
from ngdist.ir.model import load_proto

BATCH, STEPS, SIZES = 16, 20, (64, 32, 10)  # samples per rank and step

COMMON = r"""
import json, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()
OPTIMIZERS = {"sgd": lambda: ngdist.optim.SGD(lr=0.1, momentum=0.9),
              "adamw": lambda: ngdist.optim.AdamW(lr=0.01, weight_decay=0.01)}


def make(shard, opt, model=None):
    return ngdist.compile(model or zoo.mlp((64, 32, 10), seed=0), loss="softmax_cross_entropy",
                          labels="y", optimizer=OPTIMIZERS[opt](), shard=shard, timeout=60)


def steps(t, first, count):
    sent = set()
    for i in range(first, first + count):
        b = slice(16 * t.size * i, 16 * t.size * (i + 1))
        (mine,) = t.shard([(x[b], y[b])])
        sent.add(t.step({"x": mine[0], "y": mine[1]}).bytes_sent)
    return sorted(sent)
"""

TRAIN = COMMON + r"""
out, info = {}, {}
for opt in ("sgd", "adamw"):
    for shard in ("none", "optimizer", "gradients"):
        t = make(shard, opt)
        sent = steps(t, 0, 20)
        for k, v in t.parameters().items():
            out[f"{opt}.{shard}.{k}"] = v
        g = t.step_model.graph
        state = sum(int(np.prod(g.initializers[n].shape.dims, dtype=np.int64))
                    for n in t.meta.names("state") if n != "ngdist.step")  # (shared count)
        plan = t.executor.plan
        freed = [sorted(set(plan.free_after.get(i.index, ())) & set(i.node.input))
                 for i in plan.items if getattr(i, "node", None) is not None
                 and i.node.op_type == "ReduceScatter"]
        info[f"{opt}.{shard}"] = {"sent": sent, "state": state, "freed": freed}
        t.close()
np.savez(f"params{t.rank}.npz", **out)
json.dump(info, open(f"info{t.rank}.json", "w"))
"""


def _digits(steps: int, first: int = 0, ranks: int = 2):
    x, y, _, _ = load_digits()
    n = BATCH * ranks
    return [(x[n * i:n * (i + 1)], y[n * i:n * (i + 1)]) for i in range(first, first + steps)]


def _torch_sgd(ranks: int) -> dict[str, np.ndarray]:
    """The digits MLP in torch float64, 20 steps of SGD with momentum on the global batches."""
    init = {t.name: onnx.numpy_helper.to_array(t) for t in zoo.mlp(SIZES, seed=0).graph.initializer}
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10)).double()
    names = {"0": "fc0", "2": "fc1"}
    with torch.no_grad():
        for k, p in model.named_parameters():
            layer, kind = k.split(".")
            p.copy_(torch.from_numpy(init[f"{names[layer]}.{kind}"].astype(np.float64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _digits(STEPS, ranks=ranks):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x).double()),
                                          torch.from_numpy(y).long()).backward()
        opt.step()
    return {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": p.detach().numpy()
            for k, p in model.named_parameters()}


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_zero1_and_zero2_equal_allreduce(ranks, tmp_path, n):
    ranks(n, TRAIN, timeout=220)
    params = [dict(np.load(tmp_path / f"params{r}.npz")) for r in range(n)]
    info = [json.loads((tmp_path / f"info{r}.json").read_text()) for r in range(n)]
    for key, value in params[0].items():  # the gathered parameters: the same bytes on all ranks
        for other in params[1:]:
            assert other[key].tobytes() == value.tobytes(), key
    names = [k.split(".", 2)[2] for k in params[0] if k.startswith("sgd.none.")]
    for opt, tol in (("sgd", 1e-5), ("adamw", 1e-4)):
        for shard in ("optimizer", "gradients"):
            for k in names:
                np.testing.assert_allclose(params[0][f"{opt}.{shard}.{k}"],
                                           params[0][f"{opt}.none.{k}"], rtol=0, atol=tol,
                                           err_msg=f"{opt} {shard} {k}")
            plain, mine = info[0][f"{opt}.none"], info[0][f"{opt}.{shard}"]
            count = sum(params[0][f"{opt}.none.{k}"].size for k in names)
            kinds = 1 if opt == "sgd" else 2
            assert plain["state"] == kinds * count
            # one flat bucket of `count` elements, padded to a multiple of n, 1/n per rank
            assert mine["state"] == kinds * -(-count // n), (opt, shard, mine["state"])
            # a ReduceScatter and an AllGather of the padded bucket, each half an AllReduce
            # on the wire (comm/group.py): the AllReduce's bytes, up to the padding
            padded = 4 * n * -(-count // n)
            assert plain["sent"] == [4 * count]
            assert mine["sent"] == [padded], (opt, shard, mine["sent"])
            # the padded gradient bucket is dropped right after its ReduceScatter
            assert mine["freed"] and all(f for f in mine["freed"]), mine["freed"]
    if n == 2:  # the independent oracle: torch float64 on the global batches
        expected = _torch_sgd(n)
        for k, v in expected.items():
            np.testing.assert_allclose(params[0][f"sgd.optimizer.{k}"], v, rtol=0, atol=1e-6,
                                       err_msg=k)


RESUME = COMMON + r"""
t = make("optimizer", "sgd")
steps(t, 0, 10)
t.save("sharded.onnx")
steps(t, 10, 10)
np.savez(f"sharded{t.rank}.npz", **t.parameters())
t.close()
plain = ngdist.compile("sharded.onnx", strategy="allreduce", timeout=60)
steps(plain, 10, 10)
np.savez(f"plain{plain.rank}.npz", **plain.parameters())
plain.close()
again = ngdist.compile("sharded.onnx", strategy="allreduce", shard="gradients", timeout=60)
steps(again, 10, 10)
np.savez(f"again{again.rank}.npz", **again.parameters())
"""


@pytest.mark.mpi
def test_save_gathers_a_standard_model_that_resumes_sharded_plain_and_on_one_rank(ranks,
                                                                                   tmp_path):
    ranks(2, RESUME, timeout=200)
    sharded = dict(np.load(tmp_path / "sharded0.npz"))
    plain = dict(np.load(tmp_path / "plain0.npz"))
    again = dict(np.load(tmp_path / "again0.npz"))  # resumed sharded
    model = load_proto(tmp_path / "sharded.onnx")
    info = model.training_info[0]
    state = {t.name: onnx.numpy_helper.to_array(t) for t in info.algorithm.initializer}
    for k, v in sharded.items():  # full per-parameter momentum, gathered from both ranks
        assert state[f"{k}.momentum"].shape == v.shape
        assert np.count_nonzero(state[f"{k}.momentum"]) > v.size // 2, k
        np.testing.assert_allclose(plain[k], v, rtol=0, atol=1e-5, err_msg=k)
        np.testing.assert_allclose(again[k], v, rtol=0, atol=1e-5, err_msg=k)
    assert not any(n.startswith("ngdist/") or n == "ngdist.shard_rank" for n in state)
    one = ngdist.compile(str(tmp_path / "sharded.onnx"), strategy="allreduce")
    for x, y in _digits(10, first=10):
        one.step({"x": x, "y": y})
    for k, v in one.parameters().items():
        np.testing.assert_allclose(v, sharded[k], rtol=0, atol=1e-5, err_msg=k)


GROUPS = r"""
import sys
import numpy as np
import torch
import ngdist
sys.path.insert(0, sys.argv[1])
import test_sharding as T

for shard in ("none", "optimizer", "parameters"):
    model, opt = T.grouped_model()
    t = ngdist.compile(model, torch.zeros(2, 6, dtype=torch.float64), shard=shard,
                       loss=torch.nn.CrossEntropyLoss(), optimizer=opt, timeout=60)
    for x, y in T.grouped_batches(t.size):
        (mine,) = t.shard([(x, y)])
        t.step({"input": mine[0], "y": mine[1]})
    t.to_torch()  # (collective when sharded: the moments gathered)
    moments = {f"{i}.{k}": opt.state[p][k].numpy() for i, p in enumerate(model.parameters())
               for k in ("exp_avg", "exp_avg_sq")}
    np.savez(f"{shard}{t.rank}.npz", **t.parameters(), **moments)
    t.close()
for shard in ("none", "gradients", "parameters"):  # BatchNorm: buffers in the bucket
    model = T.batchnorm_model()
    t = ngdist.compile(model, torch.zeros(2, 6), shard=shard, timeout=60,
                       loss=torch.nn.CrossEntropyLoss(),
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for x, y in T.grouped_batches(t.size):
        (mine,) = t.shard([(x, y)])
        sent = t.step({"input": mine[0].astype(np.float32), "y": mine[1]}).bytes_sent
    np.savez(f"bn.{shard}{t.rank}.npz", sent=sent, **t.state_dict())
    t.close()
"""


def grouped_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A float64 MLP whose torch optimizer has two parameter groups (two optimizer nodes whose
    gradients share one bucket): weight decay on the weights only."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                            torch.nn.Linear(8, 4)).double()
    opt = torch.optim.AdamW([{"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
                             {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0}], lr=0.01)
    return m, opt


def batchnorm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4))


def grouped_batches(ranks: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((4 * ranks, 6)), rng.integers(0, 4, 4 * ranks))
            for _ in range(5)]


@pytest.mark.mpi
def test_parameter_groups_and_buffers_sharing_a_bucket(ranks, tmp_path):
    ranks(2, GROUPS, args=[str(Path(__file__).parent)], timeout=200)
    model, opt = grouped_model()
    for x, y in grouped_batches(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                          torch.from_numpy(y)).backward()
        opt.step()
    expected = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    expected.update({f"{i}.{k}": opt.state[p][k].numpy() for i, p in
                     enumerate(model.parameters()) for k in ("exp_avg", "exp_avg_sq")})
    plain = dict(np.load(tmp_path / "none0.npz"))
    for level in ("optimizer", "parameters"):
        got = [dict(np.load(tmp_path / f"{level}{r}.npz")) for r in range(2)]
        for k, v in expected.items():
            assert got[1][k].tobytes() == got[0][k].tobytes(), k
            np.testing.assert_allclose(got[0][k], plain[k], rtol=0, atol=1e-12, err_msg=k)
            # (the learning rate is a float32 hyper-parameter: 1e-9 off torch's in 5 steps)
            np.testing.assert_allclose(got[0][k], v, rtol=0, atol=1e-8, err_msg=k)
    # buffer averages that shared the gradients' bucket stay averaged, by an AllReduce of
    # their own: the gradients are not also sent whole (ReduceScatter + AllGather of them
    # count as their AllReduce: comm/group.py)
    plain, sharded = (dict(np.load(tmp_path / f"bn.{s}0.npz")) for s in ("none", "gradients"))
    assert sum(p.numel() for p in batchnorm_model().parameters()) % 2 == 0  # no padding
    assert int(sharded.pop("sent")) == int(plain.pop("sent"))
    for k, v in plain.items():
        if k in sharded:
            np.testing.assert_allclose(sharded[k], v, rtol=0, atol=1e-12, err_msg=k)
    assert sharded["1.running_var"].tobytes() == plain["1.running_var"].tobytes()
    zero3 = dict(np.load(tmp_path / "bn.parameters0.npz"))  # gathered for the forward pass
    zero3.pop("sent")
    assert sorted(zero3) == sorted(plain)
    for k, v in plain.items():
        np.testing.assert_allclose(zero3[k], v, rtol=0, atol=1e-6, err_msg=k)


def _mlp() -> onnx.ModelProto:
    return zoo.mlp(SIZES, seed=0)


def test_one_process_shards_like_allreduce():
    """On one rank the shard is the whole padded bucket: the same parameters, bit for bit."""
    got = {}
    for shard in ("none", "gradients"):
        t = ngdist.compile(_mlp(), loss="softmax_cross_entropy", labels="y", shard=shard,
                           optimizer=ngdist.optim.AdamW(lr=0.01, weight_decay=0.01))
        for x, y in _digits(3, ranks=1):
            t.step({"x": x, "y": y})
        got[shard] = t.parameters()
    for k, v in got["none"].items():
        assert got["gradients"][k].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("options, message", [
    ({"shard": "params"}, r"unknown shard 'params'; choose one of \['none', 'optimizer', "
                          r"'gradients', 'parameters'\]"),
    ({"shard": "optimizer", "compression": "fp16", "compression_error_feedback": True},
     r"shard='optimizer' cannot be combined with compression_error_feedback yet \(the "
     r"residual of what the 16-bit cast lost is kept for the whole bucket's AllReduce, which "
     r"the ReduceScatter replaces\); leave compression_error_feedback out"),
    ({"shard": "optimizer", "reproducible_micro_batch": 4},
     r"cannot be combined with reproducible_micro_batch"),
    ({"shard": "parameters", "accumulate": 2},
     r"shard='parameters' cannot be combined with accumulate= yet \(the micro-steps run "
     r"forward and backward on whole parameters, which each rank holds only 1/N of\); use "
     r"shard='gradients' with accumulate=, or leave accumulate= out"),
    ({"shard": "optimizer", "strategy": "pushsum"},
     r"shard is an option of the allreduce strategy, not of 'pushsum'"),
])
def test_refusals(options, message):
    with pytest.raises(OptionError, match=message):
        ngdist.compile(_mlp(), loss="softmax_cross_entropy", labels="y",
                       optimizer=ngdist.optim.SGD(lr=0.1), **options)


def test_one_process_state_dict_round_trip_and_unknown_names():
    """A sharded trainer's state_dict holds per-parameter tensors; loading them into a fresh
    one continues bit for bit; a name it does not hold is a KeyError naming it."""
    def make():
        return ngdist.compile(_mlp(), loss="softmax_cross_entropy", labels="y",
                              shard="parameters", optimizer=ngdist.optim.AdamW(lr=0.01))
    batches = _digits(4, ranks=1)
    t, u = make(), make()
    for x, y in batches[:2]:
        t.step({"x": x, "y": y})
    state = t.state_dict()
    assert {"fc0.weight", "fc0.weight.adam_m", "fc1.bias.adam_v"} <= set(state)
    u.load_state_dict(state)
    for x, y in batches[2:]:
        t.step({"x": x, "y": y})
        u.step({"x": x, "y": y})
    for k, v in t.parameters().items():
        assert u.parameters()[k].tobytes() == v.tobytes(), k
    with pytest.raises(KeyError, match=r"unknown names in state: \['fc9.weight'\]"):
        u.load_state_dict({"fc9.weight": np.zeros(3, np.float32)})


def test_periodic_checkpoints_are_refused_with_the_reason(tmp_path):
    with pytest.raises(OptionError, match=r"^shard='parameters' cannot write periodic "
                                          r"checkpoints yet \(rank 0 writes them alone from "
                                          r"its own values, and a sharded rank holds only its "
                                          r"slices\); leave checkpoint_dir= out"):
        ngdist.compile(_mlp(), loss="softmax_cross_entropy", labels="y", shard="parameters",
                       optimizer=ngdist.optim.SGD(lr=0.1), checkpoint_dir=tmp_path / "c",
                       checkpoint_every=2)


def test_rewrite_with_shard_needs_the_rank_count():
    from ngdist.passes.pipeline import rewrite
    model = ngdist.to_training_model(_mlp(), loss="softmax_cross_entropy", labels="y",
                                     optimizer=ngdist.optim.SGD(lr=0.1))
    with pytest.raises(OptionError, match=r"shard='optimizer' needs the rank count to size the "
                                          r"shards: .* \(ngdist rewrite --shard-ranks N\)$"):
        rewrite(model, "allreduce", shard="optimizer")


def test_inspect_shows_the_shards_and_their_owners(tmp_path):
    model = ngdist.to_training_model(_mlp(), loss="softmax_cross_entropy", labels="y",
                                     optimizer=ngdist.optim.AdamW(lr=0.01))
    onnx.save(model, tmp_path / "mlp.onnx")
    proc = run_cli("inspect", "mlp.onnx", "--shard", "parameters", "--shard-ranks", "4",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # one bucket of 2410 elements in gradient order (fc1 first), 603 per rank, 2 of padding
    assert lines[lines.index("shards (shard=parameters on 4 ranks): 1 bucket(s); each rank "
                             "owns 603 elements of the parameters and of each optimizer "
                             "state"):] == [
        "shards (shard=parameters on 4 ranks): 1 bucket(s); each rank owns 603 elements of "
        "the parameters and of each optimizer state",
        "  bucket ngdist/adam/shard0: 2,410 elements, 603 per rank (2 padding)",
        "    rank 0: fc1.weight[0:320] fc1.bias[0:10] fc0.weight[0:273]",
        "    rank 1: fc0.weight[273:876]",
        "    rank 2: fc0.weight[876:1479]",
        "    rank 3: fc0.weight[1479:2048] fc0.bias[0:32]"]


def _train_cli(tmp_path, *args: str) -> dict[str, np.ndarray]:
    proc = ngdist_train(tmp_path, "mlp.onnx", "--data", "digits.npz", "--optimizer",
                        "sgd:lr=0.1,momentum=0.9", "--epochs", "1", "-n", "2", "--batch-size",
                        "16", *args, timeout=200)
    assert proc.returncode == 0, proc.stderr
    model = load_proto(tmp_path / args[-1])
    return {t.name: onnx.numpy_helper.to_array(t)
            for t in [*model.graph.initializer, *model.training_info[0].algorithm.initializer]}


@pytest.mark.mpi
def test_ngdist_train_shard_saves_a_standard_model(train_files):
    plain = _train_cli(train_files, "--save", "plain.onnx")
    for level in ("gradients", "parameters"):
        sharded = _train_cli(train_files, "--shard", level, "--save", f"{level}.onnx")
        # the same tensors (per-parameter momentum); the file holds the model as compiled
        # from, without the gradient prescale, a hyper-parameter the comm passes add
        assert sorted(sharded) == sorted(set(plain) - {"ngdist.grad_scale"})
        for k, v in sharded.items():
            v = plain[k]
            assert sharded[k].shape == v.shape, k
            np.testing.assert_allclose(sharded[k], v, rtol=0, atol=1e-5, err_msg=f"{level} {k}")


JOIN = COMMON + r"""
out = {}
for shard in ("none", "optimizer", "parameters"):
    t = make(shard, "sgd")
    with t.join():  # rank 0 runs out after 3 batches, rank 1 takes 5
        for i in range(3 if t.rank == 0 else 5):
            b = slice(32 * i + 16 * t.rank, 32 * i + 16 * t.rank + 16)
            t.step({"x": x[b], "y": y[b]})
    out.update({f"{shard}.{k}": v for k, v in t.parameters().items()})
    t.close()
np.savez(f"join{t.rank}.npz", **out)
"""


@pytest.mark.mpi
def test_uneven_inputs_join_a_sharded_step_as_an_allreduce_one(ranks, tmp_path):
    """A rank that ran out answers with zero gradients and still updates its shard (ZeRO-3:
    and still gathers every bucket with the others)."""
    ranks(2, JOIN, timeout=200)
    got = [dict(np.load(tmp_path / f"join{r}.npz")) for r in range(2)]
    for k, v in got[0].items():
        assert got[1][k].tobytes() == v.tobytes(), k
        level = k.split(".", 1)[0]
        if level != "none":
            np.testing.assert_allclose(v, got[0][k.replace(f"{level}.", "none.", 1)], rtol=0,
                                       atol=1e-6, err_msg=k)
    assert sum(k.startswith("parameters.") for k in got[0]) == 4
