"""The timeline (NGDIST_TIMELINE / timeline=): one Chrome trace-event JSON for the whole job.

Oracles: the step statistics each rank reports (``StepStats.bytes_sent``), the byte count of
the gradients (4 bytes per parameter, each reduced once per step), the node names of the step
graph, the collective nature of an AllReduce (rank 0's and rank 1's spans of one bucket must
overlap in time when both share one clock), and the exact error messages.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import InputError
from ngdist.runtime import timeline as timeline_module

SIZES = (64, 32, 16, 10)
STEPS = 3
CLOCK_SLACK_US = 2000  # the clock offset's error (half a round trip), generously

SCRIPT = r"""
import json, sys
import numpy as np, onnx_ir as ir
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp(%(sizes)r, seed=0), optimizer=ngdist.optim.SGD(lr=0.05, momentum=0.9),
                    bucket_bytes=2000, overlap=True, intra_op_threads=1, timeline="trace.json")
B = 32
batches = ({"x": x[i * B:(i + 1) * B], "y": y[i * B:(i + 1) * B]} for i in range(%(steps)d))
stats = [tr.step(b).bytes_sent for b in tr.shard(batches)]
graph = ir.to_proto(tr.step_model).graph
json.dump({"bytes_sent": stats, "nodes": [n.name for n in graph.node],
           "comm_nodes": [n.name for n in graph.node if n.domain == "ngdist"]},
          open(f"report_{ngdist.rank()}.json", "w"))
tr.close()
"""


def _spans(trace: dict, pid: int, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"]
            if e["ph"] == "X" and e["pid"] == pid and e["cat"] == cat]


def _within(inner: dict, outer: dict) -> bool:
    return outer["ts"] <= inner["ts"] and \
        inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def _thread_ids(trace: dict, pid: int) -> dict[str, int]:
    return {e["args"]["name"]: e["tid"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


@pytest.mark.mpi
def test_two_ranks_write_one_trace_whose_comm_bytes_add_up_to_the_step_stats(ranks, tmp_path):
    ranks(2, SCRIPT % {"sizes": SIZES, "steps": STEPS}, timeout=180)
    assert not list(tmp_path.glob(".trace.json*")), "no temporary file is left behind"
    trace = json.loads((tmp_path / "trace.json").read_text())
    params = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert trace["otherData"]["ranks"] == 2
    comm_by_rank = {}
    for pid in (0, 1):
        report = json.loads((tmp_path / f"report_{pid}.json").read_text())
        # every gradient float is reduced once per step: MPI sends each bucket once
        assert report["bytes_sent"] == [4 * params] * STEPS
        tids = _thread_ids(trace, pid)
        assert {"main", "comm"} <= set(tids) and tids["main"] != tids["comm"]
        steps = _spans(trace, pid, "step")
        assert [s["name"] for s in steps] == [f"step {k}" for k in range(1, STEPS + 1)]
        assert all(s["tid"] == tids["main"] for s in steps)
        assert [s["args"]["bytes_sent"] for s in steps] == report["bytes_sent"]
        compute, comm = _spans(trace, pid, "compute"), _spans(trace, pid, "comm")
        waits = [e for e in _spans(trace, pid, "wait") if e["name"] == "wait for comm"]
        feeds = _spans(trace, pid, "feed")
        assert {f["name"] for f in feeds} == {"shard batch", "feed batch"}
        for c in compute:  # named by the first and last node of its segment
            first, last = c["name"].split(" .. ")
            assert first in report["nodes"] and last in report["nodes"], c
            assert c["tid"] == tids["main"]
        assert all(c["tid"] == tids["comm"] for c in comm)  # overlap: comm on its own thread
        assert {c["name"] for c in comm} == set(report["comm_nodes"])
        for c in comm:
            assert c["args"]["op"] == "AllReduce" and c["args"]["group_size"] == 2, c
            assert c["args"]["algorithm"] == "mpi" and c["args"]["values"], c
            # a gradient bucket made for it alone, dead after the update: shared memory
            assert c["args"]["implementation"] == "shared-memory", c
        for k, step in enumerate(steps):
            mine = [c for c in comm if _within(c, step)]
            assert len(mine) == len(report["comm_nodes"])
            assert sum(c["args"]["bytes"] for c in mine) == report["bytes_sent"][k]
            assert sum(1 for c in compute if _within(c, step)) >= 2  # cut at the comm nodes
            assert any(_within(w, step) for w in waits)
        assert len(comm) == STEPS * len(report["comm_nodes"])  # none outside the steps
        for w in _spans(trace, pid, "wait"):  # Work.wait on the comm thread: inside its op
            if w["tid"] == tids["comm"]:
                node = w["name"].split("'")[1]
                assert any(c["name"] == node and _within(w, c) for c in comm), w
        comm_by_rank[pid] = comm
    # one time base: the two ranks' spans of one collective overlap
    for a, b in zip(comm_by_rank[0], comm_by_rank[1]):
        assert a["name"] == b["name"]
        assert a["ts"] <= b["ts"] + b["dur"] + CLOCK_SLACK_US, (a, b)
        assert b["ts"] <= a["ts"] + a["dur"] + CLOCK_SLACK_US, (a, b)


PS_SCRIPT = r"""
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp((64, 16, 10), seed=0), strategy="ps", servers=1,
                    intra_op_threads=1, timeline="trace.json", optimizer="sgd:lr=0.01")
