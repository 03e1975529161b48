"""``ngdist run`` as a supervisor: signals stop every process of the job, a failed rank stops
the others after the grace period with a table of the ranks, each output line names its rank.

The multi-rank tests start the real command line (``python -m ngdist run``) under the venv's
mpiexec and look for left-over processes with ``pgrep -f`` on the test's own script path.
The parts below them (the output router, the rank wrapper) are tested without mpiexec.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ngdist.comm import rankwrap
from ngdist.comm import rank_output
from ngdist.comm.rank_output import ABORT_LINE, OutputRouter, RankScan

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1"}
LIMIT = 90  # no launcher test may take longer than this (a hang fails, never blocks)


# ----------------------------------------------------------------------------- helpers

def script(tmp_path: Path, text: str, name: str = "rank_script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def alive(path: Path) -> str:
    """The processes whose command line names ``path`` (pgrep -af), '' when none."""
    return subprocess.run(["pgrep", "-af", str(path)], capture_output=True, text=True).stdout


def cleanup(path: Path) -> None:
    for line in alive(path).splitlines():
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def ngdist_run(tmp_path: Path, path: Path, *args: str, n: int = 2, timeout: float = LIMIT,
               options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ngdist", "run", "-n", str(n), *options, "--",
           sys.executable, str(path), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        cleanup(path)
        pytest.fail(f"ngdist run did not end within {timeout} s:\n{exc.stdout!r}\n{exc.stderr!r}")


def start(tmp_path: Path, path: Path, n: int = 2) -> subprocess.Popen:
    """``ngdist run`` in the background; returns once every rank printed "ready"."""
    proc = subprocess.Popen([sys.executable, "-m", "ngdist", "run", "-n", str(n), "--",
                             sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV, cwd=tmp_path)
    seen, deadline = b"", time.monotonic() + LIMIT
    while seen.count(b"ready") < n:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            cleanup(path)
            pytest.fail(f"the ranks did not start: {seen!r} {proc.stderr.read()!r}")
        seen += os.read(proc.stdout.fileno(), 4096)
    proc.seen = seen  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, path: Path, within: float) -> tuple[str, str, float]:
    """Wait for the launcher (at most ``within`` s); its stdout, stderr and the time taken."""
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        cleanup(path)
        pytest.fail(f"ngdist run still running {within} s after the signal")
    return (proc.seen + out).decode(), err.decode(), time.monotonic() - t0  # type: ignore


def gone_within(path: Path, seconds: float) -> str:
    """'' once no process names ``path`` (waiting at most ``seconds``), else what is left."""
    deadline = time.monotonic() + seconds
    while alive(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(path)
    cleanup(path)
    return left


SLEEPER = """
import time
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""

# ----------------------------------------------------------------------------- the job

FAILS_EARLY = """
import os, sys
import numpy as np
if os.environ["PMI_RANK"] == "1":
    np.load("missing.npz")  # this node lacks its data: fails before any collective
import ngdist
from ngdist import zoo
ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=60)
print("rank 0 compiled", flush=True)
"""


@pytest.mark.mpi
def test_a_rank_failing_early_stops_the_others_and_is_named(tmp_path):
    path = script(tmp_path, FAILS_EARLY)
    t0 = time.monotonic()
    proc = ngdist_run(tmp_path, path)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, (elapsed, proc.stderr)  # not the 60 s timeout (nor MPI_Init forever)
    assert proc.returncode == 1, proc.stderr
    assert "[rank 1] FileNotFoundError: [Errno 2] No such file or directory: 'missing.npz'" \
        in proc.stderr
    table = proc.stderr[proc.stderr.index("ngdist: rank 1 failed"):].splitlines()
    assert table[0] == "ngdist: rank 1 failed (exit 1); stopped the other 1 rank"
    assert table[1].split() == ["rank", "status", "first", "error", "line"]
    assert table[2].split() == ["0", "stopped:", "Terminated", "(signal", "15)", "-"]
    assert table[3].split(None, 3) == ["1", "exit", "1", "FileNotFoundError: [Errno 2] No such "
                                       "file or directory: 'missing.npz'"]
    assert len(table) == 4
    assert "rank 0 compiled" not in proc.stdout
    assert gone_within(path, 0) == ""


