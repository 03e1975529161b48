"""Uneven inputs: ``with trainer.join():`` on 2 real MPI ranks with 10 and 7 batches ends with
the parameters of one process (torch, float64) that takes 7 steps on both ranks' i-th batches
together, then 3 steps on rank 0's last 3 batches alone; without ``join`` the job fails
within seconds naming the rank that ran out of data and after how many steps."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SIZES = (6, 5, 3)
BATCHES = (10, 7)  # rank 0, rank 1
BATCH = 4
LR = 0.1

SCRIPT = r"""
import sys, time
import numpy as np
import ngdist
from ngdist.zoo import mlp

mode = sys.argv[1]
rank = ngdist.rank()
rng = np.random.default_rng(0)
data = [[(rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4))
         for _ in range(n)] for n in (10, 7)]
trainer = ngdist.compile(mlp((6, 5, 3), seed=0), optimizer=ngdist.optim.SGD(lr=0.1),
                         timeout=60)
if mode == "join":
    with trainer.join():
        for x, y in data[rank]:
            trainer.step({"x": x, "y": y})
    np.savez(f"params{rank}.npz", **trainer.parameters())
    print(f"rank {rank} steps {trainer.steps_done}", flush=True)
else:
    for x, y in data[rank]:
        trainer.step({"x": x, "y": y})
    with open(f"ended{rank}", "w") as fh:
        fh.write(repr(time.time()))
    if mode == "evaluate":  # a collective outside any step: the others still step
        trainer.evaluate({"x": data[rank][0][0], "y": data[rank][0][1]})
"""


def torch_oracle(alone: float = 1.0) -> dict[str, np.ndarray]:
    """One process, float64: 7 steps on both ranks' i-th batches, then rank 0's last 3
    (their gradients times ``alone``: 0.5 is a mean over both ranks with a zero for rank 1)."""
    torch = pytest.importorskip("torch")
    import onnx.numpy_helper as nh

    from ngdist.zoo import mlp

    rng = np.random.default_rng(0)
    data = [[(rng.standard_normal((BATCH, 6)).astype(np.float32), rng.integers(0, 3, BATCH))
             for _ in range(n)] for n in BATCHES]
    params = {t.name: torch.tensor(nh.to_array(t), dtype=torch.float64, requires_grad=True)
              for t in mlp(SIZES, seed=0).graph.initializer}

    def step(x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> None:
        h = torch.relu(torch.tensor(x, dtype=torch.float64) @ params["fc0.weight"].T
                       + params["fc0.bias"])
        logits = h @ params["fc1.weight"].T + params["fc1.bias"]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y))
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= LR * scale * g

    for i in range(BATCHES[1]):
        step(np.concatenate([data[0][i][0], data[1][i][0]]),
             np.concatenate([data[0][i][1], data[1][i][1]]))
    for i in range(BATCHES[1], BATCHES[0]):
        step(*data[0][i], scale=alone)
    return {k: v.detach().numpy() for k, v in params.items()}


@pytest.mark.mpi
def test_join_trains_on_the_union_of_uneven_data(ranks, tmp_path):
    proc = ranks(2, SCRIPT, args=["join"], timeout=120)
    assert sorted(re.findall(r"rank \d steps \d+", proc.stdout)) == ["rank 0 steps 10",
                                                                   "rank 1 steps 10"], proc.stdout
    got = [dict(np.load(tmp_path / f"params{r}.npz")) for r in range(2)]
    assert sorted(got[0]) == sorted(got[1]) == ["fc0.bias", "fc0.weight", "fc1.bias",
                                                "fc1.weight"]
    for name in got[0]:  # the same bytes on every rank
        assert got[0][name].tobytes() == got[1][name].tobytes(), name
    oracle = torch_oracle()
    for name, value in oracle.items():
        np.testing.assert_allclose(got[0][name], value, rtol=0, atol=1e-6, err_msg=name)
    # a mean over both ranks in the last 3 steps (rank 1 counted with zeros) is far off
    halved = torch_oracle(alone=0.5)
    assert max(np.abs(got[0][n] - halved[n]).max() for n in oracle) > 1e-3


@pytest.mark.mpi
@pytest.mark.parametrize("then", ["plain", "evaluate"])
def test_without_join_a_rank_that_runs_out_fails_the_job_naming_it(tmp_path, then):
    """The rank that runs out ends its program, or goes on to evaluate (a collective outside
    any step): either way the job fails within seconds, not at the 60 s timeout."""
    path = tmp_path / "uneven.py"
    path.write_text(textwrap.dedent(SCRIPT))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "ngdist", "run", "-n", "2", "--",
                           sys.executable, str(path), then], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    after = time.time() - float((tmp_path / "ended1").read_text())
    assert after < 10, (after, proc.stderr)
    assert not (tmp_path / "ended0").exists()
    assert proc.returncode == 1, proc.stderr
    assert "ngdist: rank 0 failed (MPI_Abort(1))" in proc.stderr
    where = {"plain": "it ended its program (exit status 0)",
             "evaluate": "it waits in a collective outside any step"}[then]
    assert ("CommError: rank 1 (pid " in proc.stderr
            and f") ran out of data after 7 step(s): {where} while rank 0 waits for it in step "
                "8 (ngdist.AllReduce" in proc.stderr), proc.stderr
    assert "When the ranks have different numbers of batches, step inside `with " \
           "trainer.join():`" in proc.stderr


REFUSALS = r"""
import ngdist
from ngdist.errors import OptionError
from ngdist.zoo import mlp

cases = {"pushsum": dict(strategy="pushsum"),
         "micro": dict(reproducible_micro_batch=2),
         "fp16": dict(compression="fp16")}
for name, options in cases.items():
    trainer = ngdist.compile(mlp((6, 5, 3)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=60,
                             **options)
    try:
        trainer.join()
    except OptionError as exc:
        print(f"rank {ngdist.rank()} {name}: {exc}", flush=True)
    trainer.close()
"""


@pytest.mark.mpi
def test_join_refuses_what_it_cannot_train_with_the_reason(ranks):
    out = ranks(2, REFUSALS, timeout=180).stdout
    head = "trainer.join() cannot train on uneven inputs here: "
    for rank in (0, 1):
        assert (f"rank {rank} pushsum: {head}the step communicates with ngdist.PushSum "
                "(strategy allreduce only)") in out, out
        assert (f"rank {rank} micro: {head}reproducible_micro_batch sums a fixed number of "
                "micro-batches per rank, which a rank without data cannot give") in out, out
        assert (f"rank {rank} fp16: {head}compressed AllReduce: only plain sums (with error "
                "feedback a rank without data would still send its residual)") in out, out


def test_join_on_one_rank_trains_as_without_it():
    import ngdist
    from ngdist.zoo import mlp

    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4))
               for _ in range(3)]
    a, b = (ngdist.compile(mlp(SIZES, seed=0), optimizer=ngdist.optim.SGD(lr=LR),
                           intra_op_threads=1) for _ in range(2))
    with a.join():
        for x, y in batches:
            a.step({"x": x, "y": y})
    for x, y in batches:
        b.step({"x": x, "y": y})
    pa, pb = a.parameters(), b.parameters()
    assert all(pa[k].tobytes() == pb[k].tobytes() for k in pa)