batches = ({"x": x[i * 32:(i + 1) * 32], "y": y[i * 32:(i + 1) * 32]} for i in range(3))
for b in tr.shard(batches):  # nothing on the server rank, which served in compile()
    tr.step(b)
tr.close()
"""


@pytest.mark.mpi
def test_a_dedicated_parameter_server_rank_is_in_the_trace(ranks, tmp_path):
    # the timeline starts before the server rank serves: no rank waits for the other
    ranks(3, PS_SCRIPT, timeout=180, env={"NGDIST_TIMEOUT": "60"})
    trace = json.loads((tmp_path / "trace.json").read_text())
    for pid in (0, 1):
        assert [s["name"] for s in _spans(trace, pid, "step")] == ["step 1", "step 2", "step 3"]
        assert _spans(trace, pid, "comm")
    assert _spans(trace, 2, "step") == [] and _spans(trace, 2, "wait")  # it served


def _digits_trainer(**kw):
    return ngdist.compile(zoo.mlp((64, 16, 10), seed=0), optimizer="sgd:lr=0.01", **kw)


def _feed(step: int, batch: int = 16) -> dict[str, np.ndarray]:
    x, y, _, _ = load_digits()
    return {"x": x[step * batch:(step + 1) * batch], "y": y[step * batch:(step + 1) * batch]}


def test_off_by_default_records_nothing_and_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(timeline_module.ENV, raising=False)
    made = []
    monkeypatch.setattr(timeline_module.Timeline, "__init__",
                        lambda self, *a, **k: made.append(a))
    monkeypatch.setattr(timeline_module.Timeline, "record",
                        lambda self, *a, **k: made.append(a))
    tr = _digits_trainer()
    for s in range(2):
        tr.step(_feed(s))
    assert tr.write_timeline() is None
    tr.close()
    assert made == []
    assert tr.timeline is None and tr.executor.timeline is None and tr.group.timeline is None
    assert list(tmp_path.iterdir()) == []


def test_environment_turns_it_on_and_every_write_holds_all_steps_so_far(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    monkeypatch.setenv(timeline_module.ENV, str(path))
    tr = _digits_trainer()
    for s in range(2):
        tr.step(_feed(s), fetch_stats=s == 0)
    assert tr.write_timeline() == path
    first = json.loads(path.read_text())
    tr.step(_feed(2))
    tr.close()
    final = json.loads(path.read_text())
    assert [s["name"] for s in _spans(first, 0, "step")] == ["step 1", "step 2"]
    steps = _spans(final, 0, "step")
    assert [s["name"] for s in steps] == ["step 1", "step 2", "step 3"]
    assert "loss" in steps[0]["args"] and "loss" not in steps[1]["args"]  # fetch_stats=False
    # one segment on one rank (comm ops are identities there), named by its end nodes
    graph = ir.to_proto(tr.step_model).graph
    assert {c["name"] for c in _spans(final, 0, "compute")} == \
        {f"{graph.node[0].name} .. {graph.node[-1].name}"}
    assert _spans(final, 0, "comm") == []
    # timeline=False wins over the environment
    path.unlink()
    off = _digits_trainer(timeline=False)
    off.step(_feed(0))
    off.close()
    assert off.timeline is None and not path.exists()


def test_a_path_in_a_missing_directory_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline_module.ENV, raising=False)
    bad = tmp_path / "no-such-dir" / "trace.json"
    with pytest.raises(InputError) as err:
        _digits_trainer(timeline=bad)
    assert str(err.value) == (f"timeline {bad}: the directory {bad.parent} does not exist; "
                              "create it first or choose another path for the timeline")
    with pytest.raises(InputError) as err:
        _digits_trainer(timeline=tmp_path)
    assert str(err.value) == (f"timeline {tmp_path} is a directory; give a file name, e.g. "
                              f"{tmp_path / 'trace.json'}")
    assert list(tmp_path.iterdir()) == []


def test_unknown_type_is_an_option_error():
    with pytest.raises(ngdist.errors.OptionError, match="option 'timeline' of ngdist.compile"):
        _digits_trainer(timeline=3)


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert timeline_module.timeline_path("t.json") == Path(tmp_path, "t.json")
    monkeypatch.delenv(timeline_module.ENV, raising=False)
    assert timeline_module.timeline_path(None) is None
