"""The end of a job under the real mpiexec on 2 ranks: MPI_Finalize is bounded.

mpi4py's own MPI_Finalize at interpreter exit waits for every rank with no limit, so a rank
frozen after its last collective (saving, predicting, exiting) would leave the others blocked
for ever. ngdist finalizes with a non-blocking barrier polled against the job's timeout and
the dead-peer check first; these tests train a few real steps, then freeze or delay a rank.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = pytest.mark.mpi

SCRIPT = r"""
import os, signal, sys, time
import numpy as np
import ngdist
from ngdist.data import load_digits
from ngdist.zoo import mlp

scenario = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
x, y = load_digits()[:2]
trainer = ngdist.compile(mlp((64, 16, 10)), loss="softmax_cross_entropy", labels="y",
                         optimizer=ngdist.optim.SGD(lr=0.1), timeout=timeout)
for i in range(3):
    trainer.step({"x": x[32 * i:32 * (i + 1)], "y": y[32 * i:32 * (i + 1)]})
rank = ngdist.rank()
with open(f"pid{rank}", "w") as fh:
    fh.write(str(os.getpid()))
if rank == ngdist.size() - 1:
    if scenario == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen after its last collective
    elif scenario == "slow":
        time.sleep(3)  # a slow save, shorter than the timeout
with open(f"done{rank}", "w") as fh:
    fh.write("ok")
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_rank_frozen_after_its_last_step_ends_the_job_within_the_timeout(ranks, tmp_path):
    start = time.monotonic()
    proc = ranks(2, SCRIPT, args=["freeze"], timeout=90, check=False,
                 env={"NGDIST_TIMEOUT": "5"})
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    pid1 = int((tmp_path / "pid1").read_text())
    try:
        assert proc.returncode != 0, out
        assert ("ngdist: error on rank 0 at exit: 'the end of the job (every rank reaching "
                "MPI_Finalize)' did not complete within 5 s on rank 0 (waiting for ranks 0..1)"
                ) in out, out
        assert "rank 0 aborts the MPI job" in out
        assert (tmp_path / "done0").exists() and not (tmp_path / "done1").exists()
        assert elapsed < 5 + 40, elapsed  # start-up and 3 steps, then the 5 s bound
        deadline = time.monotonic() + 10
        while not _gone(pid1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(pid1), "the frozen rank outlived the job"
    finally:
        if not _gone(pid1):
            os.kill(pid1, signal.SIGKILL)


def test_rank_slower_to_exit_than_the_others_but_within_the_timeout_ends_cleanly(ranks, tmp_path):
    proc = ranks(2, SCRIPT, args=["slow"], timeout=90, env={"NGDIST_TIMEOUT": "30"})
    assert proc.returncode == 0
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    assert "error" not in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_the_end_of_the_job_is_bounded_by_the_timeout_given_to_compile(ranks, tmp_path, n):
    """No NGDIST_TIMEOUT: compile(timeout=6) bounds the end of the job too (the largest
    timeout the job's groups were given), on 2 and 3 ranks."""
    proc = ranks(n, SCRIPT, args=["freeze", "6"], timeout=120, check=False,
                 env={"NGDIST_TIMEOUT": ""})  # (empty: the default, 300 s)
    out = proc.stdout + proc.stderr
    frozen = int((tmp_path / f"pid{n - 1}").read_text())
    try:
        ended = [r for r in range(n - 1) if (tmp_path / f"done{r}").exists()]
        assert ended == list(range(n - 1)), out
        done_at = min((tmp_path / f"done{r}").stat().st_mtime for r in ended)
        assert proc.returncode != 0, out
        assert (f"at exit: 'the end of the job (every rank reaching MPI_Finalize)' did not "
                f"complete within 6 s") in out, out
        assert time.time() - done_at < 6 + 20, out  # the 6 s bound, then the abort
        deadline = time.monotonic() + 10
        while not _gone(frozen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(frozen), "the frozen rank outlived the job"
    finally:
        if not _gone(frozen):
            os.kill(frozen, signal.SIGKILL)
