"""ZeRO-3 (``shard="parameters"``, passes/shard_params.py) under real mpiexec: each rank holds
1/N of every parameter between steps, gathered before the forward's and again before the
backward's first reader of each bucket. After 20 steps of the digits MLP (several buckets, so
the gathers chain bucket to bucket) and of the transformers zoo's GPT-2 (a tied LM head: one
parameter read by the embedding and the head) it equals plain allreduce within 1e-5 (SGD with
momentum) and 1e-4 (AdamW) on 2 and 4 ranks; the gathered parameters are the same bytes on
every rank; the step graph holds no whole parameter, only the flat shards. ZeRO-1 and ZeRO-2
(``shard="optimizer"``, ``"gradients"``) equal it on GPT-2 within the same bounds and send
allreduce's bytes up to the padding (the MLP's: tests/test_sharding.py). GPT-2 is exported
by the torch frontend (with torch's SGD and AdamW) once, into the training model file every
rank compiles, so the ranks import neither torch nor transformers."""
from __future__ import annotations

import json

import numpy as np
import pytest
from sharding_ranks import same_on_every_rank

STEPS = 20
SCRIPT = f"STEPS = {STEPS}\n" + r"""
import json, sys
from pathlib import Path
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()
GPT2 = Path(sys.argv[1])  # gpt2.<opt>.onnx and the global batches of every step
OPTIMIZERS = {"sgd": lambda: ngdist.optim.SGD(lr=0.1, momentum=0.9),
              "adamw": lambda: ngdist.optim.AdamW(lr=0.01, weight_decay=0.01)}
out, info = {}, {}


def record(key, t, sent):
    g = t.step_model.graph
    info[key] = {"sent": sorted(sent), "inputs": [i.name for i in g.inputs],
                 "gathers": sum(n.op_type == "AllGather" for n in g),
                 "shards": {n: t.values[n].numpy().size for n in t.meta.names("param")}}
    out.update({f"{key}.{k}": v for k, v in t.parameters().items()})  # (collective)


for opt in ("sgd", "adamw"):
    for shard in ("none", "parameters", "optimizer", "gradients"):
        if shard in ("none", "parameters"):  # (the MLP's ZeRO-1/2: tests/test_sharding.py)
            t = ngdist.compile(zoo.mlp((64, 32, 16, 10), seed=0), loss="softmax_cross_entropy",
                               labels="y", optimizer=OPTIMIZERS[opt](), shard=shard, timeout=60,
                               bucket_bytes=2048)
            sent = set()
            for i in range(STEPS):
                b = slice(16 * t.size * i, 16 * t.size * (i + 1))
                (mine,) = t.shard([(x[b], y[b])])
                sent.add(t.step({"x": mine[0], "y": mine[1]}).bytes_sent)
            record(f"mlp.{opt}.{shard}", t, sent)
            t.close()
        t = ngdist.compile(GPT2 / f"gpt2.{opt}.onnx", shard=shard, timeout=60,
                           bucket_bytes=20000)
        batches = np.load(GPT2 / f"batches{t.size}.npz")
        sent = set()
        for i in range(STEPS):
            (mine,) = t.shard([{k: batches[f"{k}{i}"] for k in ("input_ids", "labels")}])
            sent.add(t.step(mine).bytes_sent)
        record(f"gpt2.{opt}.{shard}", t, sent)
        t.close()
np.savez(f"params{t.rank}.npz", **out)
json.dump(info, open(f"info{t.rank}.json", "w"))
"""


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """The transformers zoo's GPT-2 as ONNX training models, ``gpt2.sgd.onnx`` and
    ``gpt2.adamw.onnx`` (exported by the torch frontend with torch's optimizers), and the global
    batches of every step on 2 and 4 ranks, ``batches<n>.npz``."""
    import onnx
    import torch

    from ngdist import zoo_transformers as hfzoo
    from ngdist.frontends import torch as tfront

    folder = tmp_path_factory.mktemp("gpt2")
    optimizers = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                  "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.003,
                                                       weight_decay=0.01)}
    for opt, make in optimizers.items():
        model = hfzoo.build("gpt2")
        proto, _ = tfront.training_model(model, hfzoo.tensors(hfzoo.batch("gpt2", size=2)),
                                         loss=None, input_names=["input_ids", "labels"],
                                         optimizer=make(model))
        onnx.save(proto, folder / f"gpt2.{opt}.onnx")
    for n in (2, 4):
        np.savez(folder / f"batches{n}.npz", **{
            f"{k}{i}": v for i in range(STEPS)
            for k, v in hfzoo.batch("gpt2", size=2 * n, seed=i).items()})
    return folder


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_zero3_equals_allreduce_on_the_mlp_and_gpt2_and_zero1_2_on_gpt2(ranks, tmp_path, gpt2, n):
    ranks(n, SCRIPT, args=[str(gpt2)], timeout=260)
    params = [same_on_every_rank(tmp_path, n)]
    info = [json.loads((tmp_path / f"info{r}.json").read_text()) for r in range(n)]
    for model in ("mlp", "gpt2"):
        for opt, tol in (("sgd", 1e-5), ("adamw", 1e-4)):
            plain = {k.split(".", 3)[3]: v for k, v in params[0].items()
                     if k.startswith(f"{model}.{opt}.none.")}
            sharded = {k.split(".", 3)[3]: v for k, v in params[0].items()
                       if k.startswith(f"{model}.{opt}.parameters.")}
            assert sorted(sharded) == sorted(plain) and len(plain) >= 6, sorted(sharded)
            for k, v in plain.items():
                np.testing.assert_allclose(sharded[k], v, rtol=0, atol=tol,
                                           err_msg=f"{model} {opt} {k}")
            mine = info[0][f"{model}.{opt}.parameters"]
            whole = info[0][f"{model}.{opt}.none"]
            # no whole parameter is an input of the sharded step: only flat shards of
            # ceil(L / n) elements, together 1/n of the parameters (up to the padding)
            assert not set(plain) & set(mine["inputs"]), set(plain) & set(mine["inputs"])
            count = sum(v.size for v in plain.values())
            assert sum(whole["shards"].values()) == count
            held = sum(mine["shards"].values())
            assert count / n <= held <= count / n + len(mine["shards"]), (held, count)
            assert len(mine["shards"]) >= 2  # several buckets: the gathers chain
            # bytes per step: the ReduceScatter and the forward's AllGather of each padded
            # bucket, each half an AllReduce (comm/group.py), and the backward's AllGather:
            # more than allreduce's, at most 1.5x
            # (GPT-2's loss, a mean over counted tokens, also sums its count: one float)
            assert len(whole["sent"]) == len(mine["sent"]) == 1
            count_bytes = whole["sent"][0] - 4 * count
            assert count_bytes == (4 if model == "gpt2" else 0), whole["sent"]
            sent = mine["sent"][0] - count_bytes
            assert 4 * count < sent <= 1.5 * 4 * n * held, (mine["sent"], count)
            # every bucket gathered for the forward and again for the backward (a bucket of
            # biases alone, read by no backward node, only once)
            assert len(mine["shards"]) < mine["gathers"] <= 2 * len(mine["shards"])
    for opt, tol in (("sgd", 1e-5), ("adamw", 1e-4)):  # GPT-2 under ZeRO-1 and ZeRO-2
        plain = {k.split(".", 3)[3]: v for k, v in params[0].items()
                 if k.startswith(f"gpt2.{opt}.none.")}
        for level in ("optimizer", "gradients"):
            sharded = {k.split(".", 3)[3]: v for k, v in params[0].items()
                       if k.startswith(f"gpt2.{opt}.{level}.")}
            assert sorted(sharded) == sorted(plain), sorted(sharded)
            for k, v in plain.items():
                np.testing.assert_allclose(sharded[k], v, rtol=0, atol=tol,
                                           err_msg=f"gpt2 {opt} {level} {k}")
            # ReduceScatter and AllGather of each padded bucket: allreduce's bytes (+ padding)
            whole, mine = info[0][f"gpt2.{opt}.none"], info[0][f"gpt2.{opt}.{level}"]
            assert len(mine["sent"]) == 1 and whole["sent"][0] <= mine["sent"][0] <= \
                whole["sent"][0] + 4 * n * len(mine["shards"]), (mine["sent"], whole["sent"])