@pytest.mark.mpi
@pytest.mark.parametrize("sig, status, line", [
    (signal.SIGTERM, 143, "ngdist: terminated (SIGTERM); stopped 2 ranks\n"),
    (signal.SIGHUP, 129, "ngdist: hung up (SIGHUP); stopped 2 ranks\n")])
def test_sigterm_and_sighup_stop_every_rank(tmp_path, sig, status, line):
    path = script(tmp_path, SLEEPER)
    proc = start(tmp_path, path)
    proc.send_signal(sig)
    out, err, elapsed = finish(proc, path, within=10)
    assert (proc.returncode, err) == (status, line)
    assert sorted(out.splitlines()) == ["[rank 0] ready", "[rank 1] ready"]
    assert gone_within(path, 10 - elapsed) == ""


NGDIST_TRAINING = """
import numpy as np, ngdist
from ngdist import zoo
tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=30)
x, y = np.ones((4, 64), np.float32), np.arange(4)
tr.step({"x": x, "y": y})
print("ready", flush=True)
while True:
    tr.step({"x": x, "y": y})
"""


@pytest.mark.mpi
def test_ctrl_c_stops_training_ranks_with_one_line_and_no_traceback(tmp_path):
    path = script(tmp_path, NGDIST_TRAINING)
    proc = start(tmp_path, path)
    proc.send_signal(signal.SIGINT)  # what a terminal sends the foreground launcher on Ctrl-C
    out, err, elapsed = finish(proc, path, within=10)
    assert proc.returncode == 130
    assert err == "ngdist: interrupted; stopped 2 ranks\n"
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert gone_within(path, 10 - elapsed) == ""


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", __file__])
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("again", [False, True])
def test_ranks_that_ignore_sigterm_are_killed_with_their_children(tmp_path, again):
    """SIGKILL 5 s after SIGTERM, or at once on a second signal (a second Ctrl-C)."""
    path = script(tmp_path, STUBBORN)
    proc = start(tmp_path, path)
    deadline = time.monotonic() + 10
    while alive(path).count("time.sleep(600)") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)  # each rank's helper process (just started)
    assert alive(path).count("time.sleep(600)") == 2
    proc.send_signal(signal.SIGTERM)
    if again:
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
    out, err, elapsed = finish(proc, path, within=15)
    assert proc.returncode == 143
    assert err.startswith("ngdist: terminated (SIGTERM); stopped 2 ranks (")
    assert "killed: still running 5 s after SIGTERM)" in err
    assert elapsed < 4 if again else 5 <= elapsed < 10
    assert gone_within(path, 1) == ""


@pytest.mark.mpi
def test_a_killed_launcher_leaves_no_rank_behind(tmp_path):
    """Even SIGKILL, which the launcher cannot handle: mpiexec gets SIGTERM from the kernel."""
    path = script(tmp_path, SLEEPER)
    proc = start(tmp_path, path)
    proc.kill()
    proc.communicate(timeout=10)
    assert gone_within(path, 10) == ""


OUTPUT = """
import os, sys, time
r = os.environ["PMI_RANK"]
for i in range(200):
    print(f"line {i} of rank {r}")
sys.stdout.flush()
sys.stdout.write(f"start of a line of rank {r}, ")
sys.stdout.flush()
time.sleep(0.05)
sys.stdout.write("its end\\n")
print(f"a warning of rank {r}", file=sys.stderr)
"""


