"""ngdist.allreduce_mean: the mean of a number or an array over the ranks, the same on each."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

import ngdist


def test_one_rank_gives_the_value_back():
    assert ngdist.allreduce_mean(0.25) == 0.25 and type(ngdist.allreduce_mean(0.25)) is float
    assert type(ngdist.allreduce_mean(np.float32(1.5))) is float
    assert ngdist.allreduce_mean(3) == 3.0 and type(ngdist.allreduce_mean(3)) is float
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = ngdist.allreduce_mean(value)
    assert out is not value and not np.shares_memory(out, value)
    assert out.dtype == np.float32 and np.array_equal(out, value)
    out = ngdist.allreduce_mean(np.array([1, 2]))
    assert out.dtype == np.float64 and np.array_equal(out, [1.0, 2.0])


def test_refuses_what_is_not_a_number_or_an_array_of_real_numbers():
    with pytest.raises(TypeError, match=r"^ngdist.allreduce_mean\(\) takes a number or a numpy "
                                        r"array, not list$"):
        ngdist.allreduce_mean([1.0, 2.0])
    with pytest.raises(TypeError, match=r"takes an array of real numbers, not of dtype <U1$"):
        ngdist.allreduce_mean(np.array(["a"]))


def test_malformed_timeout_is_refused(monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "abc")
    with pytest.raises(ngdist.CommError, match="NGDIST_TIMEOUT='abc' is not a number"):
        ngdist.allreduce_mean(1.0)
    assert ngdist.allreduce_mean(1.0, timeout=5) == 1.0


MEANS = r"""
import json
import numpy as np
import ngdist

r = ngdist.rank()
arr = np.array([r, 2 * r, 1 / 3 + r], np.float32)
ints = np.array([[r, 1], [2, 3 * r]])
scalar = ngdist.allreduce_mean(float(r + 1), timeout=30)
out = {
    "size": ngdist.size(),
    "scalar": [type(scalar).__name__, scalar.hex()],
    "int": ngdist.allreduce_mean(r, timeout=30),
    "f32": ngdist.allreduce_mean(arr, timeout=30),
    "ints": ngdist.allreduce_mean(ints, timeout=30),
    "zero_d": ngdist.allreduce_mean(np.array(r * 0.1), timeout=30),
}
out["arr_untouched"] = arr.tolist() == np.array([r, 2 * r, 1 / 3 + r], np.float32).tolist()
try:
    ngdist.allreduce_mean(np.zeros(3 if r == 0 else 2), timeout=30)
    out["shape_error"] = None
except ngdist.CommError as exc:
    out["shape_error"] = str(exc)
for k in ("f32", "ints", "zero_d"):
    out[k] = [str(out[k].dtype), list(out[k].shape), out[k].tobytes().hex()]
with open(f"out.{r}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.mpi
def test_mean_over_two_ranks_is_the_same_on_both(ranks, tmp_path):
    ranks(2, MEANS, timeout=120, env={"NGDIST_TIMEOUT": "30"})
    out = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    shape_errors = [o.pop("shape_error") for o in out]
    assert out[0] == out[1]  # bit for bit
    got = out[0]
    assert got["size"] == 2 and got["arr_untouched"]
    assert got["scalar"] == ["float", (1.5).hex()]
    assert got["int"] == 0.5
    f32 = np.frombuffer(bytes.fromhex(got["f32"][2]), np.float32)
    assert got["f32"][:2] == ["float32", [3]]
    np.testing.assert_allclose(f32, [0.5, 1.0, 1 / 3 + 0.5], rtol=1e-6)
    ints = np.frombuffer(bytes.fromhex(got["ints"][2]), np.float64).reshape(got["ints"][1])
    assert got["ints"][:2] == ["float64", [2, 2]]
    assert np.array_equal(ints, [[0.5, 1.0], [2.0, 1.5]])
    assert got["zero_d"][:2] == ["float64", []]
    assert np.frombuffer(bytes.fromhex(got["zero_d"][2]), np.float64)[0] == pytest.approx(0.05)
    assert shape_errors == [
        f"ngdist.allreduce_mean(): ranks [1] passed a value of another shape than rank 0 "
        f"(this is rank {r}, shape {shape}); every rank must pass the same shape"
        for r, shape in ((0, (3,)), (1, (2,)))]


ABSENT = r"""
import time
import ngdist

ngdist.barrier(timeout=30)  # the job's start-up exchanges are behind both ranks
if ngdist.rank() == 1:
    time.sleep(60)  # never takes part
ngdist.allreduce_mean(1.0, timeout=2)
"""


@pytest.mark.mpi
def test_a_rank_that_never_calls_fails_the_job_after_the_timeout(ranks):
    start = time.monotonic()
    proc = ranks(2, ABSENT, timeout=60, check=False)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert ("CommTimeoutError: 'ngdist.allreduce_mean() shape check' did not complete within "
            "2 s on rank 0 (waiting for ranks 0..1)") in out, out
    assert elapsed < 40, out
