"""Shared test helpers: run a script on N ranks under the venv's real mpiexec, with a timeout;
the skip policy of ``--strict-skips`` (tests/skip_policy.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skip_policy import (pytest_addoption, pytest_collectreport,  # noqa: F401 - hooks
                         pytest_configure, pytest_runtest_logreport, pytest_sessionfinish,
                         pytest_terminal_summary, pytest_unconfigure)
from zoo_tier import pytest_collection_modifyitems, pytest_generate_tests  # noqa: F401 - hooks

ROOT = Path(__file__).resolve().parents[1]


def mpiexec(n: int) -> list[str]:
    """The same launch command as `ngdist run` (ngdist.launch), so tests see what users see."""
    from ngdist.errors import NgdistError
    from ngdist.comm.launch import mpiexec_cmd

    try:
        return mpiexec_cmd(n)
    except NgdistError as exc:  # mpiexec is installed with ngdist: a broken install
        pytest.fail(str(exc))


def run_ranks(n: int, script: str, tmp_path: Path, *, timeout: float = 120,
              args: list[str] | None = None, env: dict[str, str] | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """Write ``script`` to a file and run it on ``n`` ranks; fail (not hang) after ``timeout``."""
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(script))
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [*mpiexec(n), sys.executable, str(path), *(args or [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["pkill", "-f", str(path)], check=False)
        pytest.fail(f"{n} ranks did not finish within {timeout} s (hang):\n"
                    f"{(exc.stdout or b'')!s}\n{(exc.stderr or b'')!s}")
    if check and proc.returncode != 0:
        pytest.fail(f"{n} ranks exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                    f"stderr:\n{proc.stderr}")
    return proc


MARGIN = 20  # seconds a test keeps, past its ranks' own limit, to report their hang


def timeout_of_test(node: pytest.Item) -> float:
    """The pytest-timeout limit of ``node`` (its ``timeout`` marker, else the ini value)."""
    marker = node.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(node.config.getini("timeout") or 0)


@pytest.fixture
def ranks(tmp_path, request):
    """``ranks(n, script, **kw)`` runs a script under mpiexec in tmp_path. Its ``timeout``
    must be below the test's pytest-timeout by MARGIN, so that a hang fails with the ranks'
    own report (their output) instead of pytest-timeout's stack dump."""
    limit = timeout_of_test(request.node)

    def run(n: int, script: str, **kw):
        timeout = kw.get("timeout", 120)
        if limit and timeout > limit - MARGIN:
            pytest.fail(f"ranks(timeout={timeout:g}) must be at most {limit - MARGIN:g} s: the "
                        f"test's pytest-timeout is {limit:g} s")
        return run_ranks(n, script, tmp_path, **kw)
    return run


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m ngdist ARGS`` in ``cwd`` (the user's view of the CLI), bounded in time."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "ngdist", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120)


def ngdist_train(tmp: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m ngdist train ARGS`` in ``tmp`` (one thread per rank, collectives bounded by
    NGDIST_TIMEOUT=60); fails, not hangs, after ``timeout``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NGDIST_TIMEOUT": "60",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        return subprocess.run([sys.executable, "-m", "ngdist", "train", *args], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"ngdist train did not finish within {timeout} s:\n{exc.stderr}")


TRAIN_SAMPLES = 640


@pytest.fixture
def train_files(tmp_path):
    """tmp_path with ``mlp.onnx`` (digits MLP 64-32-10) and ``digits.npz`` (the first
    TRAIN_SAMPLES training digits as x, y)."""
    import numpy as np
    import onnx

    from ngdist import zoo
    from ngdist.data import load_digits

    x_train, y_train, _, _ = load_digits()
    onnx.save(zoo.mlp((64, 32, 10), seed=0), tmp_path / "mlp.onnx")
    np.savez(tmp_path / "digits.npz", x=x_train[:TRAIN_SAMPLES], y=y_train[:TRAIN_SAMPLES])
    return tmp_path


@pytest.fixture
def cli():
    """``cli(*args, cwd=...)`` runs the ngdist command line; see run_cli."""
    return run_cli


def assert_same_trajectory(a, b, x, y, steps: int, batch: int) -> None:
    """Trainers ``a`` and ``b`` fed the same consecutive batches give the same loss at every
    step and bit-identical parameters at the end."""
    import numpy as np

    for s in range(steps):
        feed = {"x": x[s * batch:(s + 1) * batch], "y": y[s * batch:(s + 1) * batch]}
        assert a.step(feed).loss == b.step(feed).loss, s
    pa, pb = a.parameters(), b.parameters()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


@pytest.fixture
def same_trajectory():
    """``same_trajectory(a, b, x, y, steps, batch)``: see assert_same_trajectory."""
    return assert_same_trajectory


@pytest.fixture(scope="session", autouse=True)
def _no_shared_memory_left_behind():
    """Tests that kill ranks under a bare mpiexec (no ``ngdist run`` to clean up after them)
    leave MPICH's segments in /dev/shm; the session removes those its jobs left."""
    from ngdist.comm import leftovers

    before = leftovers.snapshot()
    yield
    leftovers.remove(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module's tests (restored after): the models under
    test are small, and on a 2-core machine torch's second thread contends with onnxruntime's
    pool and other processes (a file of vision models took 3x longer with two threads)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
