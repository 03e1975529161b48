"""``ngdist rewrite --shard``: a sharded file (the whole padded flats and the shard layout in
the file; ngdist/ir/shards.py) that ``ngdist.compile`` trains on its rank count, each rank
taking its slices. Under real mpiexec on 2 ranks, 10 steps of the rewritten ZeRO-3 file equal
``ngdist.compile(..., shard="parameters")`` of the training model bit for bit, and the file it
saves after 5 steps is such a file again and continues bit for bit; ``ngdist inspect`` shows
its shards and owners; another rank count or level is refused with what to do."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import run_cli
from sharding_ranks import same_on_every_rank

import ngdist
from ngdist import zoo
from ngdist.errors import OptionError
from ngdist.ir.model import load_proto
from ngdist.ir.shards import file_layout

SCRIPT = r"""
import numpy as np
import ngdist
from ngdist.data import load_digits

x, y, _, _ = load_digits()


def steps(t, first, count):
    for i in range(first, first + count):
        (mine,) = t.shard([(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])])
        t.step({"x": mine[0], "y": mine[1]})


a = ngdist.compile("z3.onnx", timeout=60)
steps(a, 0, 5)
a.save("again.onnx")
steps(a, 5, 5)
np.savez(f"rewritten{a.rank}.npz", **a.parameters())
a.close()
b = ngdist.compile("train.onnx", shard="parameters", bucket_bytes=2048, timeout=60)
steps(b, 0, 10)
np.savez(f"compiled{b.rank}.npz", **b.parameters())
b.close()
c = ngdist.compile("again.onnx", timeout=60)
steps(c, 5, 5)
np.savez(f"again{c.rank}.npz", **c.parameters())
"""


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_rewritten_zero3_file_trains_as_compile_does(ranks, tmp_path):
    model = ngdist.to_training_model(zoo.mlp((64, 32, 16, 10), seed=0),
                                     loss="softmax_cross_entropy", labels="y",
                                     optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    onnx.save(model, tmp_path / "train.onnx")
    proc = run_cli("rewrite", "train.onnx", "-o", "z3.onnx", "--shard", "parameters",
                   "--shard-ranks", "2", "--bucket-bytes", "2048", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = file_layout(load_proto(tmp_path / "z3.onnx"))
    assert plan is not None and plan["level"] == "parameters" and len(plan["groups"]) >= 2
    shown = run_cli("inspect", "z3.onnx", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"shards (shard=parameters on 2 ranks): {len(plan['groups'])} bucket(s)" \
        in shown.stdout and "    rank 1: " in shown.stdout, shown.stdout
    ranks(2, SCRIPT, timeout=260)
    compiled = same_on_every_rank(tmp_path, 2, "compiled")
    rewritten = same_on_every_rank(tmp_path, 2, "rewritten")
    again = same_on_every_rank(tmp_path, 2, "again")
    assert sorted(rewritten) == sorted(compiled)
    for k, v in compiled.items():
        assert rewritten[k].tobytes() == v.tobytes(), k
        assert again[k].tobytes() == v.tobytes(), k
    assert file_layout(load_proto(tmp_path / "again.onnx")) == plan


def test_a_rewritten_file_refuses_another_rank_count_or_level(tmp_path):
    from ngdist.passes.pipeline import rewrite
    model = ngdist.to_training_model(zoo.mlp((64, 32, 10), seed=0), labels="y",
                                     loss="softmax_cross_entropy",
                                     optimizer=ngdist.optim.SGD(lr=0.1))
    onnx.save(rewrite(model, "allreduce", shard="gradients", shard_ranks=2),
              tmp_path / "z2.onnx")
    with pytest.raises(OptionError, match=r"^the file is sharded for 2 ranks \(ngdist rewrite "
                                          r"--shard-ranks\) but this job has 1; run it on 2 "
                                          r"ranks or rewrite it with --shard-ranks 1$"):
        ngdist.compile(str(tmp_path / "z2.onnx"))
    with pytest.raises(OptionError, match=r"^the file is sharded \(shard='gradients' for 2 "
                                          r"ranks by ngdist rewrite\); leave shard= out, or "
                                          r"rewrite the training model with --shard "
                                          r"parameters$"):
        ngdist.compile(str(tmp_path / "z2.onnx"), shard="parameters")
