"""comm/exits.py without MPI: the status a program ends with is known at exit (a SystemExit
never reaches sys.excepthook), a caught SystemExit is never taken for the program's end, and
the wait records peers read."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ngdist.comm import exits

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import atexit, sys
from ngdist.comm import exits
exits.track()
atexit.register(lambda: print("status", exits.exit_status(), file=sys.stderr))
try:
    sys.exit(5)  # caught, and its code read: not the program's end
except SystemExit as exc:
    assert exc.code == 5 and type(exc).__name__ == "SystemExit"
    assert isinstance(exc, SystemExit)
how = sys.argv[1]
if how == "exit0":
    sys.exit(0)
if how == "exit3":
    sys.exit(3)
if how == "message":
    raise SystemExit("rank 1 cannot find its data")
if how == "none":
    sys.exit()
if how == "raise":
    raise ValueError("bad batch")
"""


@pytest.mark.parametrize("how, status, seen", [
    ("return", 0, "(0, 'its program returned')"),
    ("exit0", 0, "(0, 'SystemExit(0)')"),
    ("none", 0, "(0, 'SystemExit(None)')"),
    ("exit3", 3, "(3, 'SystemExit(3)')"),
    ("message", 1, "(1, 'SystemExit: rank 1 cannot find its data')"),
    ("raise", 1, "(1, 'ValueError: bad batch')"),
])
def test_the_exit_status_is_known_at_exit(tmp_path, how, status, seen):
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(PROGRAM))
    proc = subprocess.run([sys.executable, str(path), how], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"status {seen}", proc.stderr


def test_a_peer_is_astray_only_outside_the_step_this_rank_waits_in(monkeypatch, tmp_path):
    monkeypatch.setattr(exits, "WAIT_DIR", str(tmp_path))
    monkeypatch.setattr(exits, "_record", [])
    monkeypatch.setattr(exits, "_published", [0.0])
    me = os.getpid()
    exits.note_step(0, 7, True)  # "the peer": blocked outside any step after 7 steps
    exits.publish_blocked()
    assert (tmp_path / f"ngdist-wait-{me}").exists()
    exits.note_step(8, 7, True)  # "this rank": waits in step 8
    assert exits.astray(me)
    assert "ran out of data after 7 step(s): it waits in a collective outside any step " \
           "while rank 0 waits for it in step 8 (X)" in exits.astray_message("X", 0, ["r"], [me])
    exits.note_step(0, 7, True)
    assert not exits.astray(me)  # a rank between steps counts nobody
    monkeypatch.setattr(exits, "_published", [0.0])
    exits.note_step(8, 7, True)
    exits.publish_blocked()  # the peer blocked in the same step: not astray
    assert not exits.astray(me)
    monkeypatch.setattr(exits, "FRESH_S", -1.0)  # a stale record is of a completed wait
    exits.note_step(9, 8, True)
    assert not exits.astray(me)
    exits.forget()
    assert not (tmp_path / f"ngdist-wait-{me}").exists()
    exits.note_step(0, 0, False)