@pytest.mark.mpi
def test_output_is_prefixed_whole_lines_and_logged_per_rank(tmp_path):
    path = script(tmp_path, OUTPUT)
    proc = ngdist_run(tmp_path, path, options=("--log-dir", "logs"))
    assert proc.returncode == 0, proc.stderr
    for r in (0, 1):
        mine = [line for line in proc.stdout.splitlines() if line.startswith(f"[rank {r}] ")]
        assert mine[:200] == [f"[rank {r}] line {i} of rank {r}" for i in range(200)]
        assert mine[200:] == [f"[rank {r}] start of a line of rank {r}, its end"]
        assert f"[rank {r}] a warning of rank {r}\n" in proc.stderr
        log = (tmp_path / "logs" / f"rank.{r}.log").read_text().splitlines()
        assert sorted(log) == sorted([f"line {i} of rank {r}" for i in range(200)]
                                     + [f"start of a line of rank {r}, its end",
                                        f"a warning of rank {r}"])
    assert len(proc.stdout.splitlines()) == 402
    assert proc.stderr.count("\n") == 2  # the two warnings, nothing from ngdist
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank.0.log", "rank.1.log"]
    plain = ngdist_run(tmp_path, path, options=("--no-prefix",))
    assert plain.returncode == 0, plain.stderr
    assert "[rank" not in plain.stdout + plain.stderr
    assert sorted(plain.stdout.splitlines()) == sorted(
        [f"line {i} of rank {r}" for i in range(200) for r in (0, 1)]
        + [f"start of a line of rank {r}, its end" for r in (0, 1)])


EXITS = """
import os, sys
r = os.environ["PMI_RANK"]
print(f"rank {r} done", flush=True)
if r == "1":
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    print("error: the loss is nan", file=sys.stderr, flush=True)
    sys.exit(3)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("how, status, row", [
    ("exit", 3, ["1", "exit", "3", "error: the loss is nan"]),
    ("kill", 137, ["1", "Killed", "(signal", "9)", "-"])])
def test_the_exit_status_is_the_failed_ranks(tmp_path, how, status, row):
    path = script(tmp_path, EXITS)
    proc = ngdist_run(tmp_path, path, how)
    assert proc.returncode == status, proc.stderr
    table = proc.stderr[proc.stderr.index("ngdist: rank 1 failed"):].splitlines()
    assert [line.split(None, len(row) - 1) for line in table[2:]] == [["0", "exit", "0", "-"],
                                                                      row]
    assert sorted(proc.stdout.splitlines()) == ["[rank 0] rank 0 done", "[rank 1] rank 1 done"]


RAISES = """
import numpy as np, ngdist
from ngdist import zoo
tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1), timeout=30)
if tr.rank == 1:
    raise ValueError("bad batch (simulated)")
