"""Every way a rank's program can end, under ``ngdist run`` on 2 ranks, before
``ngdist.compile`` (the others are in its start-up collectives) and mid-training (the others
are in a step): the job ends within 10 s of it, and the launcher's table names the rank, its
real exit status and its message (comm/exits.py, comm/mpi.py's exit path, the supervisor).
On 4 ranks (three peers to stop) one ending of each kind at both points: an exit with status
0 (the peers name the rank), a Python exception (the abort hook), a death by a signal.

One ``ngdist run`` per case; the last rank ends, the others go on until they notice. The
ending rank writes the time it ends to a file first, so the bound is measured from the ending
itself, not from the start-up of the job. Where the ending rank fails (a status other than 0)
its peers are stopped by the launcher after ``--grace`` seconds, and their rows are not what
the case checks: those cases run with ``--grace 1`` instead of the default 3 s (the grace
period itself is tested in test_supervisor.py); a status-0 end keeps the default, since there
the peers must notice it and name the rank themselves.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1"}

BOUND_S = 10.0  # from the ending to the launcher's exit
GRACE = ("--grace", "1")  # where the peers are stopped by the launcher (see above)
LIMIT_S = 120   # a whole case, start-up included (a hang fails here, never blocks)

ENDS = """
import os, signal, sys, time
how, when = sys.argv[1], sys.argv[2]
import ngdist
rank, size = ngdist.rank(), ngdist.size()


