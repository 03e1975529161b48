"""The suite's skip policy (tests/skip_policy.py, ``--strict-skips`` in .ci/run): a skip for a
missing GPU or a root-only case passes; any other skip or xfail fails the run and is named;
the ``ranks`` fixture refuses a limit that leaves pytest-timeout no room for its own report."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

ALLOWED = '''
import os, pytest

@pytest.mark.skipif(True, reason="needs a GPU onnxruntime can use")
def test_gpu():
    pass

@pytest.mark.skipif(True, reason="onnxruntime can use a GPU here")
def test_no_gpu():
    pass

def test_root():
    pytest.skip("slurmd and munged of a private test cluster need root")

@pytest.mark.skipif(True, reason="root reads files whatever their permissions")
def test_as_root():
    pass

def test_passes():
    assert True
'''

NOT_ALLOWED = {
    "importorskip": 'import pytest\n\npytest.importorskip("no_such_extra_module")\n\ndef test_x():\n    pass\n',
    "probe": 'import pytest\n\n@pytest.mark.skipif(True, reason="onnxruntime has no NCHWc '
             'kernels here")\ndef test_x():\n    pass\n',
    "service": 'import pytest\n\ndef test_x():\n    pytest.skip("the one-node Slurm cluster '
               'did not come up as root within 60 s")\n',
    "xfail": 'import pytest\n\n@pytest.mark.xfail(reason="known bug")\ndef test_x():\n'
             '    assert False\n',
}


def _pytest(folder: Path, *args: str, plugin: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    load = ["-p", "skip_policy"] if plugin else []  # else the folder's conftest loads it
    return subprocess.run([sys.executable, "-m", "pytest", *load, "-p", "no:cacheprovider",
                           "-q", "-rs", "--rootdir", str(folder), str(folder), *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=folder)


def test_skips_for_a_missing_gpu_or_root_pass_under_strict_skips(tmp_path):
    (tmp_path / "test_allowed.py").write_text(ALLOWED)
    proc = _pytest(tmp_path, "--strict-skips")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 4 skipped" in proc.stdout


@pytest.mark.parametrize("case", list(NOT_ALLOWED))
def test_any_other_skip_or_xfail_fails_the_run_and_is_named(tmp_path, case):
    (tmp_path / f"test_{case}.py").write_text(NOT_ALLOWED[case])
    assert _pytest(tmp_path).returncode in (0, 5)  # without the option: an ordinary skip
    proc = _pytest(tmp_path, "--strict-skips")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "skips not allowed (--strict-skips)" in proc.stdout
    assert f"test_{case}.py" in proc.stdout
    assert "1 skipped or xfailed for a reason other than a missing GPU or a root-only case: " \
           "the run fails" in proc.stdout


def test_the_ci_script_runs_pytest_with_strict_skips():
    ci = (HERE.parent / ".ci" / "run").read_text()
    assert "pytest -q -rs --strict-skips" in ci


def test_the_readmes_test_command_is_the_ci_scripts():
    """The README's second command installs what .ci/run installs and runs the same pytest."""
    readme = (HERE.parent / "README.md").read_text()
    ci = (HERE.parent / ".ci" / "run").read_text()
    extras = re.search(r'pip install -q -e "(\.\[[^]]+\])"', ci).group(1)
    pytest_line = re.search(r"^\.venv/bin/python -m pytest .*$", ci, re.M).group(0)
    command = f'.venv/bin/pip install -e "{extras}" && {pytest_line}\n'
    assert command in readme


RANKS = '''
import pytest

@pytest.mark.timeout(60)
def test_long_inner_limit(ranks):
    ranks(2, "print('never run')", timeout=50)
'''


def test_ranks_refuses_a_limit_that_pytest_timeout_would_cut_short(tmp_path):
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())
    (tmp_path / "test_ranks.py").write_text(textwrap.dedent(RANKS))
    proc = _pytest(tmp_path, plugin=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ranks(timeout=50) must be at most 40 s: the test's pytest-timeout is 60 s" \
        in proc.stdout
