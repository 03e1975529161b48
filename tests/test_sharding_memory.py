"""A rank's memory limit (runtime/sessions.py, runtime/segments.py) under real mpiexec:
``NGDIST_CPU_ARENA_MAX_MB`` caps onnxruntime's CPU arena, one arena shared by a process's
sessions; a step that needs more stops every rank with an ``OutOfMemoryError`` naming the
segment, the limit and what to do (not onnxruntime's raw allocator message); under a limit the
step fits, the losses are the same bytes as without one; a malformed limit is refused."""
from __future__ import annotations

import json
import re

import pytest

from ngdist.errors import NgdistError
from ngdist.runtime.sessions import arena_limit_mb

SCRIPT = r"""
import json, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.errors import ExecutionError, OutOfMemoryError

rank = ngdist.rank()
rng = np.random.default_rng(rank)
feed = {"x": rng.random((8, 64)).astype(np.float32), "y": rng.integers(0, 10, 8)}
out = {}
try:
    tr = ngdist.compile(zoo.mlp((64, 512, 512, 10), seed=0), strategy="allreduce",
                        optimizer=ngdist.optim.AdamW(lr=1e-3), intra_op_threads=1, timeout=60,
                        shard=sys.argv[1])
    out["losses"] = np.array([tr.step(feed).loss for _ in range(3)], np.float32).tobytes().hex()
    tr.close()
except OutOfMemoryError as exc:
    out["error"] = str(exc)
    out["is_memory_error"] = isinstance(exc, MemoryError) and isinstance(exc, ExecutionError)
with open(f"out.{rank}.json", "w") as f:
    json.dump(out, f)
"""

MESSAGE = re.compile(
    r"out of memory in segment \d+ \(\d+ nodes, .+\): onnxruntime's CPU arena is limited to "
    r"1 MiB \(NGDIST_CPU_ARENA_MAX_MB\) and the step asked for \d+ bytes more; raise the "
    r"limit, shard the parameters over the ranks \(shard='parameters'\), or use smaller "
    r"batches")


def _run(ranks, tmp_path, n: int, shard: str, limit: str | None) -> list[dict]:
    env = {"NGDIST_CPU_ARENA_MAX_MB": limit} if limit is not None else {}
    ranks(n, SCRIPT, args=[shard], env=env, timeout=100)
    return [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(n)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shard", ["none", "parameters"])
def test_arena_limit_stops_every_rank_with_the_limit_named(ranks, tmp_path, shard):
    got = _run(ranks, tmp_path, 2, shard, "1")
    for out in got:
        assert "losses" not in out
        assert MESSAGE.fullmatch(out["error"]), out["error"]
        assert out["is_memory_error"]


@pytest.mark.timeout(200)
def test_a_limit_the_step_fits_trains_the_same_bytes(ranks, tmp_path):
    limited = _run(ranks, tmp_path, 2, "none", "64")
    free = _run(ranks, tmp_path, 2, "none", None)
    assert [o["losses"] for o in limited] == [o["losses"] for o in free]
    assert all("error" not in o for o in limited)


@pytest.mark.parametrize("text", ["abc", "0", "-5", "1.5"])
def test_a_malformed_limit_is_refused(monkeypatch, text):
    monkeypatch.setenv("NGDIST_CPU_ARENA_MAX_MB", text)
    with pytest.raises(NgdistError) as info:
        arena_limit_mb()
    assert str(info.value) == (f"NGDIST_CPU_ARENA_MAX_MB={text!r}: give a whole number of "
                               "MiB (at least 1), or unset it for an arena without a limit")


def test_no_limit_when_unset(monkeypatch):
    monkeypatch.delenv("NGDIST_CPU_ARENA_MAX_MB", raising=False)
    assert arena_limit_mb() is None


def test_the_step_graph_fingerprint_leaves_the_values_out():
    """Ranks compare their step graphs by these bytes: the structure and the constants, not
    the values of the parameters, optimizer state and hyperparameters (rank 0's are
    broadcast), read field by field from the step proto (no whole copy of it)."""
    import onnx
    import onnx_ir as ir
    from onnx import numpy_helper

    import ngdist
    from ngdist import zoo

    tr = ngdist.compile(zoo.mlp((64, 256, 10), seed=0), strategy="local",
                        optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9))
    proto = ir.to_proto(tr.step_model)
    held = {n for n, role in tr.meta.roles.items() if role != "data"}
    before = tr._graph_fingerprint(proto)
    assert len(before) < 20_000  # the 64 x 256 weight alone is 65 KB
    for t in proto.graph.initializer:
        if t.name in held:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) + 1, t.name))
    assert tr._graph_fingerprint(proto) == before
    proto.graph.node[0].attribute.append(onnx.helper.make_attribute("alpha", 2.0))
    assert tr._graph_fingerprint(proto) != before
    tr.close()