def test_each_gather_is_freed_before_the_next_and_issued_one_bucket_ahead():
    """The step plan on 2 ranks (runtime/plan.py, no MPI needed): every bucket's forward
    gather dies before its backward gather is issued, and the forward gathers are spread over
    the forward pass (a layer's buckets, then its compute), not all issued at the start."""
    import onnx_ir as ir

    import ngdist
    from ngdist import zoo
    from ngdist.ir.model import get_meta, split_training_model
    from ngdist.passes.pipeline import run_passes
    from ngdist.runtime.partition import CommCall
    from ngdist.runtime.plan import build_plan

    model = ngdist.to_training_model(zoo.mlp((64, 32, 16, 10), seed=0), labels="y",
                                     loss="softmax_cross_entropy",
                                     optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    _, step = split_training_model(model)
    step = run_passes(step, "allreduce", shard="parameters", shard_ranks=2, bucket_bytes=2048)
    plan = build_plan(ir.to_proto(step), 2, overlap=False, donate=get_meta(step).binding)
    gathers = {i.node.name: i for i in plan.items if isinstance(i, CommCall)
               and i.node.op_type == "AllGather"}
    forward = sorted(i.index for n, i in gathers.items() if n.endswith("/fwd"))
    assert len(forward) >= 3, sorted(gathers)
    for name, item in gathers.items():
        if name.endswith("/fwd") and name[:-4] + "/bwd" in gathers:
            # (every parameter of the bucket: views of one gathered buffer)
            assert max(plan.last_use[o] for o in item.node.output) < \
                gathers[name[:-4] + "/bwd"].index, name
    # the buckets (fc0.weight, fc0.bias, fc1.weight, fc1.bias, fc2.*) are gathered one layer
    # at a time: a layer's weight and bias (one first reader) together, then compute
    runs = [[forward[0]]]
    for a, b in zip(forward, forward[1:]):
        if any(not isinstance(plan.items[k], CommCall) for k in range(a + 1, b)):
            runs.append([])
        runs[-1].append(b)
    assert [len(r) for r in runs] == [2, 2, 1], runs
    assert forward[0] > 0  # after the step's first compute, not before everything
