"""What a rank of ``ngdist run`` starts with: the interpreter (``-- python ...`` runs the Python
ngdist runs in when the ``python`` on PATH cannot import ngdist) and torchrun's variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 90
SYSTEM_PYTHON = Path("/usr/bin/python3")

REPORT = """\
import json, os, sys
names = ["VIA_WRAPPER", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PMI_RANK", "MASTER_ADDR"]
print("ENV " + json.dumps({"exe": sys.executable, **{k: os.environ.get(k) for k in names}}))
"""


def run_ngdist(tmp_path: Path, n: int, python: str, env: dict[str, str]
               ) -> subprocess.CompletedProcess:
    (tmp_path / "report.py").write_text(REPORT)
    cmd = [sys.executable, "-m", "ngdist", "run", "-n", str(n), "--no-prefix", "--", python,
           "report.py"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=LIMIT)


def reports(out: str) -> list[dict]:
    return sorted((json.loads(line[4:]) for line in out.splitlines() if line.startswith("ENV ")),
                  key=lambda r: int(r["RANK"]))


def foreign_path(tmp_path: Path) -> str:
    """A PATH whose python/python3 is a Python that cannot import ngdist (first on it)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).symlink_to(SYSTEM_PYTHON)
    return f"{fake}{os.pathsep}{os.environ['PATH']}"


def clean_env(path: str) -> dict[str, str]:
    """No PYTHONPATH (the system Python must not find ngdist through it), cwd not the repo."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", "RANK": "stale", "WORLD_SIZE": "9"}


@pytest.mark.parametrize("name", ["python", "python3"])
def test_a_python_on_path_without_ngdist_is_replaced_by_ngdists_own(tmp_path, name):
    if not SYSTEM_PYTHON.exists():
        pytest.skip("no /usr/bin/python3 to stand for a Python without ngdist")
    path = foreign_path(tmp_path)
    probe = subprocess.run([name, "-c", "import ngdist"], env=clean_env(path), cwd=tmp_path,
                           capture_output=True, text=True)
    assert "No module named 'ngdist'" in probe.stderr  # the fake python really lacks ngdist
    proc = run_ngdist(tmp_path, 2, name, clean_env(path))
    assert proc.returncode == 0, proc.stderr
    got = reports(proc.stdout)
    assert [r["exe"] for r in got] == [sys.executable] * 2
    line = (f"WARNING ngdist.cli.run: `{name}` on PATH ({tmp_path / 'bin' / name}) cannot import "
            f"ngdist: the ranks run {sys.executable}, the Python ngdist runs in")
    assert proc.stderr.splitlines().count(line) == 1, proc.stderr


def test_a_python_on_path_with_ngdist_runs_as_given(tmp_path):
    venv_bin = str(Path(sys.executable).parent)
    fake = tmp_path / "bin"
    fake.mkdir()
    wrapper = fake / "python"  # another program named python, whose Python has ngdist
    wrapper.write_text(f'#!/bin/sh\nVIA_WRAPPER=1 exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = clean_env(f"{fake}{os.pathsep}{venv_bin}{os.pathsep}{os.environ['PATH']}")
    proc = run_ngdist(tmp_path, 2, "python", env)
    assert proc.returncode == 0, proc.stderr
    assert [r["VIA_WRAPPER"] for r in reports(proc.stdout)] == ["1"] * 2
    assert "cannot import ngdist" not in proc.stderr


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_see_torchruns_variables(tmp_path, n):
    env = clean_env(os.environ["PATH"])
    proc = run_ngdist(tmp_path, n, sys.executable, env)
    assert proc.returncode == 0, proc.stderr
    got = reports(proc.stdout)
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in got] \
        == [(str(r), str(r), str(n), str(n)) for r in range(n)]  # one host: local = global
    assert [r["PMI_RANK"] for r in got] == [str(r) for r in range(n)]
    assert {r["MASTER_ADDR"] for r in got} == {None}  # no rendezvous: MPI starts the ranks