tr.step({"x": np.ones((4, 64), np.float32), "y": np.arange(4)})
"""


@pytest.mark.mpi
def test_a_rank_that_aborts_the_mpi_job_is_named_with_its_exception(tmp_path):
    path = script(tmp_path, RAISES)
    proc = ngdist_run(tmp_path, path)
    assert proc.returncode == 1, proc.stderr
    table = proc.stderr[proc.stderr.index("ngdist: rank 1 failed"):].splitlines()
    assert table[0] == "ngdist: rank 1 failed (MPI_Abort(1))"
    assert table[2].split(None, 1)[0] == "0"  # killed with the job; its status is unknown
    assert table[3].split(None, 2) == ["1", "MPI_Abort(1)", "ValueError: bad batch (simulated)"]
    assert gone_within(path, 5) == ""


# ----------------------------------------------------------------------------- output router

def route(chunks: list[tuple[str, bytes]], **kw) -> tuple[str, str, OutputRouter, list]:
    out, err, markers = io.BytesIO(), io.BytesIO(), []
    router = OutputRouter({"stdout": out, "stderr": err},
                          on_marker=lambda r, f: markers.append((r, f)), **kw)
    for stream, data in chunks:
        router.feed(stream, data)
    router.close()
    return out.getvalue().decode(), err.getvalue().decode(), router, markers


def test_router_splits_hydras_labelled_stream_into_whole_prefixed_lines():
    chunks = [("stdout", b"\x1e0\x1fa0\n\x1e0\x1fb0\n\x1e1\x1fa1\n\x1e"),  # a label cut in two
              ("stdout", b"1\x1fpart of 1, \x1e0\x1fpart of 0, \x1e1\x1fend 1\n"),
              ("stdout", b"\x1e0\x1fend 0\nmpiexec's own message\n")]
    out, _, _, _ = route(chunks)
    assert out.splitlines() == ["[rank 0] a0", "[rank 0] b0", "[rank 1] a1",
                                "[rank 1] part of 1, end 1", "[rank 0] part of 0, end 0",
                                "mpiexec's own message"]
    plain, _, _, _ = route(chunks, prefix=False)
    assert plain.splitlines()[3:] == ["part of 1, end 1", "part of 0, end 0",
                                      "mpiexec's own message"]


def test_router_progress_bar_redraws_and_idle_lines():
    out, err, _, _ = route([("stderr", b"\x1e0\x1f\r 10%\x1e0\x1f\r 50%\x1e0\x1f\r100%\n")])
    assert (out, err) == ("", "\r[rank 0]  10%\r[rank 0]  50%\r[rank 0] 100%\n")
    buf = io.BytesIO()
    router = OutputRouter({"stdout": buf})
    router.feed("stdout", b"\x1e0\x1fprompt> ")
    assert buf.getvalue() == b""
    router.flush_idle(time.monotonic() + 1)  # unfinished for a while: written as it is
    router.feed("stdout", b"\x1e1\x1fother\n\x1e0\x1fanswer\n")
    assert buf.getvalue() == b"[rank 0] prompt> \n[rank 1] other\n[rank 0] answer\n"


def test_rank_log_keeps_a_progress_bar_sampled_not_every_redraw(tmp_path, monkeypatch):
    bar = [("stderr", b"\x1e0\x1f\r 10%\x1e0\x1f\r 50%\x1e0\x1f\r 90%\x1e0\x1f\r100%\n"),
           ("stdout", b"\x1e0\x1fdone\n")]
    _, err, _, _ = route(bar, log_dir=tmp_path / "a")
    assert err == "\r[rank 0]  10%\r[rank 0]  50%\r[rank 0]  90%\r[rank 0] 100%\n"  # terminal
    assert (tmp_path / "a" / "rank.0.log").read_text() == " 10%\n100%\ndone\n"
    monkeypatch.setattr(rank_output, "LOG_REDRAW_S", 0.0)  # every redraw is due
    route(bar, log_dir=tmp_path / "b")
    assert (tmp_path / "b" / "rank.0.log").read_text() == " 10%\n 50%\n 90%\n100%\ndone\n"
    monkeypatch.setattr(rank_output, "LOG_REDRAW_S", 3600.0)
    route([("stderr", b"\x1e1\x1f\r 10%\x1e1\x1f\r 20%\x1e1\x1f\r")], log_dir=tmp_path / "c")
    assert (tmp_path / "c" / "rank.1.log").read_text() == " 10%\n 20%\n"  # cut short: its last


def test_rank_log_joins_a_line_written_early_to_the_terminal(tmp_path):
    buf = io.BytesIO()
    router = OutputRouter({"stdout": buf}, log_dir=tmp_path)
    router.feed("stdout", b"\x1e0\x1fprompt> ")
    router.flush_idle(time.monotonic() + 1)
    router.feed("stdout", b"\x1e0\x1fanswer\n")
    router.close()
    assert buf.getvalue() == b"[rank 0] prompt> answer\n"
    assert (tmp_path / "rank.0.log").read_text() == "prompt> answer\n"


def test_router_takes_out_markers_and_logs_per_rank(tmp_path):
    chunks = [("stderr", b"\x1e1\x1f" + rankwrap.marker(pid=42)),
              ("stdout", b"\x1e1\x1fhello\n"),
              ("stderr", b"\x1e1\x1fno newline at the end"),
              ("stderr", b"\x1e1\x1f" + rankwrap.marker(code=3))]
    out, err, _, markers = route(chunks, log_dir=tmp_path / "logs")
    assert markers == [(1, {"pid": 42}), (1, {"code": 3})]
    assert (out, err) == ("[rank 1] hello\n", "[rank 1] no newline at the end\n")
    assert (tmp_path / "logs" / "rank.1.log").read_text() == \
        "hello\nno newline at the end\n"


def test_rank_scan_prefers_the_exception_of_a_traceback():
    scan = RankScan()
    for line in ["epoch 1 mean_squared_error 0.3", "Traceback (most recent call last):",
                 '  File "train.py", line 3, in <module>', '    raise OSError("read error")',
                 "OSError: read error", "ValueError: later"]:
        scan.line("stderr", line + "\n")
    assert scan.first == "OSError: read error"
    scan = RankScan()
    scan.line("stdout", "loss 0.5\n")
    scan.line("stderr", "ngdist: error on rank 1: CommError: lost\n")
    scan.line("stderr", "Abort(1) on node 1 (rank 1 in comm 0): application called "
                        "MPI_Abort(MPI_COMM_WORLD, 1) - process 1\n")
    assert (scan.first, scan.abort_code) == ("ngdist: error on rank 1: CommError: lost", 1)
    # MPICH's own line lost with the launcher's exit: ngdist's announcement still tells
    scan = RankScan()
    scan.line("stderr", "ngdist: error on rank 1: CommError: lost\n")
    scan.line("stderr", ABORT_LINE.format(rank=1, code=3))
    assert (scan.first, scan.abort_code) == ("ngdist: error on rank 1: CommError: lost", 3)


# ----------------------------------------------------------------------------- rank wrapper

COUNTS_SIGTERM = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print("ready", flush=True)
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.5)  # a second delivery would arrive by now
print(f"SIGTERM x{len(got)}", flush=True)
sys.exit(5)
"""


