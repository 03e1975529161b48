"""``ngdist.launch(fn, n, args)``: a function defined in ``__main__`` (``python -c``, as a
notebook cell defines it) runs on real MPI ranks under the supervisor; the caller gets the
return values in rank order, or a LaunchError with the message of the rank that failed.

Not tested from a Jupyter kernel: jupyter_client and ipykernel are not dependencies of ngdist.
A kernel runs a cell's code in its ``__main__`` namespace on its main thread, with a
``sys.stdout`` that has no ``buffer``; ``python -c`` below gives the same ``__main__`` (no source
file either), and the text-only stdout is tested without ranks.
"""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from ngdist.errors import LaunchError
from ngdist.launcher import _TextSink, dumps

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1"}
LIMIT = 150


def python_c(code: str, tmp_path: Path, timeout: float = LIMIT) -> subprocess.CompletedProcess:
    """``code`` as ``python -c`` (its functions live in a ``__main__`` without a file)."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, env=ENV, cwd=tmp_path, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"python -c did not end within {timeout} s:\n{exc.stdout!r}\n{exc.stderr!r}")


@pytest.mark.parametrize("n", [2, 4])
def test_a_main_function_returns_every_ranks_value_in_rank_order(tmp_path, n):
    proc = python_c(f"""
        import numpy as np
        import ngdist

        OFFSET = 100

        def fact(k):                      # a global that is a recursive __main__ function
            return 1 if k <= 1 else k * fact(k - 1)

        def make(scale):
            def on_rank(extra, *, also=0):    # a closure defined in __main__
                r = ngdist.rank()
                mean = ngdist.allreduce_mean(np.array([r], np.float64))
                return (r, ngdist.size(), float(mean[0]), fact(4) + OFFSET + extra + also,
                        (lambda v: v * scale)(r))
            return on_rank

        print("RESULT", ngdist.launch(make(3), n={n}, args=(1,), kwargs={{"also": 2}}))
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    mean = (n - 1) / 2
    assert line == "RESULT " + repr([(r, n, mean, 127, 3 * r) for r in range(n)])


def test_a_main_function_trains_and_every_rank_ends_with_the_same_bytes(tmp_path):
    proc = python_c("""
        import hashlib
        import ngdist
        import ngdist.zoo as zoo
        from ngdist.data import load_digits

        def train(steps, batch):
            x, y, _, _ = load_digits()
            trainer = ngdist.compile(zoo.mlp((64, 16, 10)), loss="softmax_cross_entropy",
                                     labels="y", optimizer=ngdist.optim.SGD(lr=0.1))
            batches = [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
                       for i in range(steps)]
            for xb, yb in trainer.shard(batches):
                stats = trainer.step({"x": xb, "y": yb})
            digest = hashlib.sha256()
            for name, value in sorted(trainer.parameters().items()):
                digest.update(name.encode() + value.tobytes())
            return digest.hexdigest(), float(stats.loss)

        print("RESULT", ngdist.launch(train, n=2, args=(5, 64)))
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = eval(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert len(result) == 2 and result[0][0] == result[1][0]  # parameters bit for bit
    assert all(np.isfinite(loss) and 0 < loss < 2.5 for _, loss in result)


@pytest.mark.parametrize("n", [2, 4])
def test_a_failing_rank_reraises_in_the_caller_with_its_message(tmp_path, n):
    """(grace=1: the others, waiting in a barrier, are stopped 1 s after rank 1 fails, not
    the default 3 s; the grace period has its own test in test_supervisor.py)"""
    started = time.monotonic()
    proc = python_c(f"""
        import ngdist

        def load(path):
            if ngdist.rank() == 1:
                raise FileNotFoundError(f"rank 1 cannot find its data in {{path}}")
            ngdist.barrier()
            return 0

        try:
            ngdist.launch(load, n={n}, args=("/data",), grace=1)
        except ngdist.LaunchError as exc:
            print("CAUGHT", exc.rank, repr(str(exc)), repr(exc.__cause__))
            print("TRACEBACK", "in load" in exc.remote_traceback)
        """, tmp_path)
    assert time.monotonic() - started < 60, "the job did not end promptly after rank 1 failed"
    assert proc.returncode == 0, proc.stderr
    caught = [x for x in proc.stdout.splitlines() if x.startswith(("CAUGHT", "TRACEBACK"))]
    message = "rank 1 failed: FileNotFoundError: rank 1 cannot find its data in /data"
    assert caught == [f"CAUGHT 1 {message!r} FileNotFoundError('rank 1 cannot find its data in "
                      "/data')", "TRACEBACK True"]
    assert "[rank 1] FileNotFoundError: rank 1 cannot find its data in /data" in proc.stderr


def test_a_class_defined_in_main_is_refused_before_any_rank_starts(tmp_path):
    proc = python_c("""
        import ngdist

        class Config:
            pass

        def use():
            return Config()

        try:
            ngdist.launch(use, n=2)
        except ngdist.LaunchError as exc:
            print("CAUGHT", exc)
        """, tmp_path, timeout=60)
    assert proc.stdout.strip() == (
        "CAUGHT class Config is defined in __main__ (a script or a notebook), which the ranks "
        "cannot import: ngdist.launch sends functions by value but classes by name; move it into "
        "a module")


def test_functions_by_value_keep_defaults_closures_and_shared_objects():
    shared = np.arange(3)

    def outer(k=2):
        return lambda: (shared, k)

    fn = pickle.loads(dumps(outer(5)))
    got, k = fn()
    assert k == 5 and got.tobytes() == shared.tobytes()
    a, b = pickle.loads(dumps((outer, outer)))
    assert a is b and a()() [1] == 2
    assert pickle.loads(dumps(np.mean)) is np.mean  # importable functions go by name


def test_ranks_output_reaches_a_text_only_stdout():
    class Notebook(io.StringIO):  # ipykernel's OutStream: text, no .buffer
        pass

    out = Notebook()
    sink = _TextSink(out)
    sink.write(b"[rank 0] caf\xc3\xa9\n")
    sink.flush()
    assert out.getvalue() == "[rank 0] café\n"


def test_bad_arguments_are_refused():
    import ngdist
    with pytest.raises(LaunchError, match="at least 1 rank, got n=0"):
        ngdist.launch(print, n=0)
    with pytest.raises(LaunchError, match="needs a function to run, got int"):
        ngdist.launch(3, n=2)  # type: ignore[arg-type]
