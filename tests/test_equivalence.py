"""N ranks with batch B each == one process with the concatenated batch N*B."""
from __future__ import annotations

import numpy as np
import pytest

import ngdist
from ngdist import zoo
from ngdist.data import load_digits

STEPS, B = 20, 16

SCRIPT = """
import sys, numpy as np, ngdist
from ngdist import zoo
from ngdist.data import load_digits
opt = {"sgd": ngdist.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
       "adam": ngdist.optim.Adam(lr=1e-3, weight_decay=1e-4)}[sys.argv[1]]
B, STEPS = int(sys.argv[2]), int(sys.argv[3])
x, y, _, _ = load_digits()
# rank 0's initial weights win: other ranks start from a different seed on purpose
tr = ngdist.compile(zoo.mlp((64, 32, 10), seed=ngdist.rank()), optimizer=opt, bucket_bytes=4096)
N = tr.size
for s in range(STEPS):
    gx, gy = x[s * N * B:(s + 1) * N * B], y[s * N * B:(s + 1) * N * B]
    (bx, by), = tr.shard([(gx, gy)])
    tr.step({"x": bx, "y": by})
np.savez(f"params_{tr.rank}.npz", **tr.state_dict())
"""


def single_process(opt_name: str, n: int) -> dict[str, np.ndarray]:
    opt = {"sgd": ngdist.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
           "adam": ngdist.optim.Adam(lr=1e-3, weight_decay=1e-4)}[opt_name]
    x, y, _, _ = load_digits()
    tr = ngdist.compile(zoo.mlp((64, 32, 10), seed=0), optimizer=opt, bucket_bytes=4096)
    assert tr.size == 1
    for s in range(STEPS):
        tr.step({"x": x[s * n * B:(s + 1) * n * B], "y": y[s * n * B:(s + 1) * n * B]})
    return tr.state_dict()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_ranks_match_single_process(ranks, tmp_path, n, opt_name):
    ranks(n, SCRIPT, args=[opt_name, str(B), str(STEPS)], timeout=180)
    per_rank = [dict(np.load(tmp_path / f"params_{r}.npz")) for r in range(n)]
    for r in range(1, n):  # bit-for-bit identical on every rank
        for name, value in per_rank[0].items():
            assert np.array_equal(value, per_rank[r][name]), (name, r)
    reference = single_process(opt_name, n)
    assert set(reference) == set(per_rank[0])
    assert int(per_rank[0]["ngdist.step"]) == STEPS
    for name, ref in reference.items():
        if name.startswith("ngdist."):
            continue
        got = per_rank[0][name]
        rel = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-12)
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
        # and training really moved the parameters (a test that cannot fail is a defect)
    moved = single_process(opt_name, n)["fc0.weight"] - zoo_initial()
    assert np.abs(moved).max() > 1e-3


def zoo_initial() -> np.ndarray:
    from onnx import numpy_helper
    model = zoo.mlp((64, 32, 10), seed=0)
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "fc0.weight")


def test_cpu_arena_switch_changes_memory_strategy_not_results(monkeypatch):
    """NGDIST_CPU_ARENA=0 turns onnxruntime's CPU arena off in every training session (less
    peak memory, slower: docs/benchmarks.md); the trained parameters are the same bits."""
    x, y, _, _ = load_digits(images=True)
    params = {}
    for arena in ("1", "0"):
        monkeypatch.setenv("NGDIST_CPU_ARENA", arena)
        tr = ngdist.compile(zoo.cnn(channels=(4, 4)), optimizer=ngdist.optim.SGD(lr=0.1,
                            momentum=0.9), strategy="local")
        for i in range(3):
            tr.step({"x": x[32 * i:32 * (i + 1)], "y": y[32 * i:32 * (i + 1)]})
        sessions = list(tr.executor.sessions.values())
        assert sessions and all(s.get_session_options().enable_cpu_mem_arena == (arena == "1")
                                for s in sessions)
        params[arena] = tr.parameters()
    assert all(np.array_equal(params["1"][k], params["0"][k]) for k in params["1"])