def wrapped(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", rankwrap.__file__, "--", *cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_wrapper_reports_and_mirrors_the_exit_status(tmp_path):
    proc = wrapped([sys.executable, "-c", "import sys; print('hi'); sys.exit(7)"])
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (7, b"hi\n")
    assert err == rankwrap.marker(pid=proc.pid) + rankwrap.marker(code=7)
    proc = wrapped([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err.splitlines()[-1] + b"\n") == (137, rankwrap.marker(signal=9))
    proc = wrapped([str(tmp_path / "no-such-program")])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 127
    assert b"ngdist: error: cannot run " + str(tmp_path).encode() in err
    assert err.endswith(rankwrap.marker(code=127))


def test_a_command_dying_in_native_code_prints_its_python_stack(tmp_path):
    """SIGFPE (an onnxruntime kernel dividing by zero) kills a rank with no Python
    exception: the wrapped command runs with the fault handler on, so its output says where."""
    code = "import os, signal\ndef step():\n    os.kill(os.getpid(), signal.SIGFPE)\nstep()\n"
    proc = wrapped([sys.executable, "-c", code])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGFPE
    assert b"Fatal Python error: Floating point exception" in err
    assert b'line 3 in step' in err
    assert err.endswith(rankwrap.marker(signal=signal.SIGFPE))


@pytest.mark.parametrize("sender", ["other", "parent"])
def test_wrapper_forwards_sigterm_once_unless_its_parent_signals_the_group(tmp_path, sender):
    path = script(tmp_path, COUNTS_SIGTERM)
    proc = wrapped([sys.executable, str(path)])
    assert proc.stdout.readline() == b"ready\n"
    if sender == "other":  # e.g. `kill PID` from a shell: forwarded
        subprocess.run(["kill", "-TERM", str(proc.pid)], check=True)
    else:  # hydra signals the process group itself: the command has it, nothing to forward
        os.killpg(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGUSR1)  # hydra's "a peer failed": the wrapper survives it
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert out == b"SIGTERM x1\n"
    assert proc.returncode == 5 and err.endswith(rankwrap.marker(code=5))