def end():
    with open("ended", "w") as fh:
        fh.write(repr(time.time()))
    if how == "return":
        return True
    if how == "exit0":
        sys.exit(0)
    if how == "exit3":
        sys.exit(3)
    if how == "message":
        raise SystemExit(f"rank {rank} cannot find its data")
    if how == "raise":
        raise ValueError(f"rank {rank}: bad batch")
    if how == "signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "os_exit":
        os._exit(4)
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    if when == "before_compile" and rank == size - 1 and end():
        return
    import numpy as np
    from ngdist.zoo import mlp
    trainer = ngdist.compile(mlp((8, 4, 3)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=60)
    x, y = np.ones((4, 8), np.float32), np.arange(4) % 3
    for i in range(100000):
        if when == "mid_training" and rank == size - 1 and i == 3 and end():
            return
        trainer.step({"x": x, "y": y})


main()
"""

# how -> (launcher's exit status, the ending rank's row: status, first error line; None: the
# rank is killed with the job and a peer's row names it)
EXPECTED = {
    "return": (1, None),
    "exit0": (1, None),
    "exit3": (3, ("exit 3", "ngdist: error on rank {r}: SystemExit(3) (exit status 3)")),
    "message": (1, ("exit 1", "ngdist: error on rank {r}: SystemExit: rank {r} cannot find its "
                              "data (exit status 1)")),
    "raise": (1, ("{raised}", "ValueError: rank {r}: bad batch")),
    # the fault handler ranks run with prints the faulting Python stack first
    "signal": (139, ("Segmentation fault (signal 11)", "Fatal Python error: Segmentation fault")),
    "os_exit": (4, ("exit 4", "-")),
    "killed": (137, ("Killed (signal 9)", "-")),
}


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(text))
    return path


def cleanup(path: Path) -> None:
    """SIGKILL what is left of a job that did not end (its processes name ``path``)."""
    found = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout
    for pid in found.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def run_case(tmp_path: Path, n: int, how: str, when: str,
             options: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    path = script(tmp_path, ENDS)
    cmd = [sys.executable, "-m", "ngdist", "run", "-n", str(n), *options, "--",
           sys.executable, str(path), how, when]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        cleanup(path)
        pytest.fail(f"ngdist run did not end within {LIMIT_S} s:\n{exc.stderr!r}")
    if not (tmp_path / "ended").exists():
        pytest.fail(f"the job ended before the rank did (status {proc.returncode}):\n"
                    f"{proc.stdout}\n{proc.stderr}")
    ended = float((tmp_path / "ended").read_text())
    return proc, time.time() - ended


def table(stderr: str) -> dict[int, tuple[str, str]]:
    """rank -> (status, first error line) from the launcher's table."""
    rows = {}
    for line in stderr[stderr.index("  rank  status"):].splitlines()[1:]:
        match = re.match(r"\s+(\d+)  (.+?)  +(.+)$", line)
        if match:
            rows[int(match.group(1))] = (match.group(2).strip(), match.group(3))
    return rows


WHENS = ("before_compile", "mid_training")
CASES = [(how, when, 2) for how in EXPECTED for when in WHENS] + \
    [(how, when, 4) for how in ("exit0", "raise", "killed") for when in WHENS]


@pytest.mark.parametrize("how, when, n", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_ending_ends_the_job_within_seconds_with_the_ranks_status(tmp_path, how, when, n):
    status, row = EXPECTED[how]
    proc, after = run_case(tmp_path, n, how, when, () if row is None else GRACE)
    r = n - 1
    assert proc.returncode == status, proc.stderr
    assert after < BOUND_S, (after, proc.stderr)
    rows = table(proc.stderr)
    assert sorted(rows) == list(range(n)), proc.stderr
    if row is None:  # a status-0 end: the peers that waited for it name it and why
        messages = [m for rank, (st, m) in rows.items() if st == "MPI_Abort(1)"]
        assert messages, proc.stderr
        steps = "ran out of data after 3 step(s): it ended its program (exit status 0)" \
            if when == "mid_training" else \
            "ended its program (exit status 0: it returned or called sys.exit(0))"
        assert any(re.search(rf"CommError: rank {r} \(pid \d+\) {re.escape(steps)}", m)
                   for m in messages), proc.stderr
        return
    # an exception after compile aborts the MPI job (the abort hook); before, MPI is
    # started but no world group is made yet, and the rank exits with Python's status 1
    raised = "MPI_Abort(1)" if when == "mid_training" else "exit 1"
    expected = (row[0].format(raised=raised), row[1].format(r=r))
    assert rows[r] == expected, proc.stderr
    head = re.search(r"^ngdist: rank \d+ failed .*$", proc.stderr, re.M)
    assert head and head.group().startswith(f"ngdist: rank {r} failed ({expected[0]})"), \
        proc.stderr


def test_a_rank_that_exits_0_without_starting_mpi_fails_the_job(tmp_path):
    """MPI's own start-up has no time limit: the supervisor ends the job (a marker says which
    ranks started MPI through ngdist)."""
    path = script(tmp_path, """
        import os, sys, time
        if os.environ["PMI_RANK"] == "1":
            open("ended", "w").write(repr(time.time()))
            sys.exit(0)
        import ngdist
        ngdist.barrier(timeout=60)
        """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ngdist", "run", "-n", "2", "--",
                           sys.executable, str(path)], capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=LIMIT_S)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - t0 < 30, proc.stderr
    rows = table(proc.stderr)
    assert rows[1] == ("exit 0 without starting MPI", "-"), proc.stderr
    assert "ngdist: rank 1 failed (exit 0 without starting MPI); stopped the other 1 rank" \
        in proc.stderr


@pytest.mark.parametrize("how", ["exit3", "exit0"])
def test_max_restarts_relaunches_promptly_after_an_ending(tmp_path, how):
    """The failed attempt ends within seconds of the ending, and the next one starts."""
    options = ("--max-restarts", "1", *(() if EXPECTED[how][1] is None else GRACE))
    proc, after = run_case(tmp_path, 2, how, "mid_training", options)
    assert proc.returncode in (1, 3), proc.stderr
    assert after < BOUND_S, (after, proc.stderr)
    assert proc.stderr.count("ngdist: attempt 1 of 2 failed") == 1, proc.stderr
    assert "(attempt 2 of 2)" in proc.stderr, proc.stderr


def test_a_systemexit_message_before_mpi_starts_is_the_ranks_line_in_the_table(tmp_path):
    """No ngdist exit path runs (MPI never started): the table shows the rank's last line
    on stderr, which is where Python prints a SystemExit's text."""
    path = script(tmp_path, """
        import os, sys, time
        import ngdist
        if os.environ["PMI_RANK"] == "1":
            open("ended", "w").write(repr(time.time()))
            raise SystemExit("rank 1 cannot find its data")
        ngdist.barrier(timeout=60)
        """)
    proc = subprocess.run([sys.executable, "-m", "ngdist", "run", "-n", "2", "--",
                           sys.executable, str(path)], capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=LIMIT_S)
    assert time.time() - float((tmp_path / "ended").read_text()) < BOUND_S, proc.stderr
    assert proc.returncode == 1, proc.stderr
    assert table(proc.stderr)[1] == ("exit 1", "rank 1 cannot find its data"), proc.stderr
