"""Work.wait() under the real mpiexec on 2 ranks: the deadline and the dead-peer check.

``NGDIST_WAIT=poll`` raises in the waiting thread (rank 0 writes what it caught to
``caught.json`` and leaves with os._exit, since an MPI request stays pending); the default
watchdog prints the error and aborts the job, so those tests read the job's output and exit
status. Rank 1 writes its process id to ``pid1`` before it leaves.
"""
from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.mpi

SCRIPT = r"""
import json, os, sys, time
import numpy as np
from ngdist.comm.mpi import MpiGroup

scenario, kind = sys.argv[1], sys.argv[2]
world = MpiGroup(timeout=float(sys.argv[3]))
rank = world.rank
if kind == "world":
    group = world
elif kind == "dup":
    group = world.dup("dup for the test")
else:  # a split whose order is the reverse of the world's: group rank != job-wide rank
    group = world.split(0, world.size - rank, "reversed split")

if rank == 1:
    with open("pid1", "w") as fh:
        fh.write(str(os.getpid()))
    if scenario == "late":  # past rank 0's deadline: until rank 0 has its result (<= 30 s)
        end = time.monotonic() + 30
        while not os.path.exists("caught.json") and time.monotonic() < end:
            time.sleep(0.05)
    elif scenario == "absent":
        time.sleep(60)
    os._exit(0)  # leaves without finalizing MPI, status 0

with open("wait_start", "w") as fh:
    fh.write(repr(time.time()))
start = time.monotonic()
try:
    if scenario == "split_after_exit":
        group.split(0, 0, "split after rank 1 left")
    else:
        group.allreduce(np.ones(4, np.float32), "grad-sum").wait()
    caught = None
except Exception as exc:
    caught = {"type": type(exc).__name__, "message": str(exc)}
with open("caught.json", "w") as fh:
    json.dump({"caught": caught, "elapsed": time.monotonic() - start, "group_rank": group.rank},
              fh)
os._exit(0)
"""

HINT = ("; a rank has probably died or is running a different program. Check the other ranks' "
        "output; raise the limit with timeout= or NGDIST_TIMEOUT")


def _launch(ranks, tmp_path, scenario: str, kind: str, timeout: float, mode: str,
            limit: float = 60):
    start = time.time()
    proc = ranks(2, SCRIPT, args=[scenario, kind, str(timeout)], timeout=limit, check=False,
                 env={"NGDIST_WAIT": mode})
    end = time.time()
    out = proc.stdout + proc.stderr
    seen = f"exit status {proc.returncode}, output:\n{out[-3000:]}"
    wait_start = float((tmp_path / "wait_start").read_text())
    caught = tmp_path / "caught.json"
    result = json.loads(caught.read_text()) if caught.exists() else None
    pid1 = int((tmp_path / "pid1").read_text())
    return proc, out, seen, end - wait_start, result, pid1


def test_poll_timeout_raises_in_thread_naming_the_op_and_rank(ranks, tmp_path):
    _, _, seen, _, result, _ = _launch(ranks, tmp_path, "late", "world", 2, "poll")
    assert result is not None, seen
    assert result["caught"] == {
        "type": "CommTimeoutError",
        "message": "'grad-sum' did not complete within 2 s on rank 0 (waiting for ranks 0..1)"
                   + HINT}, seen
    assert 2 <= result["elapsed"] < 5, result


def test_watchdog_timeout_aborts_the_job(ranks, tmp_path):
    proc, out, seen, after_wait, result, _ = _launch(ranks, tmp_path, "absent", "world", 2,
                                                     "watchdog")
    assert proc.returncode != 0, seen
    assert result is None, seen  # the wait never returned on rank 0: the job was aborted
    assert ("ngdist: error on rank 0: CommTimeoutError: 'grad-sum' did not complete within "
            "2 s on rank 0 (waiting for ranks 0..1)" + HINT) in out, seen
    assert "ngdist: rank 0 aborts the MPI job" in out, seen
    assert after_wait < 2 + 8, seen  # the timeout, the output drain, the launcher's teardown


@pytest.mark.parametrize("mode", ["watchdog", "poll"])
@pytest.mark.parametrize("kind", ["world", "dup", "split"])
def test_dead_peer_fails_the_wait_long_before_the_timeout(ranks, tmp_path, kind, mode):
    proc, out, seen, after_wait, result, pid1 = _launch(ranks, tmp_path, "exit", kind, 60, mode)
    message = (f"'grad-sum' cannot complete on rank 0: the process of rank 1 (pid {pid1}) has "
               "exited. Look at that rank's output for why it stopped")
    if mode == "poll":
        assert result is not None, seen
        assert result["caught"] == {"type": "CommError", "message": message}, seen
        assert result["elapsed"] < 10, result
        if kind == "split":
            assert result["group_rank"] == 1  # the message named the job-wide rank, not this
    else:
        assert proc.returncode != 0, seen
        assert result is None, seen
        assert f"ngdist: error on rank 0: CommError: {message}" in out, seen
        assert after_wait < 15, seen


def test_timeout_in_a_split_group_names_the_job_wide_rank(ranks, tmp_path):
    """Rank 0 of the job is rank 1 of the reversed split; its timeout message must say
    rank 0, as the dead-peer message and the abort line do."""
    _, _, seen, _, result, _ = _launch(ranks, tmp_path, "late", "split", 2, "poll")
    assert result is not None and result["group_rank"] == 1, seen
    assert result["caught"]["type"] == "CommTimeoutError", seen
    assert result["caught"]["message"].startswith(
        "'grad-sum' did not complete within 2 s on rank 0 ("), result["caught"]


def test_split_after_a_peer_exited_is_bounded(ranks, tmp_path):
    """split() is collective like dup(); a peer that has gone must fail it (by the timeout or
    the dead-peer check), not leave rank 0 blocked for ever."""
    _, _, seen, _, result, _ = _launch(ranks, tmp_path, "split_after_exit", "world", 3, "poll",
                                       limit=30)
    assert result is not None, seen
    assert result["caught"] is not None and result["caught"]["type"] in (
        "CommError", "CommTimeoutError"), result
    assert "'split after rank 1 left'" in result["caught"]["message"], result
    assert result["elapsed"] < 3 + 5, result
