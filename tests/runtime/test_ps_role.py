"""Each rank's role is an object of its own (runtime/ps_server.py): a plain worker, a ps worker
that stops the dedicated servers when it closes, or a dedicated parameter server that serves
once its trainer is ready, until every worker has stopped."""
from __future__ import annotations

import json

import numpy as np
import pytest

import ngdist
from ngdist import zoo
from ngdist.errors import NgdistError
from ngdist.runtime import ps_server

ROLES = r'''
import json, sys, numpy as np, ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import NgdistError
from ngdist.runtime import ps_server
X, Y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp(seed=0), loss="softmax_cross_entropy",
                    optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9), strategy="ps",
                    servers=1, grad_shard_bytes=4096, timeout=60)
out = {"role": type(tr.rank_role).__name__, "name": tr.role, "workers": tr.num_workers,
       "stopped_when_built": ps_server.runtime(tr).stopped}
W, B = tr.num_workers, 8
for i in range(4):
    g = slice(i * W * B, (i + 1) * W * B)
    for xb, yb in tr.shard([(X[g], Y[g])]):
        tr.step({"x": xb, "y": yb})
if tr.rank == 2:
    try:
        tr.step({"x": X[:B], "y": Y[:B]})
    except NgdistError as exc:
        out["step"] = str(exc)
tr.close()
np.savez(f"final{tr.rank}.npz", **tr.state_dict())
json.dump(out, open(f"role{tr.rank}.json", "w"))
'''


def test_a_dedicated_server_is_a_role_that_serves_until_the_workers_stop(ranks, tmp_path):
    ranks(3, ROLES, timeout=120)
    got = [json.loads((tmp_path / f"role{r}.json").read_text()) for r in range(3)]
    assert [(g["role"], g["name"], g["workers"]) for g in got] == \
        [("PSWorker", "worker", 2), ("PSWorker", "worker", 2),
         ("ParameterServer", "server", 2)]
    # the server's trainer came back from compile only once the workers had stopped
    assert [g["stopped_when_built"] for g in got] == [False, False, True]
    assert "step" not in got[0] and "step" not in got[1]
    assert got[2]["step"] == (
        "rank 2 is a dedicated parameter server: it has served the workers' steps and takes "
        "none itself; iterate over trainer.shard(...) (empty here) or skip step() on server "
        "ranks")
    finals = [np.load(tmp_path / f"final{r}.npz") for r in range(3)]
    params = [k for k in finals[0].files if k.startswith("fc") and not k.endswith(".momentum")]
    assert len(params) >= 4
    for k in params:  # worker 0 sent the server the final parameters when it stopped
        assert finals[2][k].tobytes() == finals[0][k].tobytes() == finals[1][k].tobytes(), k


def test_a_trainer_without_ps_has_the_plain_worker_role():
    tr = ngdist.compile(zoo.mlp((8, 4, 3), seed=0), loss="softmax_cross_entropy",
                        optimizer=ngdist.optim.SGD(lr=0.1), strategy="local")
    assert type(tr.rank_role) is ps_server.Role
    assert (tr.role, tr.num_workers) == ("worker", 1)
    tr.rank_role.refuse_step()  # a worker takes steps: nothing raised
    tr.close()


def test_a_server_role_refuses_steps_with_one_line():
    class Rank:
        rank = 3

    server = ps_server.ParameterServer(Rank(), workers=3, lockstep=True)
    assert (server.name, server.workers) == ("server", 3)
    with pytest.raises(NgdistError, match=r"^rank 3 is a dedicated parameter server: "):
        server.refuse_step()
