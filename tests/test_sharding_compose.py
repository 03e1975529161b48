"""shard= composed with clipping and accumulation under real mpiexec on 2 and 4 ranks:
``clip_grad_norm`` takes the global norm over the ranks' gradient slices (an AllReduce of
their sums of squares), ``clip_grad_value`` clamps each slice, ``accumulate=k`` (ZeRO-1/2)
sums whole micro-step gradients and ReduceScatters once per window. After 12 updates of the
digits MLP each equals the unsharded run with the same option within 1e-5 (the norms within
1e-5 relative, clipping acting on most steps), and the ranks hold the same bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest
from sharding_ranks import same_on_every_rank

SCRIPT = r"""
import json
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()
CASES = {"norm": {"clip_grad_norm": 0.2}, "value": {"clip_grad_value": 0.01},
         "acc": {"accumulate": 3}}
LEVELS = {"norm": ("none", "optimizer", "parameters"), "value": ("none", "parameters"),
          "acc": ("none", "gradients")}
out, norms = {}, {}
for case, options in CASES.items():
    for shard in LEVELS[case]:
        t = ngdist.compile(zoo.mlp((64, 32, 16, 10), seed=0), loss="softmax_cross_entropy",
                           labels="y", optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                           shard=shard, timeout=60, bucket_bytes=2048, **options)
        k = options.get("accumulate", 1)
        seen = []
        for i in range(12 * k):
            (mine,) = t.shard([(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])])
            stats = t.step({"x": mine[0], "y": mine[1]})
            if stats.grad_norm is not None:
                seen.append(stats.grad_norm)
        assert t.steps_done == 12, t.steps_done
        norms[f"{case}.{shard}"] = seen
        out.update({f"{case}.{shard}.{n}": v for n, v in t.parameters().items()})
        t.close()
np.savez(f"params{t.rank}.npz", **out)
json.dump(norms, open(f"norms{t.rank}.json", "w"))
"""


@pytest.mark.mpi
@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_clipping_and_accumulation_compose_with_shards(ranks, tmp_path, n):
    ranks(n, SCRIPT, timeout=360)
    params = [same_on_every_rank(tmp_path, n)]
    norms = json.loads((tmp_path / "norms0.json").read_text())
    for key, v in params[0].items():
        case, shard, name = key.split(".", 2)
        if shard != "none":
            np.testing.assert_allclose(v, params[0][f"{case}.none.{name}"], rtol=0, atol=1e-5,
                                       err_msg=key)
    plain = np.array(norms["norm.none"])
    assert len(plain) == 12 and (plain > 0.2).sum() >= 4, plain  # clipping acts
    for shard in ("optimizer", "parameters"):
        np.testing.assert_allclose(norms[f"norm.{shard}"], plain, rtol=1e-5, err_msg=shard)
    assert norms["value.none"] == norms["value.parameters"] == []
    # clipping by value acts too: it moves the parameters away from the unclipped run
    assert not np.allclose(params[0]["value.none.fc0.weight"], params[0]["acc.none.fc0.weight"])
