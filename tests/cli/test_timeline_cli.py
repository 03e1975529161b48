"""``ngdist run --timeline FILE`` and ``ngdist train --timeline FILE``: one trace for the job.

Oracles: the steps the program takes (their count per rank), the ranks launched, the exact
error line of a path that cannot be written (and that no rank started).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from ngdist import zoo
from ngdist.data import load_digits

ROOT = Path(__file__).resolve().parents[2]

# trains without closing its trainer, from another working directory: the file is written at
# exit, at the path given to the launcher
SCRIPT = r"""
import os
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

os.makedirs("elsewhere", exist_ok=True)
os.chdir("elsewhere")
x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp((64, 16, 10), seed=0), intra_op_threads=1, optimizer="sgd:lr=0.01")
for s in range(3):
    tr.step({"x": x[s * 16:(s + 1) * 16], "y": y[s * 16:(s + 1) * 16]})
"""


def _ngdist(cwd, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NGDIST_TIMEOUT": "60",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("NGDIST_TIMELINE", None)
    try:
        return subprocess.run([sys.executable, "-m", "ngdist", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"ngdist {args[0]} did not finish within {timeout} s:\n{exc.stderr}")


def _steps(trace: dict) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "step":
            out.setdefault(e["pid"], []).append(e["name"])
    return out


@pytest.mark.mpi
def test_run_timeline_is_written_at_exit_for_every_rank(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = _ngdist(tmp_path, "run", "-n", "2", "--timeline", "job.json", "--",
                   sys.executable, "train.py")
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((tmp_path / "job.json").read_text())
    assert _steps(trace) == {r: ["step 1", "step 2", "step 3"] for r in (0, 1)}
    assert not (tmp_path / "elsewhere" / "job.json").exists()


@pytest.mark.mpi
def test_train_timeline_holds_every_step_of_both_ranks(tmp_path):
    x, y, _, _ = load_digits()
    onnx.save(zoo.mlp((64, 16, 10), seed=0), tmp_path / "mlp.onnx")
    np.savez(tmp_path / "digits.npz", x=x[:128], y=y[:128])
    proc = _ngdist(tmp_path, "train", "mlp.onnx", "--data", "digits.npz", "-n", "2",
                   "--batch-size", "16", "--timeline", "train.json")
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((tmp_path / "train.json").read_text())
    assert _steps(trace) == {r: [f"step {k}" for k in range(1, 5)] for r in (0, 1)}  # 128/32
    comm = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"]
    assert {e["pid"] for e in comm} == {0, 1}


@pytest.mark.parametrize("command", ["run", "train"])
def test_a_timeline_in_a_missing_directory_is_refused_before_any_rank_starts(tmp_path, command):
    (tmp_path / "train.py").write_text("open('started', 'w')\n")
    onnx.save(zoo.mlp((64, 16, 10), seed=0), tmp_path / "mlp.onnx")
    x, y, _, _ = load_digits()
    np.savez(tmp_path / "digits.npz", x=x[:64], y=y[:64])
    args = (["run", "-n", "2", "--timeline", "missing/t.json", "--", sys.executable, "train.py"]
            if command == "run" else
            ["train", "mlp.onnx", "--data", "digits.npz", "-n", "2", "--timeline",
             "missing/t.json"])
    proc = _ngdist(tmp_path, *args)
    assert proc.returncode == 1
    missing = tmp_path / "missing"
    assert proc.stderr.strip() == (
        f"ngdist: error: timeline {missing / 't.json'}: the directory {missing} does not "
        "exist; create it first or choose another path for the timeline")
    assert not (tmp_path / "started").exists()
